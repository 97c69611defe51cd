"""A rented hour is never lost: a stop signal or --time_limit ends a training run at a step boundary with a
torchtitan checkpoint of that step and exit code 75; the same command resumes it, with the losses of a run that
never stopped; a rerun that is not the same run is refused in one line before anything is built.

Signals go to the scripts' own launcher, to one worker only, to torchrun, and (Ctrl-C) to a single process; a
second signal during the stop save ends the run at once and the previous checkpoint stays usable. No process
outlives any of these runs."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from common.losses import read_progress
from common.resume import EXIT_STOPPED
from conftest import (ROOT, assert_clean_error, example_command, read_results, run_example, script_env,
                      sigint_as_in_a_terminal)

SCRIPT = "train_native_qwen3.py"
TWO_RANKS = ("--steps", "6", "--no-export", "--seed", "1")
REL = 1e-6  # float32 on CPU: a resumed step's loss is the uninterrupted one's to an ulp or so (9.5e-7 at loss 11)


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= REL * abs(y) for x, y in zip(a, b))


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _no_process_outlives(family: list[int]) -> None:
    deadline = time.monotonic() + 60
    while _alive(family) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(family), _alive(family)


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    """The command in the background, its output in `log` (a pipe nobody reads while it trains could fill)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=script_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            preexec_fn=sigint_as_in_a_terminal)
    proc.log = log
    return proc


def _finish(proc: subprocess.Popen) -> str:
    proc.wait(timeout=300)
    return proc.log.read_text()


def _wait_for_step(proc: subprocess.Popen, out: Path, step: int) -> None:
    deadline = time.monotonic() + 300
    while not any(r["step"] >= step for r in read_progress(out / "losses.jsonl")):
        assert proc.poll() is None, proc.log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no step {step} in time"
        time.sleep(0.05)


def _workers(proc: subprocess.Popen) -> dict[int, psutil.Process]:
    """LOCAL_RANK -> worker process, below `proc` (the launcher or torchrun)."""
    deadline = time.monotonic() + 60
    while True:
        found = {}
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                rank = p.environ().get("LOCAL_RANK")
            except psutil.Error:
                continue
            if rank is not None and "torch.distributed.run" not in " ".join(p.cmdline()):
                found[int(rank)] = p
        if len(found) == 2 or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, prepared_assets) -> dict:
    out = tmp_path_factory.mktemp("straight")
    run_example(SCRIPT, *TWO_RANKS, "--nproc_per_node", "2", "--out_dir", str(out))
    return read_results(out)


@pytest.mark.parametrize("launch, target", [("self", "launcher"), ("self", "one worker"), ("torchrun", "torchrun")])
def test_a_stop_signal_saves_every_rank_at_one_step_and_the_same_command_resumes(uninterrupted, tmp_path, launch,
                                                                                target):
    """Two ranks on CPU, SIGTERM after step 3: to the scripts' own launcher, to the rank-1 worker only (rank 0
    learns of it through the per-step agreement), or to torchrun. The run saves a whole checkpoint of the step
    where every rank stopped, says so in results.json, ends without a traceback (self-launched: exit 75), and the
    same command then trains the remaining steps to the losses of a run that never stopped."""
    out = tmp_path / "o"
    args = (*TWO_RANKS, "--out_dir", str(out))
    cmd = (example_command(SCRIPT, *args, "--nproc_per_node", "2") if launch == "self"
           else example_command(SCRIPT, *args, torchrun=2))
    proc = _start(cmd, tmp_path / "log")
    _wait_for_step(proc, out, 3)
    workers = _workers(proc)
    assert len(workers) == 2, workers
    family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    (workers[1] if target == "one worker" else psutil.Process(proc.pid)).send_signal(signal.SIGTERM)
    err = _finish(proc)
    _no_process_outlives(family)

    stopped = read_results(out)["stopped"]
    assert stopped and stopped["step"] >= 3 and stopped["reason"] == "SIGTERM", stopped
    assert (out / "checkpoint" / f"step-{stopped['step']}" / ".metadata").is_file()
    if launch == "self":
        assert proc.returncode == EXIT_STOPPED and "Traceback" not in err, err[-3000:]
        assert f"[stopped] SIGTERM after step {stopped['step']}: checkpoint" in err, err[-3000:]
    else:  # torchrun reports the workers' exit 75 (or its own signal) its own way: non-zero
        assert proc.returncode != 0

    if launch == "self":
        run_example(SCRIPT, *args, "--nproc_per_node", "2")
    else:
        run_example(SCRIPT, *args, torchrun=2)
    resumed = read_results(out)
    assert resumed["resumed_from_step"] == stopped["step"] and resumed["stopped"] is None
    assert resumed["history"]["steps"] == list(range(1, 7))
    assert _close(resumed["history"]["losses"], uninterrupted["losses"]), (resumed["history"], uninterrupted["losses"])


