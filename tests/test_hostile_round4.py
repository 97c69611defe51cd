"""Hostile inputs that used to lose a user's file, hang, or end in a traceback: the out_dir lock file, a tampered
run record, a damaged distributed checkpoint, a TensorBoard folder that is a file, a resume on changed data, the
verifier's --out, a full disk during a save, and a stop signal during a check. Each is refused in one `error:`
line (or, for a stop, ends as a stop), with nothing lost."""
from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import assert_clean_error, run_example, run_in_process

SCRIPT = "train_native_qwen3.py"


# --------------------------------------------------------------------------- the out_dir lock file
def _lock_refusal(out_dir) -> str:
    from common.errors import UserError
    from common import results
    from common.harness import launcher

    held = list(results.HELD_LOCKS)
    with pytest.raises(UserError) as refused:
        launcher.hold_out_dir(out_dir)
    assert results.HELD_LOCKS == held  # nothing held, nothing left open
    return str(refused.value)


def test_the_lock_never_follows_a_link_nor_writes_into_a_file_it_did_not_make(tmp_path):
    """OUT_DIR/.run.lock that is a link (to a user's file, or dangling), a folder, a FIFO, or a file (a hard link of
    a user's file among them) that holds other text is refused in one line, and what is there is left byte for byte
    as it was."""
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"my notes\nline two\n")
    cases = {}
    link = tmp_path / "link"
    link.mkdir()
    (link / ".run.lock").symlink_to(notes)
    cases[link] = "is a symbolic link"
    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / ".run.lock").symlink_to(tmp_path / "nowhere")
    cases[dangling] = "is a symbolic link"
    folder = tmp_path / "folder"
    (folder / ".run.lock").mkdir(parents=True)
    cases[folder] = "is a folder"
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / ".run.lock")
    cases[fifo] = "is a FIFO"
    hard = tmp_path / "hard"
    hard.mkdir()
    os.link(notes, hard / ".run.lock")
    cases[hard] = "is not a lock file of these scripts (it holds other text)"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / ".run.lock").write_bytes(b"someone's text\n")
    cases[foreign] = "is not a lock file of these scripts"
    for out_dir, needle in cases.items():
        message = _lock_refusal(out_dir)
        assert needle in message and str(out_dir / ".run.lock") in message, message
    assert notes.read_bytes() == b"my notes\nline two\n"
    assert (foreign / ".run.lock").read_bytes() == b"someone's text\n"
    assert (link / ".run.lock").is_symlink() and (fifo / ".run.lock").is_fifo()


def test_a_linked_lock_file_is_refused_by_a_training_run_and_the_file_kept(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"my notes\n")
    out = tmp_path / "o"
    out.mkdir()
    (out / ".run.lock").symlink_to(notes)
    proc = run_in_process(SCRIPT, "--steps", "1", "--no-export", "--out_dir", str(out))
    assert_clean_error(proc, f"{out / '.run.lock'} is a symbolic link")
    assert notes.read_bytes() == b"my notes\n"
    assert not (out / "results.json").exists()


def test_the_lock_file_a_run_made_is_taken_again(tmp_path):
    """The lock file a run left (its `pid N on HOST since ...` line), and an empty one, are the run's own: taken
    again; while held, another run is refused naming the holder."""
    from common import results
    from common.harness import launcher

    out = tmp_path / "o"
    out.mkdir()
    for text in (None, None, b""):  # the first creates it, the second takes the one the first left, then empty
        if text is not None:
            (out / ".run.lock").write_bytes(text)
        launcher.hold_out_dir(out)
        fd = results.HELD_LOCKS.pop()
        try:
            assert (out / ".run.lock").read_text().startswith(f"pid {os.getpid()} on ")
            assert f"is in use by another run (pid {os.getpid()} on " in _lock_refusal(out)
        finally:
            os.close(fd)  # the run's end


# --------------------------------------------------------------------------- a tampered run record, a FIFO reference
def _record(**changes) -> dict:
    record = {"script": SCRIPT, "world_size": 1, "dataset": ["c4_test", "/data"],
              "settings": {"lr": 0.003, "seed": 0, "dtype": "float32", "dataset_path": None, "hf_checkpoint": None}}
    record.update(changes)
    return record


