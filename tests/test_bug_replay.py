"""Bug replay: each case puts one real failure mode (docs/bug-replay.md: where it came from) into an
otherwise unchanged run and asserts that the named check stops it with its message.

The fault is injected in this process: a function of the product or of a library is patched before
`runpy` runs the example (as `python examples/SCRIPT ...` would run it), or a copy of a real export
is broken on disk and handed to the product's verifier. Nothing in the product code knows about it.
Two unmodified runs (module fixtures; the native one is a shared run) show the same load and export checks passing
without the fault.
A case no check catches is kept as a passing test that proves the fault was live and names it MISSED.
"""
from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import math
import os
import runpy
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT, read_results
from common import checkpoint, device, export, paths
from common.errors import UserError
from common.harness import checks
from common.losses import finish_run
from common.results import versions

device.route_torchtitan_device("cpu")  # before any torchtitan import (it binds its device at import)

EXAMPLES = ROOT / "examples"
ONE_STEP = ("--steps", "1", "--seq_len", "64")
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
LOAD_TOL = checks.LOAD_TOLERANCE["float32"]


class _Tee(io.TextIOBase):
    """A text stream that writes to several: the test's stderr and a buffer the test reads."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self):
        for stream in self.streams:
            stream.flush()


def run_here(script: str, *args: str) -> tuple[int, str]:
    """Run examples/SCRIPT with ARGS in this process, as `python examples/SCRIPT ARGS` does, so that
    a patch applied by the test reaches it. Returns (exit status, its last `error:` line or '').
    An exception the script does not turn into an `error:` line propagates."""
    saved = {k: os.environ.get(k) for k in (*LAUNCHER_VARS, *OFFLINE)}
    os.environ.update(OFFLINE)
    for var in LAUNCHER_VARS:  # the script fills them in for a single process, as plain `python` would
        os.environ.pop(var, None)
    saved_argv, saved_path, err, code = sys.argv, list(sys.path), io.StringIO(), 0
    sys.argv = [str(EXAMPLES / script), *args]
    try:
        with contextlib.redirect_stderr(_Tee(sys.stderr, err)):
            runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    errors = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
    return code, errors[-1] if errors else ""


def run_error(check: dict, out_dir: Path) -> str:
    """The error line a training run ends with for this export check (common.losses.finish_run)."""
    with pytest.raises(UserError) as e:
        finish_run({"export_check": check}, {"steps": [], "losses": []}, out_dir=out_dir, title="bug replay",
                   is_main=True)
    return f"error: {e.value}"


def export_check(folder: Path, reference: Path, *, tied_expected: bool, tol: float) -> dict:
    """The export check exactly as the MoE run's export_and_check runs it: the folder re-read by transformers with
    the run's check (`export.in_process`: the MoE trainer leaves transformers as it is, so its checks run in the
    trainer's process; common/recipe.py and common/harness/lifecycle.py's check_process), logits compared with the
    trained model's."""
    check = export.verify_export_subprocess(folder, reference, check=export.in_process)
    check["passed"] = export.export_check_passed(check, tied_expected=tied_expected, tol=tol)
    check["tolerance"] = tol
    return check


def copy_case(run_dir: Path, case_dir: Path) -> tuple[Path, Path]:
    """A copy of a run's export and of its reference logits (each case its own: the verifier writes
    its result beside the reference)."""
    case_dir.mkdir(parents=True)
    shutil.copytree(run_dir / "hf_export", case_dir / "hf_export")
    shutil.copy2(run_dir / "export_reference.safetensors", case_dir / "reference.safetensors")
    return case_dir / "hf_export", case_dir / "reference.safetensors"


def shard(folder: Path) -> Path:
    (only,) = folder.glob("model-*.safetensors")  # the tiny exports are one shard
    return only


def rewrite_index(folder: Path, weight_map: dict) -> None:
    (index,) = folder.glob("*.safetensors.index.json")
    data = json.loads(index.read_text())
    data["weight_map"] = weight_map
    index.write_text(json.dumps(data, indent=2))


def moe_export_rewrite(folder: Path, rename) -> None:
    """Rewrite every routed-expert matrix of an MoE export: rename(key, tensor) -> (key, tensor)."""
    path = shard(folder)
    tensors = load_file(str(path))
    out = dict(rename(k, v) if ".mlp.experts." in k else (k, v) for k, v in tensors.items())
    save_file(out, str(path), metadata={"format": "pt"})
    rewrite_index(folder, {k: path.name for k in out})


