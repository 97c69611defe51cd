"""Each example from a copy of itself and the core alone (common/ without common/harness/), in a fresh folder with
nothing of this repository on the path: a training example trains (native: under torchrun, two processes) and
writes an HF export that re-reads as the trained model, and says in one line that the guards are off; rope_parity.py
checks the op; the compatibility check checks a model. The copy with the harness: tests/test_copy.py."""
from __future__ import annotations

import sys

import pytest

from conftest import read_results
from test_copy import CORE_RUNS, TRAINING, copies, copy_example, run_copy

@pytest.mark.parametrize("name", copies(CORE_RUNS, "core"))
def test_example_runs_from_a_copy_of_the_core_alone(name, tmp_path, prepared_assets):
    project = tmp_path / "project"
    script = copy_example(name, project, core_only=True)
    out_dir = tmp_path / "run"
    nproc, args = CORE_RUNS[name]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc else [sys.executable]
    proc = run_copy([*launch, str(script), *args, "--out_dir", str(out_dir)], project)
    results = read_results(out_dir)
    if name in TRAINING:
        guards_off = [ln for ln in proc.stdout.splitlines() if ln.startswith("[guards] off")]
        assert len(guards_off) == 1, proc.stdout[-3000:]
        assert "stopped" not in results and "timing" not in results  # no harness, none of its fields
        assert results["world_size"] == max(nproc, 1) and len(results["losses"]) == int(args[1])
        assert results["export_check"]["passed"], results["export_check"]
        assert results["export_check"]["max_abs_logit_diff"] <= results["export_check"]["tolerance"]
        assert (out_dir / "hf_export" / "config.json").is_file()
    elif name == "rope_parity.py":
        assert results["passed"]
    else:
        assert [m["result"] for m in results["models"]] == ["PASS"]


def test_the_core_alone_never_resumes_and_says_what_is_off(tmp_path, capsys):
    """The core alone (common.recipe.run_core, what a copy without common/harness/ runs), in this process: an
    out_dir holding a checkpoint (torchtitan would load it, whatever run wrote it, a changed --lr ignored) or a
    guarded run's record is one error line, nothing moved; a guard's flag is unknown with the reason; --help and
    the run's first line say what is off."""
    from common.recipe import run_core
    from slow_native_qwen3 import recipe

    native = recipe()
    out = tmp_path / "o"
    from common import export

    export.make_owned_dir(out / "checkpoint")  # a run's own checkpoint folder, with a whole step in it
    (out / "checkpoint" / "step-2").mkdir()
    (out / "checkpoint" / "step-2" / ".metadata").write_bytes(b"")
    assert run_core(native, ["--lr", "0.01", "--out_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "holds checkpoints" in err and "never resumes" in err, err
    assert (out / "checkpoint" / "step-2").is_dir()
    guarded = tmp_path / "guarded"
    (guarded / "checkpoint").mkdir(parents=True)
    (guarded / "checkpoint" / "run.json").write_text("{}")  # a guarded run's record
    assert run_core(native, ["--out_dir", str(guarded)]) == 2
    assert "is a guarded run's folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as unknown:
        run_core(native, ["--eval_every", "2", "--out_dir", str(tmp_path / "x")])
    assert unknown.value.code == 2
    assert "--eval_every 2 (this copy has the core alone" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_core(native, ["--help"])
    assert "[guards] off" in capsys.readouterr().out


def test_the_core_alone_and_a_guarded_run_share_one_lock_on_the_out_dir(tmp_path, capsys):
    """One lock for both copy modes (common.results.hold_lock): while a guarded run holds the out_dir (its launcher's
    lock, taken here as a rerun takes it), a run of the core alone into it is one error line naming that run and
    writes nothing; a lock file that is a hard link of a user's file, or a FIFO, is refused and left as it is."""
    import os
    from unittest import mock

    from common import recipe as core, results
    from common.harness import launcher
    from slow_native_qwen3 import recipe

    def core_run(out):
        with mock.patch.dict(os.environ):  # device.setup fills the variables of a process group of one
            return core.run_core(recipe(), ["--steps", "1", "--no-export", "--out_dir", str(out)])

    out = tmp_path / "o"
    out.mkdir()
    launcher.hold_out_dir(out)  # the guarded run's lock
    try:
        assert core_run(out) == 2
    finally:
        os.close(results.HELD_LOCKS.pop())
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert f"--out_dir {out} is in use by another run (pid {os.getpid()} on " in err, err
    assert sorted(p.name for p in out.iterdir()) == [results.LOCK]
    users = tmp_path / "notes.txt"
    users.write_text("a user's file\n")
    linked = tmp_path / "linked"
    linked.mkdir()
    os.link(users, linked / results.LOCK)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / results.LOCK)
    for folder, what in ((linked, "is not a lock file of these scripts (it holds other text)"),
                         (fifo, "is a FIFO, not a lock file of these scripts")):
        assert core_run(folder) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and what in err, err
    assert users.read_text() == "a user's file\n"
