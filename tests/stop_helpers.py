"""What the stop-and-resume tests share: commands started in the background with their output in a file, waits
on a training step, the workers below a launcher, and the check that no process outlives a run."""
from __future__ import annotations

import time
from pathlib import Path

import psutil

from common.harness.checks import read_progress
from conftest import TWO_RANKS, PreforkedProcess, start_python

SCRIPT = "train_native_qwen3.py"
STEPS = int(TWO_RANKS[TWO_RANKS.index("--steps") + 1])  # room for two stops, one after the other, and steps after them
ONE_RANK = ("--steps", "6", "--no-export")  # the tiny preset, seed 0
REL = 1e-6  # float32 on CPU: a resumed step's loss is the uninterrupted one's to an ulp or so (9.5e-7 at loss 11)


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= REL * abs(y) for x, y in zip(a, b))


def alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def no_process_outlives(family: list[int]) -> None:
    deadline = time.monotonic() + 60
    while alive(family) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(family), alive(family)


def start(cmd: list[str], log: Path) -> PreforkedProcess:
    """The command in the background (pre-forked: tests/prefork.py), its output in `log` (a pipe nobody reads while
    it trains could fill)."""
    proc = start_python(cmd, log)
    proc.log = log
    return proc


def finish(proc: PreforkedProcess) -> str:
    proc.wait(timeout=300)
    return proc.log.read_text()


def wait_for_step(proc: PreforkedProcess, out: Path, step: int) -> None:
    deadline = time.monotonic() + 300
    while not any(r["step"] >= step for r in read_progress(out / "losses.jsonl")):
        assert proc.poll() is None, proc.log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no step {step} in time"
        time.sleep(0.05)


def workers(proc: PreforkedProcess) -> dict[int, psutil.Process]:
    """LOCAL_RANK -> worker process, below `proc` (the launcher or torchrun); not a worker's own child (its
    verifier, forked with the worker's environment)."""
    deadline = time.monotonic() + 60
    while True:
        found = {}
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                rank = p.environ().get("LOCAL_RANK")
                in_a_worker = "LOCAL_RANK" in p.parent().environ()
            except (psutil.Error, AttributeError):  # ended meanwhile (parent() None)
                continue
            if rank is not None and not in_a_worker and "torch.distributed.run" not in " ".join(p.cmdline()):
                found[int(rank)] = p
        if len(found) == 2 or time.monotonic() > deadline:
            return found
        time.sleep(0.1)