def patch_spec(monkeypatch, change) -> None:
    """Change the model spec the training scripts build from config.json (`qwen3_spec_from_hf`)."""
    real = checkpoint.qwen3_spec_from_hf

    def spec(hf_config, *, where="config"):
        built = real(hf_config, where=where)
        change(built.model)
        return built

    monkeypatch.setattr(checkpoint, "qwen3_spec_from_hf", spec)


@pytest.fixture(scope="module", autouse=True)
def _process_state():
    """The in-process runs change process-wide state: the scripts and torchtitan turn the garbage collector off (the
    scripts also freeze what exists before the trainer is built); torchtitan turns deterministic algorithms on and
    sets environment variables and the root logger's handler; the device set-up turns autograd's threads off. Put
    it all back for the test files that follow."""
    root = logging.getLogger()
    cudnn = torch.backends.cudnn
    saved = (gc.isenabled(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), torch.utils.deterministic.fill_uninitialized_memory,
             torch._C._is_multithreading_enabled(), cudnn.deterministic, cudnn.benchmark, root.level,
             list(root.handlers), dict(os.environ))
    yield
    (gc_on, det, warn_only, fill, threads, cudnn.deterministic, cudnn.benchmark, level, handlers, env) = saved
    gc.unfreeze()  # the scripts set aside what their imports made before building the trainer
    if gc_on:
        gc.enable()
    torch.use_deterministic_algorithms(det, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.autograd.set_multithreading_enabled(threads)
    root.setLevel(level)
    root.handlers[:] = handlers
    for k in set(os.environ) - set(env):
        del os.environ[k]
    os.environ.update(env)


# --------------------------------------------------------------------------- unmodified runs
@pytest.fixture(scope="module")
def native_run(shared_run):
    """The tiny Qwen3 from its HF folder (the shared 2-rank run, conftest.SHARED_RUNS): the load check passes."""
    out, res = shared_run("native_2_ranks_8_steps")
    assert res["config"]["hf_checkpoint"] == str(paths.asset_dir("tiny_qwen3")), res["config"]
    assert res["load_check"]["passed"], res["load_check"]
    return out


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """The tiny Qwen3-MoE (tied embeddings) from its HF folder through the RoPE and grouped-expert ops,
    one step, exported: load check and export check pass. Its export is the one the export cases break."""
    out = tmp_path_factory.mktemp("moe")
    code, err = run_here("train_moe_nki.py", "--hf_checkpoint", str(paths.asset_dir("tiny_qwen3_moe")), *ONE_STEP,
                         "--out_dir", str(out))
    assert code == 0, err
    res = read_results(out)
    assert res["load_check"]["passed"] and res["export_check"]["passed"], res
    assert res["export_check"]["tied_lm_head"] is True and res["export_check"]["lm_head_in_file"] is False
    assert any("rope" in r for r in res["replacements"]) and any("experts" in r for r in res["replacements"])
    return out


@pytest.fixture(scope="module")
def export_checks(moe_run, tmp_path_factory):
    """Broken copies of the MoE run's export, each checked by the product's export check as the MoE run checks its
    export (in its process), one after the other. {case: (check, export folder, ...)}."""
    root = tmp_path_factory.mktemp("broken")
    tol = read_results(moe_run)["export_check"]["tolerance"]
    jobs = {}

    # A tied model's config.json without the tie: transformers then expects lm_head in the files.
    folder, ref = copy_case(moe_run, root / "tied_lm_head_missing")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}, indent=2))
    jobs["tied_lm_head_missing"] = folder, ref

    # Expert matrices written transposed ([dim, hidden] where HF stores [hidden, dim]).
    folder, ref = copy_case(moe_run, root / "experts_transposed")
    moe_export_rewrite(folder, lambda k, v: (k, v.t().contiguous()))
    jobs["experts_transposed"] = folder, ref

    # Expert e's matrices written under expert e + 1: every shape right, the routing table wrong.
    folder, ref = copy_case(moe_run, root / "experts_permuted")
    n = json.loads((folder / "config.json").read_text())["num_experts"]

    def shift(key, value):
        head, rest = key.split(".mlp.experts.")
        e, proj = rest.split(".", 1)
        return f"{head}.mlp.experts.{(int(e) + 1) % n}.{proj}", value

    moe_export_rewrite(folder, shift)
    jobs["experts_permuted"] = folder, ref

    checked = {name: (export_check(f, r, tied_expected=True, tol=tol), f) for name, (f, r) in jobs.items()}
    checked["tokenizer_missing"] = _complete_without_tokenizer(moe_run, root / "tokenizer_missing", tol)
    return checked


