"""Nothing lost, nothing silently wrong: each test is one way a careless or unlucky run used to
lose a good file or report a wrong result as a success."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from conftest import assert_clean_error, read_results, run_example, run_in_process, run_module_in_process

SCRIPT = "train_native_qwen3.py"
SHORT = ("--steps", "1", "--local_batch_size", "1", "--seq_len", "64")


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
    proc = run_module_in_process("common.harness.checks", "validate", str(bad))
    assert_clean_error(proc, "NaN or Inf in [model.norm.weight]")
    assert "ok" not in proc.stdout
    proc = run_in_process(SCRIPT, "--hf_checkpoint", str(bad), "--out_dir", str(tmp_path / "o"))
    assert_clean_error(proc, "NaN or Inf in [model.norm.weight]")


def test_index_naming_keys_no_shard_holds_is_refused(prepared_assets, tmp_path):
    bad = _tiny_copy(prepared_assets, tmp_path / "bad_index")
    keys = list(load_file(str(bad / "model.safetensors")))
    index = {"metadata": {}, "weight_map": {**{k: "model.safetensors" for k in keys}, "model.extra.weight": "model.safetensors"}}
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = run_module_in_process("common.harness.checks", "validate", str(bad))
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
    proc = run_in_process(SCRIPT, *SHORT, "--out_dir", "")
    assert_clean_error(proc, "--out_dir is empty")
    foreign = tmp_path / "checkpoint"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("someone else's")
    proc = run_in_process(SCRIPT, *SHORT, "--out_dir", str(tmp_path))
    assert_clean_error(proc, "was not made by these scripts")
    assert (foreign / "keep.txt").read_text() == "someone else's"


def test_nan_loss_comparison_is_a_mismatch(tmp_path):
    from common.harness.checks import compare_losses

    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"losses": [11.0, 10.0]}))
    assert not compare_losses([float("nan"), 10.0], ref, 1e-3)["passed"]
    assert compare_losses([11.0, 10.0], ref, 1e-3)["passed"]
    ref.write_text(json.dumps({"losses": [float("nan"), 0.0]}))
    proc = run_in_process(SCRIPT, "--compare_losses", str(ref), "--out_dir", str(tmp_path / "o"))
    assert_clean_error(proc, "holds NaN or infinite losses")
    proc = run_in_process(SCRIPT, "--loss_tolerance", "nan", "--out_dir", str(tmp_path / "o"))
    assert_clean_error(proc, "--loss_tolerance must be a finite number")


def test_out_dir_overlapping_the_checkpoint_is_refused(prepared_assets, tmp_path):
    ckpt = _tiny_copy(prepared_assets, tmp_path / "ckpt")
    before = sorted(p.name for p in ckpt.iterdir())
    for out in (ckpt, ckpt / "sub", tmp_path):
        proc = run_in_process(SCRIPT, "--hf_checkpoint", str(ckpt), "--out_dir", str(out))
        assert_clean_error(proc, "overlaps --hf_checkpoint")
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_out_dir_inside_or_around_any_input_is_refused(prepared_assets, tmp_path):
    """An out_dir inside the prepared asset cache, inside --dataset's folder, or holding the --compare_losses file
    is refused before anything is written there (it would break every later run, or overwrite an input)."""
    from common.paths import CACHE_DIR

    data = tmp_path / "data"
    data.mkdir()
    (data / "d.jsonl").write_text("".join(json.dumps({"text": f"Sentence {i}."}) + "\n" for i in range(50)))
    ref = tmp_path / "ref" / "results.json"
    ref.parent.mkdir()
    ref.write_text(json.dumps({"losses": [12.0, 11.9]}))
    for args, out, needle in (((), CACHE_DIR / "runs", "overlaps the prepared assets' cache"),
                              ((), CACHE_DIR.parent, "overlaps the prepared assets' cache"),
                              (("--dataset", str(data)), data / "out", "overlaps --dataset"),
                              (("--compare_losses", str(ref)), ref.parent, "overlaps --compare_losses")):
        proc = run_in_process(SCRIPT, *SHORT, *args, "--out_dir", str(out))
        assert_clean_error(proc, needle)
    assert not (CACHE_DIR / "runs").exists() and sorted(p.name for p in data.iterdir()) == ["d.jsonl"]
    assert sorted(p.name for p in ref.parent.iterdir()) == ["results.json"]


def test_out_of_disk_space_is_one_line(prepared_assets, tmp_path):
    """--out_dir on a 3 MB file system: the checkpoint save fails with ENOSPC inside torchtitan's
    distributed checkpoint; the run ends in one `error:` line, not a traceback."""
    from conftest import tmpfs

    with tmpfs(tmp_path / "small_disk", "3m") as disk:
        # the check before the launch would refuse this disk (tests/test_disk.py): off, to reach a save's own failure
        # (a disk something else fills during the run)
        proc = run_example(SCRIPT, *SHORT, "--no-disk_check", "--out_dir", str(disk / "run"), check=False)
        assert_clean_error(proc, "out of disk space writing")


def test_a_users_hf_export_rejected_is_refused_before_training(prepared_assets, tmp_path):
    """A folder named hf_export.rejected that no run made (the user's own) was deleted when the export check
    failed. It is refused up front, like a foreign hf_export or checkpoint: one line naming it, before any
    training, and the folder keeps its file."""
    out = tmp_path / "run"
    mine = out / "hf_export.rejected"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("my own")
    proc = run_in_process(SCRIPT, *SHORT, "--dtype", "bfloat16", "--export_tolerance", "1e-12", "--out_dir", str(out))
    assert_clean_error(proc, f"{mine} exists and was not made by these scripts")
    assert (mine / "notes.txt").read_text() == "my own" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert not (out / "results.json").exists() and not (out / "losses.jsonl").exists()  # nothing trained


def _step_dir(out, step: int = 2):
    """What torchtitan's last HF save leaves in OUT_DIR/checkpoint/step-N (safetensors + index)."""
    step_dir = out / "checkpoint" / f"step-{step}"
    step_dir.mkdir(parents=True)
    save_file({"w": __import__("torch").zeros(2)}, str(step_dir / "model.safetensors"))
    (step_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    return step_dir


def _complete(out, tokenizer_dir, passed: bool):
    from common import export

    return export.complete_export(_step_dir(out), out / "hf_export", {"architectures": ["Qwen3ForCausalLM"]},
                                  tokenizer_dir, {"torch": "test"}, verify=lambda staged: passed)


def test_a_failed_export_never_deletes_a_rejected_folder_it_did_not_make(prepared_assets, tmp_path):
    """complete_export itself keeps to the ownership rule (a folder can appear after the up-front check): a user's
    hf_export.rejected is named and left with its file, the new export stays where torchtitan wrote it; a
    rejected export of an earlier run is replaced."""
    from common.errors import UserError

    tokenizer = prepared_assets["tokenizer"]
    out = tmp_path / "run"
    mine = out / "hf_export.rejected"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("my own")
    with pytest.raises(UserError, match="hf_export.rejected exists and was not made by these scripts"):
        _complete(out, tokenizer, passed=False)
    assert (mine / "notes.txt").read_text() == "my own"
    assert (out / "checkpoint" / "step-2" / "model.safetensors").is_file()  # the new export, not lost
    mine.rename(out / "notes")
    import shutil

    shutil.rmtree(out / "checkpoint")
    assert _complete(out, tokenizer, passed=False) is None  # rejected: to hf_export.rejected
    first = json.loads((out / "hf_export.rejected" / "config.json").read_text())
    assert first["qwen3_recipes_versions"] == {"torch": "test"}
    assert _complete(out, tokenizer, passed=False) is None  # the run's own rejected export is replaced
    assert _complete(out, tokenizer, passed=True) == out / "hf_export"
    assert not (out / "hf_export" / ".qwen3-recipes").exists()  # the export holds the model's files only
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint", "hf_export", "hf_export.rejected", "notes"]


def test_a_symlinked_hf_export_is_replaced_never_followed(prepared_assets, tmp_path):
    """hf_export a symlink to an earlier export elsewhere: the link is replaced by the new export, the folder it
    points to is untouched, and nothing is left beside it that breaks the next run. Before, the first run left a
    `.hf_export.old.tmp` symlink that rmtree cannot remove and every later run crashed (NotADirectoryError) after
    training, its new export stranded. A leftover of that kind is cleared too."""
    tokenizer = prepared_assets["tokenizer"]
    elsewhere = tmp_path / "exports" / "earlier"
    elsewhere.mkdir(parents=True)
    (elsewhere / "config.json").write_text(json.dumps({"qwen3_recipes_versions": {"torch": "earlier"}}))
    (elsewhere / "model.safetensors").write_bytes(b"earlier weights")
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()}
    out = tmp_path / "run"
    out.mkdir()
    (out / "hf_export").symlink_to(elsewhere)
    (out / "hf_export.rejected").symlink_to(elsewhere)  # replaced as a link too
    (out / ".hf_export.old.tmp").symlink_to(elsewhere)  # what a first run of the old code left
    for _ in range(3):
        assert _complete(out, tokenizer, passed=True) == out / "hf_export"
        assert (out / "hf_export").is_dir() and not (out / "hf_export").is_symlink()
        assert json.loads((out / "hf_export" / "config.json").read_text())["qwen3_recipes_versions"] == {"torch": "test"}
    assert _complete(out, tokenizer, passed=False) is None
    assert not (out / "hf_export.rejected").is_symlink() and (out / "hf_export.rejected" / "config.json").is_file()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint", "hf_export", "hf_export.rejected"]
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == before


def test_a_symlinked_hf_assets_is_replaced_never_followed(prepared_assets, tmp_path):
    """hf_assets (the tokenizer and config a run stages for torchtitan) a link to another run's hf_assets: staging
    replaces the link with a folder of its own and leaves the folder it pointed to as it was (rmtree used to refuse
    the link: OSError)."""
    from common.export import MARKER, stage_hf_assets

    elsewhere = tmp_path / "other_run" / "hf_assets"
    elsewhere.mkdir(parents=True)
    (elsewhere / MARKER).touch()
    (elsewhere / "notes.txt").write_text("that run's files")
    dest = tmp_path / "run" / "hf_assets"
    dest.parent.mkdir()
    dest.symlink_to(elsewhere)
    stage_hf_assets(dest, prepared_assets["tokenizer"])
    assert dest.is_dir() and not dest.is_symlink() and (dest / "tokenizer.json").is_file()
    assert sorted(p.name for p in elsewhere.iterdir()) == [MARKER, "notes.txt"]


def test_replace_dir_replaces_a_link_or_a_dangling_link_and_keeps_other_hidden_folders(tmp_path):
    from common.results import replace_dir

    target = tmp_path / "target"
    target.mkdir()
    (target / "f").write_text("kept")
    for dest_kind in ("link", "dangling"):
        dest = tmp_path / f"dest_{dest_kind}"
        dest.symlink_to(target if dest_kind == "link" else tmp_path / "nowhere")
        (tmp_path / f".{dest.name}.old-mine.tmp").mkdir()  # not a name replace_dir uses: never touched
        new = tmp_path / "new"
        new.mkdir()
        (new / "g").write_text("new")
        replace_dir(new, dest)
        assert not dest.is_symlink() and (dest / "g").read_text() == "new"
        assert (tmp_path / f".{dest.name}.old-mine.tmp").is_dir()
    assert (target / "f").read_text() == "kept"


VERIFIER_DRIVER = """
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
from common.export import verify_export_subprocess
from common.harness.verifier import Verifier
try:
    verify_export_subprocess(Path({export!r}), Path({reference!r}), check=Verifier())
except KeyboardInterrupt:  # the parent lives on: the check's process must be gone all the same
    print("interrupted", flush=True)
    import time
    time.sleep(600)
"""


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("sig_name", ["SIGKILL", "SIGINT"])
def test_the_export_verifier_never_outlives_its_parent(prepared_assets, tmp_path, sig_name):
    """A run's check process (`python -m common.export REQUEST`, the load check's or the export check's) is stopped
    with the process that started it: SIGKILL to that process (no Python cleanup runs; a SIGTERM, which the parent
    does not handle, ends it the same way, by the kernel) or Ctrl-C (the parent lives on). Before, a killed run left the verifier running. The check is held inside its import of
    transformers (in the middle of a check) by a `transformers` on PYTHONPATH that records its pid and sleeps: a
    fixture, nothing of the stack replaced."""
    import signal
    import time

    import psutil

    from conftest import ROOT, script_env, sigint_as_in_a_terminal

    sig = getattr(signal, sig_name)
    shadow = tmp_path / "shadow" / "transformers"
    shadow.mkdir(parents=True)
    pid_file = tmp_path / "verifier.pid"
    (shadow / "__init__.py").write_text(
        f"import os, time\nopen({str(pid_file) + '.tmp'!r}, 'w').write(str(os.getpid()))\n"
        f"os.replace({str(pid_file) + '.tmp'!r}, {str(pid_file)!r})\ntime.sleep(600)\n")
    reference = tmp_path / "run" / "export_reference.safetensors"
    reference.parent.mkdir()
    reference.write_bytes(b"")  # never read: the verifier waits in its imports
    env = script_env()
    env["PYTHONPATH"] = str(tmp_path / "shadow")
    driver = subprocess.Popen([sys.executable, "-c", VERIFIER_DRIVER.format(
        root=str(ROOT), export=str(prepared_assets["tiny_qwen3"]), reference=str(reference))],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=sigint_as_in_a_terminal)
    verifier = None
    try:
        deadline = time.monotonic() + 300
        while not pid_file.exists():
            assert driver.poll() is None, driver.communicate()
            assert time.monotonic() < deadline, "the verifier did not start"
            time.sleep(0.1)
        verifier = int(pid_file.read_text())
        assert psutil.Process(verifier).ppid() == driver.pid
        assert "common.export" in psutil.Process(verifier).cmdline()
        driver.send_signal(sig)
        if sig == signal.SIGINT:
            assert driver.stdout.readline().strip() == "interrupted"
        deadline = time.monotonic() + 60
        while _running(verifier) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(verifier), f"the verifier outlived {sig_name} to its parent"
        if sig == signal.SIGINT:
            assert driver.poll() is None  # it was the parent that stopped it, not its parent's end
    finally:
        driver.kill()
        driver.communicate()
        if verifier is not None and _running(verifier):
            psutil.Process(verifier).kill()


def test_each_check_is_a_process_of_its_own_and_a_refused_folder_is_its_error(prepared_assets, tmp_path):
    """The harness's Verifier runs each check (the load check at step 1, the export check at the end) in a process
    of its own: a folder that matches its reference passes, and one it refuses fails the check with the process's
    error line."""
    import torch
    from transformers import AutoModelForCausalLM

    from common import export
    from common.harness.verifier import Verifier

    tiny = prepared_assets["tiny_qwen3"]
    ids = torch.tensor([[1, 2, 3, 4]])
    positions = torch.arange(4)[None]
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)(ids, position_ids=positions).logits
    reference = tmp_path / "reference.safetensors"
    save_file({"input_ids": ids, "position_ids": positions, "logits": logits}, str(reference))
    check = export.verify_export_subprocess(tiny, reference, files=False, check=Verifier())
    assert check["max_abs_logit_diff"] == 0.0 and not check["missing_keys"] and "error" not in check, check
    refused = export.verify_export_subprocess(tmp_path / "nowhere", reference, check=Verifier())
    assert refused["error"] == f"the export cannot be read back: {tmp_path / 'nowhere'} does not exist: give the " \
                               "export's folder", refused