@pytest.mark.parametrize("text,needle", [
    ("[]", "holds a JSON array, not an object"),
    ("null", "holds a JSON null, not an object"),
    ("{not json", "is not valid JSON"),
    ("\udcff", "is not UTF-8 text"),
    ("settings: []", "settings is a JSON array, not an object"),
    ("lr: string", "setting lr is a JSON string where this run's is a number"),
    ("hf_checkpoint: string", "setting hf_checkpoint is a JSON string, not an object or null"),
    ("world_size: string", "world_size is a JSON string, not a positive integer"),
    ("script: 3", "script is a JSON number, not a string"),
    ("dataset: {}", "dataset is a JSON object, not a [name, folder] array or null"),
    ("fifo", "is a FIFO, not a regular file"),
])
def test_a_tampered_run_record_is_one_line_and_the_checkpoint_untouched(tmp_path, text, needle):
    import json

    from common.errors import UserError
    from common.harness import resume

    step = tmp_path / "checkpoint" / "step-2"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"kept")
    record_path = tmp_path / "checkpoint" / "run.json"
    if text == "fifo":
        os.mkfifo(record_path)
    elif ": " in text and not text.startswith("{"):
        key, kind = text.split(": ")
        record = _record()
        value = {"[]": [], "{}": {}, "string": "x", "3": 3}[kind]
        if key in ("lr", "hf_checkpoint"):
            record["settings"][key] = value
        else:
            record[key] = value
        record_path.write_text(json.dumps(record))
    else:
        record_path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(UserError) as refused:
        resume.check_resume(tmp_path, _record(), steps=4)
    message = str(refused.value)
    assert f"{record_path} is damaged" in message and needle in message, message
    assert (step / ".metadata").read_bytes() == b"kept"
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["run.json", "step-2"]


def test_a_fifo_as_compare_losses_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "ref.json"
    os.mkfifo(fifo)
    proc = run_example(SCRIPT, "--steps", "1", "--compare_losses", str(fifo), "--out_dir", str(tmp_path / "o"),
                       check=False, timeout=120)
    assert_clean_error(proc, f"--compare_losses: {fifo} is a FIFO, not a regular file")
    assert not (tmp_path / "o").exists()  # refused before the out_dir is made


# --------------------------------------------------------------------------- one small real checkpoint, copied by links
RUN = ("--steps", "3", "--checkpoint_every", "2", "--no-export", "--seq_len", "64", "--local_batch_size", "1")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, prepared_assets):
    """(data folder, out_dir) of one real run on a small --dataset folder with a whole checkpoint of step 2
    (torchtitan's distributed checkpoint: .metadata and __0_0.distcp), and a copy of it by links named step-1: the
    files of a whole step before it (never loaded here). Tests copy the folder with `_linked_copy` and replace, never
    change in place, the files they damage."""
    from common.paths import asset_dir

    root = tmp_path_factory.mktemp("trained")
    data = root / "data"
    data.mkdir()
    lines = (asset_dir("corpus") / "train.jsonl").read_text().splitlines()[:300]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    out = root / "run"
    run_example(SCRIPT, *RUN, "--dataset", str(data), "--out_dir", str(out))
    _linked_copy(out / "checkpoint" / "step-2", out / "checkpoint" / "step-1")
    assert sorted(p.name for p in (out / "checkpoint").iterdir() if p.name.startswith("step-")) == ["step-1", "step-2"]
    return data, out


def _linked_copy(src, dst):
    import shutil

    shutil.copytree(src, dst, copy_function=os.link, symlinks=True)
    return dst


def _replace(path, data: bytes) -> None:
    """A new file of that name (the copy's link to the fixture's file is dropped, the fixture's file kept)."""
    path.unlink()
    path.write_bytes(data)


