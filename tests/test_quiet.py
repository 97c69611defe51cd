"""A clean run prints nothing the user cannot act on: each torchtitan and torch line that `quiet_known_noise` leaves
out, driven through the code that prints it where that is cheap; the HF builder's decay share fitted to a short run
(no warning, the same learning rates); the torchrun shutdown-timeout advice said only where it matters."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

from common import device

device.route_torchtitan_device("cpu")  # before torchtitan is imported below

from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer  # noqa: E402

from common import torchtitan_fixes  # noqa: E402
from common.harness import stops  # noqa: E402
from hf_backend import fixes as hf_fixes  # noqa: E402


@pytest.fixture
def quiet():
    """quiet_known_noise for one test: the root logger's filters and the warning filters as they were after it."""
    root = logging.getLogger()
    before = list(root.filters)
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every warning the filters let through is recorded
        torchtitan_fixes.quiet_known_noise()
        yield
    root.filters[:] = before


# torchtitan 0.3.0's own lines, as it logs them (the file that does, for finding them when torchtitan changes)
CONTRADICTING = {
    # trainer.py, at build: its device table's peak (the A100 fallback on CPU); the step lines' MFU and the [pilot]
    # line use the run's own peak
    "peak": "Peak FLOPS used for computing MFU: 3.120e+14",
    # experiments/transformers_modeling_backend/parallelize.py: tied again at init (`check_embeddings_tied`)
    "untied": "Un-tied embedding/lm_head weights for FSDP compatibility",
    # hf_datasets/text_datasets.py: the name of the loader the project's own data goes through
    "c4_test": "Preparing c4_test dataset from /root/.cache/qwen3-trainium-recipes/assets/corpus-en",
    # trainer.py, after its loop, after a stop as after the last step
    "completed": "Training completed",
}


@pytest.mark.parametrize("name", sorted(CONTRADICTING))
def test_torchtitans_lines_that_contradict_the_project_are_left_out(name, quiet, caplog):
    caplog.set_level(logging.INFO)
    logging.getLogger().info(CONTRADICTING[name])
    logging.getLogger().info("Training starts at step 1")  # torchtitan's other lines print as before
    assert [r.getMessage() for r in caplog.records] == ["Training starts at step 1"]


def test_the_hf_backends_module_conversion_line_is_left_out(quiet, caplog):
    """Logged once per module converted (396 times a SmolLM2 run): the backend's own call, on a small module tree."""
    from torchtitan.experiments.transformers_modeling_backend.module_conversion import convert_hf_to_module

    caplog.set_level(logging.INFO)
    convert_hf_to_module(nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2)))
    assert [r.getMessage() for r in caplog.records] == []


def test_torchs_checkpoint_reminder_under_compile_is_left_out(quiet):
    """torch/_higher_order_ops/wrap.py's warning_once, on its own logger, with --compile and torchtitan's selective
    activation checkpointing (each compiled run's whole output is checked too: tests/test_compile.py)."""
    logger, seen = logging.getLogger("torch._higher_order_ops.wrap"), []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        logger.warning("\nDetected that context_fn is passed to torch.utils.checkpoint under torch.compile.\nPlease "
                       "make sure the checkpointed region does not contain in-place ops (e.g. torch.relu_).\n")
        logger.warning("another warning of that module")  # printed as before
    finally:
        logger.removeHandler(handler)
    assert seen == ["another warning of that module"]


def _schedules(optimizer_lr: float = 1.0):
    return [torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=optimizer_lr)]


def test_a_resume_prints_no_get_last_lr_warning(quiet):
    """torchtitan's scheduler load (every resume) recomputes the rate with torch's get_lr(), which warns."""
    config = LRSchedulersContainer.Config(warmup_steps=1)
    container = config.build(optimizers=_schedules(), training_steps=4)
    state = container.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        config.build(optimizers=_schedules(), training_steps=4).load_state_dict(state)
    assert [str(w.message) for w in caught] == []