def test_time_limit_stops_before_the_budget_ends_and_the_run_resumes(shared_run, tmp_path):
    """--time_limit 0.01 (0.6 s, spent before step 1 ends) with no margin: the run stops after step 1 with a
    checkpoint, exit 75; the same command without the limit trains on to the tiny preset's uninterrupted losses."""
    _, straight = shared_run("native_tiny")
    out = tmp_path / "o"
    run = ("--preset", "tiny", "--steps", "10", "--no-export", "--out_dir", str(out))
    proc = run_example(SCRIPT, *run, "--time_limit", "0.01", "--stop_margin_s", "0", check=False)
    assert proc.returncode == EXIT_STOPPED, proc.stdout[-2000:] + proc.stderr[-2000:]
    stopped = read_results(out)["stopped"]
    assert stopped == {"reason": "time_limit", "step": 1, "checkpoint": str(out / "checkpoint" / "step-1")}
    assert "run the same command again" in proc.stdout
    run_example(SCRIPT, *run)
    resumed = read_results(out)
    assert resumed["resumed_from_step"] == 1 and _close(resumed["history"]["losses"], straight["losses"])


def test_a_second_signal_during_the_stop_save_ends_the_run_at_once(shared_run, tmp_path):
    """Ctrl-C, then Ctrl-C again while the stop save is being written: the run ends at once with one line (exit
    130), the half-written step folder is never loaded, and the same command resumes from the last whole
    checkpoint to the uninterrupted losses. The process is paused while the second signal is sent, so the signal
    arrives mid-save and after the one-second window in which a repeat counts as the same signal."""
    _, straight = shared_run("native_tiny")
    out = tmp_path / "o"
    run = ("--preset", "tiny", "--steps", "10", "--checkpoint_every", "2", "--no-export", "--out_dir", str(out))
    for attempt in range(3):  # the pause must land inside a save of ~0.3 s; retried, never weakened
        shutil.rmtree(out, ignore_errors=True)
        proc = _start(example_command(SCRIPT, *run), tmp_path / f"log{attempt}")
        _wait_for_step(proc, out, 3)
        proc.send_signal(signal.SIGINT)
        caught = None
        while proc.poll() is None and caught is None:
            folders = sorted((out / "checkpoint").glob("step-*"))
            partial = [f for f in folders if int(f.name[5:]) > 2 and not (f / ".metadata").exists()]
            if partial:
                proc.send_signal(signal.SIGSTOP)
                caught = partial[0] if not (partial[0] / ".metadata").exists() else None
                if caught is None:
                    proc.send_signal(signal.SIGCONT)
                    break
                time.sleep(1.2)
                proc.send_signal(signal.SIGINT)
                proc.send_signal(signal.SIGCONT)
            time.sleep(0.002)
        err = _finish(proc)
        if caught is not None:
            break
    assert caught is not None, "no stop save caught in progress in three runs"
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == [
        "error: SIGINT again: ended at once; the last complete checkpoint in the out_dir stays usable"]
    assert not (caught / ".metadata").exists()
    run_example(SCRIPT, *run)
    resumed = read_results(out)
    assert resumed["resumed_from_step"] < int(caught.name[5:])
    assert _close(resumed["history"]["losses"], straight["losses"])


# ---- a resume is the same run, or it is refused ------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory, prepared_assets) -> tuple[Path, tuple[str, ...]]:
    """A run that left a whole checkpoint at step 2 (--steps 4 --checkpoint_every 2, no export)."""
    out = tmp_path_factory.mktemp("checkpointed")
    run = ("--steps", "4", "--checkpoint_every", "2", "--no-export", "--out_dir", str(out))
    run_example(SCRIPT, *run)
    return out, run


def _other_data(tmp_path: Path) -> Path:
    folder = tmp_path / "other_data"
    folder.mkdir()
    (folder / "data.jsonl").write_text("".join(json.dumps({"text": f"Another sentence, number {i}."}) + "\n"
                                               for i in range(200)))
    return folder


def _other_weights(tmp_path: Path, prepared_assets) -> Path:
    folder = tmp_path / "other_weights"
    shutil.copytree(prepared_assets["tiny_qwen3"], folder)
    return folder