def _snapshot(folder) -> dict:
    """Every file's size and modification time, but the lock file's (each run writes its own line there)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".run.lock"}


@pytest.mark.parametrize("damage", ["shard removed", "shard truncated", "metadata random", "both steps"])
def test_a_damaged_checkpoint_is_named_before_anything_is_built(trained, tmp_path, damage):
    data, src = trained
    out = _linked_copy(src, tmp_path / "run")
    step2, step1 = out / "checkpoint" / "step-2", out / "checkpoint" / "step-1"
    if damage == "shard removed":
        (step2 / "__0_0.distcp").unlink()
        needles = ["__0_0.distcp is missing", "step 1 before it is whole"]
    elif damage == "shard truncated":
        shard = step2 / "__0_0.distcp"
        _replace(shard, shard.read_bytes()[:-4096])
        needles = ["__0_0.distcp is truncated", "step 1 before it is whole"]
    else:
        _replace(step2 / ".metadata", os.urandom(4096))
        needles = ["its .metadata is not a distributed checkpoint's metadata", "step 1 before it is whole"]
        if damage == "both steps":
            (step1 / "__0_0.distcp").unlink()
            needles = ["its .metadata is not a distributed checkpoint's metadata", "no checkpoint before it is whole"]
    before = _snapshot(out)
    proc = run_in_process(SCRIPT, *RUN[2:], "--steps", "4", "--dataset", str(data), "--out_dir", str(out))
    assert_clean_error(proc, f"the checkpoint of step 2, {step2}, is damaged", *needles)
    assert _snapshot(out) == before  # nothing moved, written or deleted
    assert "[config]" not in proc.stdout  # refused before the trainer was built


def test_a_resume_on_changed_data_is_refused(trained, tmp_path):
    """The data is recorded by what it is (each file training reads, its size and hash), not only by its folder: a
    rewritten train.jsonl of the same size is another run's data."""
    data, src = trained
    out = _linked_copy(src, tmp_path / "run")
    train = data / "train.jsonl"
    kept, stamp = train.read_bytes(), train.stat()
    try:
        lines = kept.decode().splitlines()
        train.write_bytes(("\n".join(reversed(lines)) + "\n").encode())  # the same bytes in another order
        assert train.stat().st_size == len(kept)
        proc = run_in_process(SCRIPT, *RUN[2:], "--steps", "6", "--dataset", str(data), "--out_dir", str(out))
        assert_clean_error(proc, "was written by another run", f"data {data}: the files training reads changed",
                           "train.jsonl")
    finally:
        train.write_bytes(kept)
        os.utime(train, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    record = __import__("json").loads((out / "checkpoint" / "run.json").read_text())
    assert record["data"]["files"]["train.jsonl"]["hashed"] == "whole"


def test_a_tampered_run_record_of_a_real_checkpoint_is_one_line(trained, tmp_path):
    import json

    data, src = trained
    out = _linked_copy(src, tmp_path / "run")
    record = out / "checkpoint" / "run.json"
    tampered = dict(json.loads(record.read_text()), settings=[])
    _replace(record, json.dumps(tampered).encode())
    before = _snapshot(out)
    proc = run_in_process(SCRIPT, *RUN[2:], "--steps", "4", "--dataset", str(data), "--out_dir", str(out))
    assert_clean_error(proc, f"{record} is damaged (its settings is a JSON array, not an object)")
    assert _snapshot(out) == before


# --------------------------------------------------------------------------- --tensorboard into a `tb` that is no folder
@pytest.mark.parametrize("kind", ["file", "dangling link"])
def test_tensorboard_into_a_tb_that_is_not_a_folder_is_refused_before_any_work(tmp_path, kind):
    out = tmp_path / "o"
    out.mkdir()
    tb = out / "tb"
    if kind == "file":
        tb.write_bytes(b"my file\n")
    else:
        tb.symlink_to(tmp_path / "nowhere")
    proc = run_in_process(SCRIPT, "--steps", "1", "--no-export", "--tensorboard", "--out_dir", str(out))
    assert_clean_error(proc, f"{tb} is {'a file' if kind == 'file' else 'a dangling link'}, not a folder for "
                             "--tensorboard")
    assert "[config]" not in proc.stdout and not (out / "results.json").exists()
    assert tb.is_symlink() or tb.read_bytes() == b"my file\n"


# --------------------------------------------------------------------------- the verifier's --out
def test_verify_never_replaces_a_file_that_is_not_a_previous_check(prepared_assets, tmp_path):
    """`python -m common.harness.verifier verify X --reference R --out O`: O that is R, lies inside X, or is any
    other existing file than a previous check's JSON is refused in one line and kept; a previous check's JSON is
    replaced."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from conftest import run_module_in_process

    export = _linked_copy(prepared_assets["tiny_qwen3"], tmp_path / "export")
    ids, positions = torch.tensor([[3, 4, 5]]), torch.arange(3)[None]
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)(ids, position_ids=positions).logits
    reference = tmp_path / "reference.safetensors"
    save_file({"input_ids": ids, "position_ids": positions, "logits": logits}, str(reference))
    weights = tmp_path / "my_weights.safetensors"
    weights.write_bytes((export / "model.safetensors").read_bytes()[:4096])

    def verify(out):
        return run_module_in_process("common.harness.verifier", "verify", str(export), "--reference", str(reference),
                                     "--out", str(out))

    kept = {p: p.read_bytes() for p in (reference, weights, export / "config.json")}
    for out, needle in ((reference, "is the --reference file"), (export / "config.json", f"lies inside {export}"),
                        (export / "new.json", f"lies inside {export}"),
                        (weights, "is an existing file that is not an export check's JSON")):
        assert_clean_error(verify(out), f"--out {out} ", needle)
    assert {p: p.read_bytes() for p in kept} == kept and not (export / "new.json").exists()
    check = tmp_path / "check.json"
    for _ in range(2):  # written, then a previous check's JSON replaced
        done = verify(check)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(check.read_text())["max_abs_logit_diff"] == 0.0


# --------------------------------------------------------------------------- a full disk during a checkpoint save
@pytest.fixture
def small_disk(tmp_path):
    """A 200 MiB tmpfs: one checkpoint of the tiny model (150 MiB) fits, a second does not."""
    from conftest import tmpfs

    with tmpfs(tmp_path / "small_disk", "200m") as disk:
        yield disk


def test_a_full_disk_during_a_checkpoint_save_is_one_line_naming_the_last_whole_checkpoint(small_disk):
    """torch's distributed checkpoint writes each shard with torch.save, whose zip writer reports a short write as
    `RuntimeError: [enforce fail at inline_container.cc] unexpected pos` (no errno), wrapped in a
    CheckpointException: the run ended in a traceback of a hundred lines. Now: one line naming the disk and the last
    whole checkpoint, which a rerun resumes from."""
    out = small_disk / "run"
    proc = run_example(SCRIPT, "--steps", "6", "--checkpoint_every", "2", "--no-export", "--seq_len", "64",
                       "--local_batch_size", "1", "--no-disk_check",  # the check before the launch would refuse it
                       "--out_dir", str(out), check=False)
    assert_clean_error(proc, f"out of disk space writing {out}", "free on its file system",
                       f"the last whole checkpoint is {out / 'checkpoint' / 'step-2'}")
    assert proc.returncode == 2


# --------------------------------------------------------------------------- a stop signal during a check
STOP_DURING_CHECK = """
import json, os, signal, sys, threading, time
from pathlib import Path
import psutil
sys.path.insert(0, {root!r})
from common import export
from common.harness import stops, verifier
stop = stops.StopControl(end=None, margin_s=0.0, is_main=True)
stop.install()  # as a training run: a stop signal ends the run at a step boundary


def during():  # once the check's process runs (its stop signals ignored from before its exec): the stop signal
    while True:
        checks = [p for p in psutil.Process().children() if "common.export" in " ".join(p.cmdline())]
        if checks:
            break
        time.sleep(0.01)
    os.killpg(0, signal.{sig})  # Ctrl-C in a terminal, or a scheduler's SIGTERM to the process group
    if signal.{then} == signal.SIGKILL:
        checks[0].kill()  # the check's process killed while the run is stopping


threading.Thread(target=during).start()
try:
    check = export.verify_export_subprocess(Path({export!r}), Path({reference!r}),
                                            check=verifier.Verifier(stopping=lambda: stop.reason is not None))
    print(json.dumps({{"check": check, "stop": stop.reason}}), flush=True)
except KeyboardInterrupt as e:
    print(json.dumps({{"interrupted": str(e), "is_check_interrupted": isinstance(e, verifier.CheckInterrupted),
                      "stop": stop.reason}}), flush=True)
"""


@pytest.fixture(scope="module")
def export_and_reference(prepared_assets, tmp_path_factory):
    """The tiny Qwen3 folder and a reference of its own logits: a check of it passes."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    tiny = prepared_assets["tiny_qwen3"]
    ids, positions = torch.tensor([[7, 8, 9, 10]]), torch.arange(4)[None]
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)(ids, position_ids=positions).logits
    reference = tmp_path_factory.mktemp("reference") / "reference.safetensors"
    save_file({"input_ids": ids, "position_ids": positions, "logits": logits}, str(reference))
    return tiny, reference


