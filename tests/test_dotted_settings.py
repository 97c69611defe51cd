"""Any torchtitan setting by its own dotted name (`--SECTION.FIELD VALUE`): split from the flags by the command line
(common.cli.split_dotted), set on the recipe's Trainer.Config after the flags (common.recipe.set_dotted), recorded in
results.json's config; a name torchtitan has not, a field a short flag sets, or a value of the wrong type is one
UserError. In-process on torchtitan's own Trainer.Config, and one launched run (conftest.SHARED_RUNS)."""
from __future__ import annotations

import pytest

from common import cli, device
from common.errors import UserError


@pytest.fixture(scope="module")
def trainer_config():
    device.route_torchtitan_device("cpu")
    from torchtitan.models.qwen3.config_registry import qwen3_32b

    return qwen3_32b


def test_dotted_flags_are_split_from_the_others_with_their_values():
    rest, settings = cli.split_dotted(["--steps", "3", "--training.max_norm", "0.5", "--lr_scheduler.decay_ratio=0.1",
                                       "--no-export", "--", "--x.y", "1"])
    assert rest == ["--steps", "3", "--no-export", "--", "--x.y", "1"]
    assert settings == (("training.max_norm", "0.5"), ("lr_scheduler.decay_ratio", "0.1"))
    with pytest.raises(UserError, match=r"^--training.max_norm takes a value"):
        cli.split_dotted(["--training.max_norm", "--steps", "3"])


def test_a_dotted_setting_reaches_torchtitans_config_in_its_type(trainer_config):
    from common.recipe import set_dotted

    tc = trainer_config()
    notes = set_dotted(tc, (("training.max_norm", "0.5"), ("lr_scheduler.decay_ratio", "none"),
                            ("lr_scheduler.min_lr_factor", "0.1"), ("compile.components", "model"),
                            ("parallelism.data_parallel_shard_degree", "8"), ("training.enable_cpu_offload", "true")))
    assert (tc.training.max_norm, tc.lr_scheduler.decay_ratio, tc.lr_scheduler.min_lr_factor) == (0.5, None, 0.1)
    assert tc.compile.components == ["model"] and tc.parallelism.data_parallel_shard_degree == 8
    assert tc.training.enable_cpu_offload is True and "training.max_norm=0.5" in notes


@pytest.mark.parametrize("name,value,needle", [
    ("training.nope", "1", "^--training.nope: torchtitan's TrainingConfig has no field 'nope' .*max_norm"),
    ("nope.x", "1", "^--nope.x: torchtitan's Trainer.Config has no section nope$"),
    ("training.steps", "3", "^--training.steps: set it with --steps"),
    ("activation_checkpoint.mode", "full", "^--activation_checkpoint.mode: set it with --activation_checkpoint"),
    ("checkpoint.interval", "5", "^--checkpoint.interval: set it with --checkpoint_every"),
    ("checkpoint.folder", "elsewhere", "^--checkpoint.folder: set by the scripts, not on the command line \\(the "
                                       "resume and the export depend on it"),
    ("dataloader.seq_len", "3", "^--dataloader.seq_len: set by the scripts"),
    ("training.max_norm", "abc", "^--training.max_norm takes a number; got 'abc'"),
    ("training.max_norm", "nan", "^--training.max_norm takes a finite number"),
    ("parallelism.data_parallel_shard_degree", "2.5", "takes an integer"),
    ("training.enable_cpu_offload", "yes", "takes true or false"),
    ("model_spec.model", "x", "^--model_spec.model: set by the scripts"),
])
def test_a_bad_dotted_setting_is_one_line_naming_it(trainer_config, name, value, needle):
    from common.recipe import set_dotted

    with pytest.raises(UserError, match=needle):
        set_dotted(trainer_config(), ((name, value),))


def test_a_launched_run_sets_it_on_every_rank_and_records_it(shared_run):
    out, res = shared_run("native_2_ranks_8_steps")
    assert res["config"]["training.max_norm"] == "1.0"  # as given; torchtitan's own default, so nothing changes
    assert "training.max_norm=1.0" in (out.parent / "native_2_ranks_8_steps.log").read_text()