REFUSED = [  # (flags changed on the rerun, what the error line names)
    (("--lr", "0.03"), "--lr 0.03 (checkpoint: 0.003)"),
    (("--seq_len", "64"), "--seq_len 64 (checkpoint: 128)"),
    (("--local_batch_size", "4"), "--local_batch_size 4 (checkpoint: 2)"),
    (("--global_batch_size", "4"), "--global_batch_size 4 (checkpoint: -1)"),
    (("--dtype", "bfloat16"), '--dtype "bfloat16" (checkpoint: "float32")'),
    (("--seed", "7"), "--seed 7 (checkpoint: 0)"),
    (("--warmup_steps", "1"), "--warmup_steps 1 (checkpoint: 2)"),
    (("--flavor", "0.6B"), '--flavor "0.6B" (checkpoint: "tiny")'),
    (("--dataset", "{other_data}"), "--dataset"),
    (("--hf_checkpoint", "{other_weights}"), "--hf_checkpoint"),
    (("--nproc_per_node", "2"), "world size 2 (checkpoint: 1"),
]


@pytest.mark.parametrize("changed, named", REFUSED, ids=[" ".join(r[0][:1]) for r in REFUSED])
def test_a_rerun_that_is_not_the_same_run_is_refused(checkpointed, tmp_path, prepared_assets, changed, named):
    out, run = checkpointed
    before = sorted(p.name for p in (out / "checkpoint").iterdir())
    values = {"other_data": str(_other_data(tmp_path)) if "{other_data}" in changed else "",
              "other_weights": str(_other_weights(tmp_path, prepared_assets)) if "{other_weights}" in changed else ""}
    args = [a.format(**values) for a in changed]
    proc = run_example(SCRIPT, *run, "--steps", "6", *args, check=False)
    assert_clean_error(proc, "was written by another run, so this one cannot resume it", named,
                       "start anew with another --out_dir")
    assert proc.returncode == 2
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == before  # nothing moved or deleted


@pytest.mark.parametrize("script", ["train_hf_backend.py", "train_moe_nki.py"])
def test_another_training_script_on_the_same_out_dir_is_refused(checkpointed, script):
    out, _ = checkpointed
    proc = run_example(script, "--steps", "6", "--no-export", "--out_dir", str(out), check=False)
    assert_clean_error(proc, "written by train_native_qwen3.py, this is " + script)


def test_steps_at_or_below_the_newest_checkpoint_train_nothing_and_a_larger_steps_continues(checkpointed):
    out, run = checkpointed
    for steps in ("1", "2"):
        proc = run_example(SCRIPT, *run, "--steps", steps, check=False)
        assert_clean_error(proc, f"nothing to train: {out / 'checkpoint' / 'step-2'} is at step 2 and --steps is "
                                 f"{steps}")
    assert (out / "checkpoint" / "step-2" / ".metadata").is_file()
    run_example(SCRIPT, *run, "--steps", "5", "--checkpoint_every", "3")  # the interval may change
    resumed = read_results(out)
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == [3, 4, 5]


def test_a_second_run_into_a_held_out_dir_is_refused_naming_the_holder(tmp_path, prepared_assets):
    """Two runs into one out_dir at once: the second refuses in one line naming the first (its pid and command);
    the OS releases the lock when the first ends, however it ends."""
    out = tmp_path / "o"
    first = _start(example_command(SCRIPT, "--steps", "200", "--no-export", "--out_dir", str(out)), tmp_path / "log")
    try:
        _wait_for_step(first, out, 1)
        proc = run_example(SCRIPT, "--steps", "3", "--no-export", "--out_dir", str(out), check=False)
        assert_clean_error(proc, "is in use by another run", f"pid {first.pid}", "train_native_qwen3.py")
    finally:
        first.kill()
        first.wait()
    run_example(SCRIPT, "--steps", "2", "--no-export", "--out_dir", str(out))  # released with the holder


def test_kill_9_of_the_launcher_leaves_no_worker_and_the_rerun_is_one_run(tmp_path, prepared_assets):
    """SIGKILL to the launcher of a --nproc_per_node 2 run of 200 steps: torchrun gets SIGTERM when its parent dies
    and its workers stop at the next step with a checkpoint, so nothing trains on (without that they would train
    for minutes, racing any rerun); the out_dir lock goes with them. A rerun then resumes, and the loss history
    has each step once, in order."""
    out = tmp_path / "o"
    args = ("--no-export", "--nproc_per_node", "2", "--out_dir", str(out))
    proc = _start(example_command(SCRIPT, "--steps", "200", *args), tmp_path / "log")
    _wait_for_step(proc, out, 2)
    family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    assert len(family) >= 3  # torchrun and its two workers
    proc.kill()
    proc.wait()
    _no_process_outlives(family)
    stopped = read_results(out)["stopped"]
    assert stopped and stopped["reason"] == "SIGTERM", stopped
    run_example(SCRIPT, "--steps", str(stopped["step"] + 2), *args)
    history = read_results(out)["history"]["steps"]
    assert history == list(range(1, stopped["step"] + 3)), history
