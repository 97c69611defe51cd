"""Hostile inputs that used to lose a user's file, hang, or end in a traceback: the out_dir lock file, a tampered
run record, a damaged distributed checkpoint, a TensorBoard folder that is a file, a resume on changed data, the
verifier's --out, a full disk during a save, and a stop signal during a check. Each is refused in one `error:`
line (or, for a stop, ends as a stop), with nothing lost."""
from __future__ import annotations

import os
import sys

import pytest

from conftest import assert_clean_error, run_example

SCRIPT = "train_native_qwen3.py"


# --------------------------------------------------------------------------- the out_dir lock file
def _lock_refusal(out_dir) -> str:
    from common.errors import UserError
    from common.harness import launcher

    held = list(launcher._held)
    with pytest.raises(UserError) as refused:
        launcher.hold_out_dir(out_dir)
    assert launcher._held == held  # nothing held, nothing left open
    return str(refused.value)


def test_the_lock_never_follows_a_link_nor_writes_into_a_file_it_did_not_make(tmp_path):
    """OUT_DIR/.run.lock that is a link (to a user's file, or dangling), a folder, a FIFO, a hard link or a file
    that holds other text is refused in one line, and what is there is left byte for byte as it was."""
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
    cases[hard] = "has other names (hard links)"
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
    proc = run_example(SCRIPT, "--steps", "1", "--no-export", "--out_dir", str(out), check=False)
    assert_clean_error(proc, f"{out / '.run.lock'} is a symbolic link")
    assert notes.read_bytes() == b"my notes\n"
    assert not (out / "results.json").exists()


def test_the_lock_file_a_run_made_is_taken_again(tmp_path):
    """The lock file a run left (its `pid N on HOST since ...` line), and an empty one, are the run's own: taken
    again; while held, another run is refused naming the holder."""
    from common.harness import launcher

    out = tmp_path / "o"
    out.mkdir()
    for text in (None, None, b""):  # the first creates it, the second takes the one the first left, then empty
        if text is not None:
            (out / ".run.lock").write_bytes(text)
        launcher.hold_out_dir(out)
        fd = launcher._held.pop()
        try:
            assert (out / ".run.lock").read_text().startswith(f"pid {os.getpid()} on ")
            assert f"is in use by another run (pid {os.getpid()} on " in _lock_refusal(out)
        finally:
            os.close(fd)  # the run's end
