"""Nothing lost, nothing silently wrong: each test is one way a careless or unlucky run used to
lose a good file or report a wrong result as a success."""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import psutil
import pytest
from safetensors.torch import load_file, save_file

from conftest import (ROOT, assert_clean_error, example_command, read_results, run_example, run_python, script_env,
                      sigint_as_in_a_terminal)

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


def _descendants_alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_stops_every_worker(prepared_assets, tmp_path, sig):
    """`--nproc_per_node 2`, then a signal to the launcher process alone: no worker outlives it."""
    out = tmp_path / "o"
    proc = subprocess.Popen(example_command(SCRIPT, "--nproc_per_node", "2", "--steps", "200", "--no-export",
                                            "--out_dir", str(out)),
                            cwd=ROOT, env=script_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_in_a_terminal)
    deadline = time.monotonic() + 300
    while not (out / "losses.jsonl").exists():  # the workers are training
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "no step"
        time.sleep(0.2)
    family = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert len(family) >= 3  # torchrun and its two workers
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "error: interrupted" in err
    deadline = time.monotonic() + 30
    while _descendants_alive(family) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _descendants_alive(family)


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


def test_ctrl_c_during_a_checkpoint_save_is_one_line(prepared_assets, tmp_path):
    """SIGINT while torchtitan writes a checkpoint (a step folder without its .metadata yet)."""
    out = tmp_path / "o"
    proc = subprocess.Popen(example_command(SCRIPT, *SHORT[2:], "--steps", "40", "--checkpoint_every", "1",
                                            "--no-export", "--out_dir", str(out)),
                            cwd=ROOT, env=script_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_in_a_terminal)
    deadline, sent = time.monotonic() + 300, None
    while proc.poll() is None and time.monotonic() < deadline:
        steps = list((out / "checkpoint").glob("step-*")) if (out / "checkpoint").is_dir() else []
        if saving := [s.name for s in steps if not (s / ".metadata").exists()]:  # a save in progress (~0.5 s each)
            proc.send_signal(signal.SIGINT)
            sent = saving
            break
        time.sleep(0.005)
    _, err = proc.communicate(timeout=120)
    saved = sorted(p.name for p in (out / "checkpoint").glob("*"))
    assert sent, f"no save in progress seen; exit {proc.returncode}, saved: {saved}"
    assert proc.returncode == 130 and "Traceback" not in err, (sent, err[-3000:])
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == ["error: interrupted"]