def _complete_without_tokenizer(run_dir: Path, case: Path, tol: float) -> tuple[dict, Path, Path | None]:
    """torchtitan's save (safetensors and index) completed by complete_export with a tokenizer folder
    that lacks tokenizer.json, checked as export_and_check checks it. Returns (check, the case's
    folder, where complete_export put the export)."""
    step = case / "checkpoint" / "step-1"
    step.mkdir(parents=True)
    for f in [*(run_dir / "hf_export").glob("*.safetensors"), *(run_dir / "hf_export").glob("*.index.json")]:
        shutil.copy2(f, step / f.name)
    tokenizer = case / "tokenizer"  # the slow-tokenizer files only
    tokenizer.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy2(run_dir / "hf_export" / name, tokenizer / name)
    shutil.copy2(run_dir / "export_reference.safetensors", case / "reference.safetensors")
    hf_cfg = {k: v for k, v in json.loads((run_dir / "hf_export" / "config.json").read_text()).items()
              if k != "qwen3_recipes_versions"}
    check = {}

    def verify(staged):  # as export_and_check's
        check.update(export_check(staged, case / "reference.safetensors", tied_expected=True, tol=tol))
        return check["passed"]

    placed = export.complete_export(step, case / "hf_export", hf_cfg, tokenizer, versions(), verify=verify)
    return check, case, placed


# --------------------------------------------------------------------------- config.json read wrong
def test_rope_theta_overridden_by_default(monkeypatch, tmp_path, native_run):
    """A default rope theta (10,000) replaces config.json's 1,000,000 in the built model."""
    def default_theta(model):
        for layer in model.layers:
            layer.attention.rope.theta = 10_000.0

    patch_spec(monkeypatch, default_theta)
    code, err = run_here("train_native_qwen3.py", "--hf_checkpoint", str(paths.asset_dir("tiny_qwen3")), *ONE_STEP,
                         "--no-export", "--out_dir", str(tmp_path))
    assert code == 2
    assert err.startswith("error: load check failed: ")
    assert "rope_theta: trained model 10000.0, config.json 1000000.0" in err, err


def test_rms_norm_eps_ignored(monkeypatch, tmp_path, native_run):
    """Every RMSNorm keeps a library default eps (1e-5) instead of config.json's 1e-6."""
    from torchtitan.models.common.nn_modules import RMSNorm

    def default_eps(model):
        for _fqn, norm, _parent, _attr in model.traverse(RMSNorm.Config):
            norm.eps = 1e-5

    patch_spec(monkeypatch, default_eps)
    code, err = run_here("train_native_qwen3.py", "--hf_checkpoint", str(paths.asset_dir("tiny_qwen3")), *ONE_STEP,
                         "--no-export", "--out_dir", str(tmp_path))
    assert code == 2
    assert err.startswith("error: load check failed: ")
    assert "rms_norm_eps: trained model 1e-05, config.json 1e-06" in err, err