@pytest.mark.parametrize("sig,then", [("SIGINT", "SIGCONT"), ("SIGTERM", "SIGKILL")])
def test_a_stop_signal_during_a_check_is_a_stop_never_a_verdict(export_and_reference, tmp_path, sig, then):
    """Ctrl-C or a group SIGTERM while the run's check process checks an export (or the load at step 1): the
    process is not the run's to stop (it ignores stop signals and dies with the run), so the check ends with its
    real verdict and the run stops as a stop does. A check process killed while the run is stopping (here SIGKILL)
    gives no verdict: the check is interrupted, not failed. Before, the check died of the signal and the good export
    was rejected (the load check: "the model is not the checkpoint"), exit 2. SIGINT and SIGTERM reach one handler
    (StopControl._on_signal, for every stop signal) and the check process ignores both: Ctrl-C is the case with a
    verdict, SIGTERM the one with the check killed."""
    from conftest import ROOT, run_python

    export_dir, reference = export_and_reference
    driver = tmp_path / "driver.py"
    driver.write_text(STOP_DURING_CHECK.format(root=str(ROOT), export=str(export_dir), reference=str(reference),
                                               sig=sig, then=then))
    # a process and process group of its own (its os.killpg(0, ...) reaches it and its check only)
    proc = run_python([sys.executable, str(driver)], cwd=tmp_path, timeout=300)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["stop"] == sig  # the run itself got the stop signal
    if then == "SIGCONT":
        check = got.get("check") or {}
        assert "error" not in check and check.get("max_abs_logit_diff") == 0.0, got
    else:
        assert got.get("is_check_interrupted") and "no verdict" in got["interrupted"], got


