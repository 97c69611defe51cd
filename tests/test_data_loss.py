"""Nothing lost, nothing silently wrong: each test is one way a careless or unlucky run used to
lose a good file or report a wrong result as a success."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from conftest import assert_clean_error, read_results, run_example, run_python

SCRIPT = "train_native_qwen3.py"
SHORT = ("--steps", "2", "--local_batch_size", "1", "--seq_len", "64")


def _tiny_copy(prepared_assets, dst):
    import shutil

    shutil.copytree(prepared_assets["tiny_qwen3"], dst)
    (dst / "manifest.json").unlink()
    return dst


def test_nonfinite_weights_are_never_ok(prepared_assets, tmp_path):
    """A checkpoint holding NaN or Inf is refused by `validate` and by training, naming the tensor."""
    bad = _tiny_copy(prepared_assets, tmp_path / "nan_ckpt")
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.norm.weight"][3] = math.nan
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    proc = run_python([sys.executable, "-m", "common.checkpoint", "validate", str(bad)])
    assert_clean_error(proc, "NaN or Inf in [model.norm.weight]")
    assert "ok" not in proc.stdout
    proc = run_example(SCRIPT, "--hf_checkpoint", str(bad), "--out_dir", str(tmp_path / "o"), check=False)
    assert_clean_error(proc, "NaN or Inf in [model.norm.weight]")


def test_index_naming_keys_no_shard_holds_is_refused(prepared_assets, tmp_path):
    bad = _tiny_copy(prepared_assets, tmp_path / "bad_index")
    keys = list(load_file(str(bad / "model.safetensors")))
    index = {"metadata": {}, "weight_map": {**{k: "model.safetensors" for k in keys}, "model.extra.weight": "model.safetensors"}}
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = run_python([sys.executable, "-m", "common.checkpoint", "validate", str(bad)])
    assert_clean_error(proc, "does not match its shards", "model.extra.weight")


def test_failed_export_keeps_the_good_one(prepared_assets, tmp_path):
    """bfloat16 with its default tolerance passes; the same run whose export fails its check exits
    non-zero, leaves the earlier hf_export and its results untouched, and keeps the rejected export
    beside it."""
    out = tmp_path / "run"
    run_example(SCRIPT, *SHORT, "--dtype", "bfloat16", "--out_dir", str(out))
    first = read_results(out)
    assert first["export_check"]["passed"] and first["export_check"]["tolerance"] == 5e-2
    good = {p.name: p.stat().st_mtime_ns for p in (out / "hf_export").iterdir()}

    proc = run_example(SCRIPT, *SHORT, "--dtype", "bfloat16", "--export_tolerance", "1e-12", "--out_dir", str(out),
                       check=False)
    assert_clean_error(proc, "export check failed", "max abs logit diff", "hf_export was left as it was")
    assert proc.returncode == 2
    assert {p.name: p.stat().st_mtime_ns for p in (out / "hf_export").iterdir()} == good
    assert (out / "hf_export.rejected" / "config.json").is_file()
    second = read_results(out)  # the failed run's results say so, and vouch for no export
    assert second["export_check"]["passed"] is False and second["export_dir"] is None
    assert json.loads((out / "export_check.json").read_text())["passed"] is False


def test_empty_out_dir_is_refused_and_foreign_folders_are_left_alone(prepared_assets, tmp_path):
    proc = run_example(SCRIPT, *SHORT, "--out_dir", "", check=False)
    assert_clean_error(proc, "--out_dir is empty")
    foreign = tmp_path / "checkpoint"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("someone else's")
    proc = run_example(SCRIPT, *SHORT, "--out_dir", str(tmp_path), check=False)
    assert_clean_error(proc, "was not made by these scripts")
    assert (foreign / "keep.txt").read_text() == "someone else's"


def test_nan_loss_comparison_is_a_mismatch(tmp_path):
    from common.losses import compare_losses

    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"losses": [11.0, 10.0]}))
    assert not compare_losses([float("nan"), 10.0], ref, 1e-3)["passed"]
    assert compare_losses([11.0, 10.0], ref, 1e-3)["passed"]
    ref.write_text(json.dumps({"losses": [float("nan"), 0.0]}))
    proc = run_example(SCRIPT, "--compare_losses", str(ref), "--out_dir", str(tmp_path / "o"), check=False)
    assert_clean_error(proc, "holds NaN or infinite losses")
    proc = run_example(SCRIPT, "--loss_tolerance", "nan", "--out_dir", str(tmp_path / "o"), check=False)
    assert_clean_error(proc, "--loss_tolerance must be a finite number")


def test_out_dir_overlapping_the_checkpoint_is_refused(prepared_assets, tmp_path):
    ckpt = _tiny_copy(prepared_assets, tmp_path / "ckpt")
    before = sorted(p.name for p in ckpt.iterdir())
    for out in (ckpt, ckpt / "sub", tmp_path):
        proc = run_example(SCRIPT, "--hf_checkpoint", str(ckpt), "--out_dir", str(out), check=False)
        assert_clean_error(proc, "overlaps --hf_checkpoint")
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_out_of_disk_space_is_one_line(prepared_assets, tmp_path):
    """--out_dir on a 3 MB file system: the checkpoint save fails with ENOSPC inside torchtitan's
    distributed checkpoint; the run ends in one `error:` line, not a traceback."""
    disk = tmp_path / "small_disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        proc = run_example(SCRIPT, *SHORT, "--out_dir", str(disk / "run"), check=False)
        assert_clean_error(proc, "out of disk space writing")
    finally:
        subprocess.run(["umount", str(disk)])