def _qwen3_with_own_head_dim(path: Path) -> None:
    """A Qwen3 whose head_dim (24) is not hidden/heads (64/4 = 16), as Qwen3-0.6B (1024/16 vs 128)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)


def test_head_dim_derived_from_hidden_and_heads(monkeypatch, tmp_path):
    """head_dim computed as hidden_size // num_attention_heads instead of read from config.json."""
    src = tmp_path / "src"
    _qwen3_with_own_head_dim(src)
    real = checkpoint.qwen3_spec_from_hf

    def derived(hf_config, *, where="config"):
        return real({**hf_config, "head_dim": hf_config["hidden_size"] // hf_config["num_attention_heads"]},
                    where=where)

    monkeypatch.setattr(checkpoint, "qwen3_spec_from_hf", derived)
    # The load check compares the built model's settings with config.json before torchtitan loads anything.
    code, err = run_here("train_native_qwen3.py", "--hf_checkpoint", str(src), *ONE_STEP, "--no-export",
                         "--out_dir", str(tmp_path / "run"))
    assert code == 2
    assert err.startswith("error: load check failed: "), err
    own = json.loads((src / "config.json").read_text())
    assert f"head_dim: trained model {own['hidden_size'] // own['num_attention_heads']}, config.json {own['head_dim']}" in err


def test_weights_silently_not_loaded(monkeypatch, tmp_path, native_run):
    """The HF key map matches none of the model's names: torchtitan's non-strict load keeps the
    random init and says nothing."""
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    real = Qwen3StateDictAdapter.from_hf
    monkeypatch.setattr(Qwen3StateDictAdapter, "from_hf",
                        lambda self, hf: {f"unmatched.{k}": v for k, v in real(self, hf).items()})
    code, err = run_here("train_native_qwen3.py", "--hf_checkpoint", str(paths.asset_dir("tiny_qwen3")), *ONE_STEP,
                         "--no-export", "--out_dir", str(tmp_path))
    assert code == 2
    assert err.startswith("error: load check failed: "), err
    diff = float(err.split("max abs logit diff ")[1].split(" ")[0])
    assert diff > 100 * LOAD_TOL, err


# --------------------------------------------------------------------------- broken exports
def test_tied_lm_head_written_empty(moe_run, tmp_path):
    """The index still maps the tied lm_head to a shard, written with an empty entry."""
    folder, ref = copy_case(moe_run, tmp_path / "case")
    empty = folder / "model-00002-of-00002.safetensors"
    header = json.dumps({"lm_head.weight": {"dtype": "", "shape": [], "data_offsets": [0, 0]}}).encode()
    empty.write_bytes(struct.pack("<Q", len(header)) + header)
    (index,) = folder.glob("*.safetensors.index.json")
    rewrite_index(folder, {**json.loads(index.read_text())["weight_map"], "lm_head.weight": empty.name})
    with pytest.raises(UserError, match=r"model-00002-of-00002\.safetensors: lm_head\.weight is an empty entry "
                                        r"\(0 bytes for shape \[\]\)"):
        export.verify_export(folder, ref)


def test_tied_lm_head_missing(export_checks, tmp_path):
    """config.json of the tied export rewritten with tie_word_embeddings false (export_checks)."""
    check, _folder = export_checks["tied_lm_head_missing"]
    assert not check["passed"]
    err = run_error(check, tmp_path)
    # The verifier validates the export against its own config.json first: an untied config without lm_head.
    assert err.startswith("error: export check failed (the export cannot be read back: checkpoint "), err
    assert "does not match its config.json: missing keys [lm_head.weight]" in err


def test_config_and_tokenizer_missing_from_torchtitans_save(moe_run, tmp_path):
    """torchtitan's own HF save (safetensors and index only) taken for the export."""
    raw = tmp_path / "step-1"
    raw.mkdir()
    for f in [*(moe_run / "hf_export").glob("*.safetensors"), *(moe_run / "hf_export").glob("*.index.json")]:
        shutil.copy2(f, raw / f.name)
    with pytest.raises(UserError, match=r"step-1 lacks config\.json, tokenizer\.json$"):
        export.verify_export(raw, moe_run / "export_reference.safetensors")


def test_tokenizer_missing_export_rejected(export_checks, tmp_path):
    """The export is checked while it still has a hidden name and goes to hf_export.rejected."""
    check, case, placed = export_checks["tokenizer_missing"]
    assert placed is None and not (case / "hf_export").exists()
    assert (case / "hf_export.rejected" / "config.json").is_file()
    err = run_error(check, tmp_path)
    assert err.startswith("error: export check failed (the export cannot be read back: "), err
    assert "/.hf_export.tmp lacks tokenizer.json): hf_export was left as it was" in err, err


def test_moe_experts_transposed_on_export(export_checks, tmp_path):
    """Every expert matrix written transposed (export_checks)."""
    check, folder = export_checks["experts_transposed"]
    assert not check["passed"] and len(load_file(str(shard(folder)))) > 0
    err = run_error(check, tmp_path)
    # The verifier compares the stored shapes with config.json before transformers loads: the tensors are named.
    assert err.startswith("error: export check failed (the export cannot be read back: checkpoint "), err
    assert "does not match its config.json: wrong shapes [model.layers.0.mlp.experts.0.down_proj.weight" in err


def test_moe_experts_permuted_on_export(export_checks, tmp_path):
    """Expert e's matrices written under expert e + 1 (export_checks)."""
    check, _folder = export_checks["experts_permuted"]
    assert not check["passed"] and check["missing_keys"] == [] and check["mismatched_keys"] == []
    err = run_error(check, tmp_path)
    assert err.startswith("error: export check failed (max abs logit diff "), err
    assert err.split(" (details in ")[0].endswith("> tolerance 1e-05): hf_export was left as it was, the rejected "
                                                  f"export is in {tmp_path}/hf_export.rejected"), err


def test_moe_routing_bias_dropped_while_coefficient_nonzero(tmp_path, moe_run):
    """torchtitan's load-balancing bias (its default coefficient, 1e-3) steers routing in training but
    is not part of the HF format: the export routes differently from the trained model."""
    code, err = run_here("train_moe_nki.py", *ONE_STEP, "--load_balance_coeff", "1e-3", "--out_dir", str(tmp_path))
    res = read_results(tmp_path)
    assert res["routing_bias"]["expert_bias_max_abs"] > 0 and res["routing_bias"]["exported"] is False
    assert code == 2
    assert err.startswith("error: export check failed (max abs logit diff "), err
    assert "> tolerance 1e-05): hf_export was left as it was" in err, err


# --------------------------------------------------------------------------- kernels
def test_rope_op_output_left_unwritten(monkeypatch, tmp_path, moe_run):
    """The RoPE op's forward returns output buffers nothing wrote (torch.empty_like)."""
    from common.kernels import rope_op

    real = rope_op._rope_torch

    def unwritten(x_q, x_k, rope_cache, lnc, backward):
        if backward:
            return real(x_q, x_k, rope_cache, lnc, backward)
        return torch.empty_like(x_q), torch.empty_like(x_k)

    monkeypatch.setattr(rope_op, "_rope_torch", unwritten)
    code, err = run_here("train_moe_nki.py", "--hf_checkpoint", str(paths.asset_dir("tiny_qwen3_moe")), *ONE_STEP,
                         "--no-export", "--out_dir", str(tmp_path))
    assert code == 2
    assert err.startswith("error: load check failed: "), err
    assert f"> {LOAD_TOL:g}); pass --no-load_check to train anyway" in err, err


def test_grouped_experts_op_output_left_unwritten(monkeypatch, tmp_path, moe_run):
    """The grouped-expert op's forward returns an output buffer nothing wrote; what it saves for the
    backward is right."""
    from common.kernels import moe_op

    real = moe_op._experts_torch

    def unwritten(*args):
        out, *saved = real(*args)
        return (torch.empty_like(out), *saved)

    monkeypatch.setattr(moe_op, "_experts_torch", unwritten)
    code, err = run_here("train_moe_nki.py", "--hf_checkpoint", str(paths.asset_dir("tiny_qwen3_moe")), *ONE_STEP,
                         "--no-export", "--out_dir", str(tmp_path))
    assert code == 2
    assert err.startswith("error: load check failed: "), err
    assert f"> {LOAD_TOL:g}); pass --no-load_check to train anyway" in err, err


def test_grouped_experts_backward_drops_score_gradient_is_missed(monkeypatch, tmp_path):
    """MISSED at run time. The grouped-expert backward returns zeros for the routing scores' gradient
    while the forward stays exact, so the router learns nothing from the loss. The load check and the
    export check compare forwards only (the patch leaves the forward untouched, and the unmodified MoE
    run shows both passing); the loss stays finite. Only the op's unit test (tests/test_moe_op.py:
    gradients against a per-expert loop) catches it. This test proves the fault was live in the run
    and that the run passed; once a run-time check exists it fails here, and should then assert that
    check's message."""
    from common.kernels import moe_op

    real, dropped = moe_op._experts_torch_bwd, []

    def no_score_gradient(*args):
        dx, d_scores, dw1, dw2, dw3 = real(*args)
        dropped.append(float(d_scores.abs().max()))
        return dx, torch.zeros_like(d_scores), dw1, dw2, dw3

    monkeypatch.setattr(moe_op, "_experts_torch_bwd", no_score_gradient)
    code, err = run_here("train_moe_nki.py", *ONE_STEP, "--no-export", "--out_dir", str(tmp_path))
    assert dropped and max(dropped) > 0  # a real, non-zero routing gradient was thrown away
    assert code == 0, err  # ... and no check noticed
    assert all(map(math.isfinite, read_results(tmp_path)["losses"]))


# --------------------------------------------------------------------------- Transformers backend
def test_inv_freq_left_uninitialised(monkeypatch, tmp_path):
    """The backend's meta-device init leaves the rotary inv_freq buffers as uninitialised memory and
    the recomputation that fixes it does not run."""
    from transformers import PreTrainedModel
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    from hf_backend import fixes

    # The backend replaces these in the process it runs in (its init scheme); undone after the test.
    for owner, name in ((PreTrainedModel, "_init_weights"), (PreTrainedModel, "_initialize_weights"),
                        (Qwen3DecoderLayer, "__init__")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.setattr(fixes, "recompute_rotary_buffers", lambda model: [])
    with pytest.raises(fixes.RotaryBufferError,
                       match=r"^rotary buffers differ from what config\.json implies: "
                             r"model\.model\.rotary_emb\.inv_freq: max abs diff "):
        run_here("train_hf_backend.py", *ONE_STEP, "--no-export", "--out_dir", str(tmp_path))