def test_an_interrupted_export_check_leaves_the_export_staged_and_the_old_one_in_place(tmp_path):
    """complete_export whose check is interrupted: the new export stays staged (.hf_export.tmp), hf_export is as it
    was, nothing goes to hf_export.rejected."""
    import torch
    from safetensors.torch import save_file

    from common import export
    from common.harness.verifier import CheckInterrupted

    out = tmp_path / "o"
    old = out / "hf_export"
    old.mkdir(parents=True)
    (old / "config.json").write_text(json.dumps({"qwen3_recipes_versions": {"old": "1"}}))
    step = out / "checkpoint" / "step-2"
    step.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(step / "model.safetensors"))

    def verify(_staged):
        raise CheckInterrupted("the checks' verifier ended by SIGKILL during a check, while the run was "
                               "stopping: no verdict")

    with pytest.raises(CheckInterrupted) as stopped:
        export.complete_export(step, old, {"architectures": ["Qwen3ForCausalLM"]}, tmp_path, {"new": "1"},
                               verify=verify)
    assert f"the new export stays unverified in {out / '.hf_export.tmp'}" in str(stopped.value)
    assert json.loads((old / "config.json").read_text())["qwen3_recipes_versions"] == {"old": "1"}
    assert (out / ".hf_export.tmp" / "model.safetensors").is_file() and not (out / "hf_export.rejected").exists()
    assert export.owned(out / ".hf_export.tmp")  # the run's own: the next export replaces it


def test_a_ctrl_c_during_the_export_check_of_the_core_alone_says_where_the_export_is(tmp_path):
    """With the core alone (no stop handlers), a Ctrl-C during the export check is a KeyboardInterrupt: it ends the
    run as interrupted (exit 130), naming the staged export; hf_export is as it was."""
    import torch
    from safetensors.torch import save_file

    from common import export

    out = tmp_path / "o"
    step = out / "checkpoint" / "step-2"
    step.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(step / "model.safetensors"))

    def verify(_staged):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as stopped:
        export.complete_export(step, out / "hf_export", {"architectures": ["Qwen3ForCausalLM"]}, tmp_path,
                               {"new": "1"}, verify=verify)
    assert str(stopped.value) == (f"the new export stays unverified in {out / '.hf_export.tmp'}, "
                                  f"{out / 'hf_export'} is as it was")
    assert (out / ".hf_export.tmp" / "model.safetensors").is_file() and not (out / "hf_export").exists()