def test_the_filters_leave_other_warnings_alone(quiet):
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("something a user can act on", UserWarning)
    assert [str(w.message) for w in caught] == ["something a user can act on"]


def _hf_builder_scheduler():
    from torchtitan.experiments.transformers_modeling_backend.config_registry import (
        transformers_modeling_backend_full)

    return transformers_modeling_backend_full().lr_scheduler


def _factors(config, steps: int) -> list[float]:
    container = config.build(optimizers=_schedules(), training_steps=steps)
    return [container.schedulers[0].lr_lambdas[0](i) for i in range(steps + 1)]


@pytest.mark.parametrize("steps,warmup", [(2, 1), (3, 2), (5, 2), (10, 2), (40, 2)])
def test_the_hf_builders_decay_fits_a_short_run_without_a_warning(steps, warmup, caplog):
    """The README's 2- and 3-step HF runs: warm-up (the recipe's, at most steps - 1) and the builder's 0.8 decay
    share exceed the run, and torchtitan warned; the fitted share gives its adjusted schedule, silently."""
    as_built = _hf_builder_scheduler()
    assert as_built.decay_ratio == 0.8  # the AWS guide's builder: when this changes, so may the workaround
    as_built.warmup_steps = warmup
    with caplog.at_level(logging.WARNING):
        expected = _factors(as_built, steps)  # torchtitan's own adjustment, where it makes one
    fitted = _hf_builder_scheduler()
    fitted.warmup_steps = warmup
    hf_fixes.fit_decay_to_steps(fitted, steps)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert _factors(fitted, steps) == pytest.approx(expected, abs=1e-12)
    assert [r.getMessage() for r in caplog.records] == []
    if warmup + round(steps * 0.8) <= steps:
        assert fitted.decay_ratio == 0.8  # a run long enough keeps the builder's schedule


# ---- the torchrun shutdown-timeout advice (common/harness/stops.py) ----------------------------------------------
def _under_a_short_torchrun() -> stops.StopControl:
    stop = stops.StopControl(end=None, margin_s=120.0, is_main=True, steps=10)
    stop.torchrun_grace_s = stops.TORCHRUN_DEFAULT_GRACE_S  # what install() reads from torchrun's command line
    return stop


def test_the_torchrun_advice_is_not_said_while_a_stop_fits_its_grace(capfd):
    stop = _under_a_short_torchrun()
    stop.step_ended(1)
    stop.saved(1, blocking_s=0.1, written_s=0.1)  # a CPU run's: a stop would take well under 30 s
    stop.step_ended(2)
    out, err = capfd.readouterr()
    assert "shutdown-timeout" not in out + err


def test_the_torchrun_advice_is_said_once_when_a_measured_save_outlasts_the_grace(capfd):
    stop = _under_a_short_torchrun()
    stop.step_ended(1)
    stop.saved(1, blocking_s=31.0, written_s=31.0)
    stop.step_ended(2)
    stop.saved(2, blocking_s=40.0, written_s=40.0)
    out, _ = capfd.readouterr()
    assert out.count("--shutdown-timeout 1800") == 1, out
    assert out.startswith("[stop] a stop needs 31 s here"), out


def test_the_torchrun_advice_comes_with_a_stop_signal_before_any_save_was_measured(capfd):
    stop = _under_a_short_torchrun()
    stop.step_ended(1)
    stop._on_signal(15, None)
    _, err = capfd.readouterr()
    assert err.count("--shutdown-timeout 1800") == 1, err
    assert "[stop] torchrun kills the workers 30 s after it passes on a stop signal" in err


def test_no_torchrun_advice_without_a_users_short_torchrun(capfd):
    stop = stops.StopControl(end=None, margin_s=120.0, is_main=True, steps=10)  # torchrun_grace_s None
    stop.step_ended(1)
    stop.saved(1, blocking_s=100.0, written_s=100.0)
    stop._on_signal(15, None)
    out, err = capfd.readouterr()
    assert "shutdown-timeout" not in out + err
