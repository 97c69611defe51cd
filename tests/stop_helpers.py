"""What the stop, resume and reshard tests share: commands started in the background with their output in a file,
waits on a training step, the workers below a launcher, the check that no process outlives a run, and the checks
that a resumed run trained as one that never stopped (its ranks' data traces, its starting state, its losses)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import subprocess

import psutil

from common.harness.checks import read_progress
from conftest import TWO_RANKS, start_python

SCRIPT = "train_native_qwen3.py"
STEPS = int(TWO_RANKS[TWO_RANKS.index("--steps") + 1])  # room for two stops, one after the other, and steps after them
ONE_RANK = ("--steps", "6", "--no-export")  # the tiny preset, seed 0
# float32 on CPU. Another world size changes the order of floating-point sums: the gradient norm is summed over
# shards and then over ranks instead of over whole tensors, AdamW's vectorised loops meet other tensor lengths, and
# the loss is summed over ranks instead of over micro-steps. Measured: both chains 0 to 1.9e-6 from the uninterrupted
# run (two float32 steps at loss 11.4). A batch trained twice or left out moves a step's loss by some 1e-2 (step 1's
# two batches on the same weights: losses 11.959 and 11.900).
LOSS_BOUND = 1e-4
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


def command_line(pid: int) -> str:
    """A process's command line; "" for one that ended meanwhile (a worker's short-lived child, a zombie)."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def lock_holders(path) -> list[tuple[int, int, str]]:
    """(pid, parent pid, command) of every process that has the file `path` open (a lock that stays held names them)."""
    found = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline"]):
        try:
            if any(f.path == str(path) for f in p.open_files()):
                found.append((p.info["pid"], p.info["ppid"], " ".join(p.info["cmdline"] or [])[:200]))
        except psutil.Error:
            continue
    return found


def take_lock_naming_holders(out) -> int:
    """The product's lock on the folder `out` taken as a rerun takes it (launcher.hold_out_dir); its descriptor, for
    the caller to close. Where it is refused, the test fails naming every process that still has the lock file open
    (its pid, parent and command line), after allowing 10 s for the last of them to end."""
    from common.errors import UserError
    from common import results
    from common.harness import launcher

    deadline, lock = time.monotonic() + 10, (Path(out) / results.LOCK).resolve()
    while True:
        try:
            launcher.hold_out_dir(out)
            return results.HELD_LOCKS.pop()
        except UserError as e:
            if time.monotonic() > deadline:
                raise AssertionError(f"{e}; processes with the lock file open: {lock_holders(lock)}") from None
        time.sleep(0.2)


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """The command in the background (a process group of its own), its output in `log` (a pipe nobody reads while
    it trains could fill)."""
    proc = start_python(cmd, log)
    proc.log = log
    return proc


def finish(proc: subprocess.Popen) -> str:
    proc.wait(timeout=300)
    return proc.log.read_text()


def wait_for_step(proc: subprocess.Popen, out: Path, step: int) -> None:
    deadline = time.monotonic() + 300
    while not any(r["step"] >= step for r in read_progress(out / "losses.jsonl")):
        assert proc.poll() is None, proc.log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no step {step} in time"
        time.sleep(0.05)


def workers(proc: subprocess.Popen, count: int = 2) -> dict[int, psutil.Process]:
    """LOCAL_RANK -> worker process, below `proc` (the launcher or torchrun), once `count` are there (or a minute
    has passed); not a worker's own child (forked with the worker's environment)."""
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
        if len(found) == count or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def trace(folder) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob("data-*.jsonl")) for line in f.read_text().splitlines()]


def by_batch(lines: list[dict]) -> dict:
    """(step, shard, batch of the step) -> its rows' hashes, each key once. The tensor-parallel peers of a
    data-parallel rank train its batches together: their lines, the same but for the process, count once (a peer
    that read other rows is a batch trained twice). Each shard's documents read never go back (a loader that
    started its shard anew would). A resumed loader reads one document ahead of an uninterrupted one (torchtitan's
    reads the next document before it empties its token buffer: the same tokens come out), so the counts themselves
    are not compared."""
    out, read = {}, {}
    once = {json.dumps({k: v for k, v in line.items() if k != "process"}, sort_keys=True): line for line in lines}
    for line in sorted(once.values(), key=lambda x: (x["step"], x["shard"], x["batch"])):
        key = (line["step"], line["shard"], line["batch"])
        assert key not in out, f"step {key[0]}'s batch {key[2]} of shard {key[1]} trained twice"
        out[key] = line["rows"]
        assert line["documents_read"] >= read.get(line["shard"], 0), line
        read[line["shard"]] = line["documents_read"]
    return out


def same_state(out, step: int, dump, tmp_path) -> None:
    """The state a resumed run started from (its debug dump, gathered from its ranks) is the DCP checkpoint's."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = tmp_path / f"step-{step}.pt"
    dcp_to_torch_save(out / "checkpoint" / f"step-{step}", whole)  # DCP's own reader, unsharded
    saved = {}
    for k, v in torch.load(whole, weights_only=False).items():
        if k in ("optimizer", "lr_scheduler", "train_state"):
            saved.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        elif k != "dataloader":
            saved[f"model.{k}"] = v
    resumed = torch.load(dump, weights_only=False)
    assert set(resumed) == set(saved), sorted(set(resumed) ^ set(saved))[:10]
    for k, v in saved.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == resumed[k].dtype and torch.equal(v, resumed[k]), k
        else:
            assert v == resumed[k], (k, v, resumed[k])
    assert saved["train_state.step"] == step and any(k.startswith("optimizer.state.") for k in saved)
