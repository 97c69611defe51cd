"""Processes that leave nothing behind: a time-limited process whose whole tree is killed past the limit or if the
caller fails; children that die with their parent, however it ends (SIGKILL included: PR_SET_PDEATHSIG); and the
check's stop signals (SIGTERM, SIGHUP, SIGINT), which kill every child of the check and every process below it
before the check ends with one `error: interrupted by SIG...` line and exit code 128 + the signal's number.

The whole tree is found by walking the children (psutil, installed with accelerate), not by process
group: children stay in the caller's process group, so that a Ctrl-C or a kill of the caller's
group still reaches them too."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

# What ends the check early: `kill`, a batch system or a closed terminal (SIGTERM, SIGHUP), Ctrl-C (SIGINT).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def kill_tree(pid: int, include_root: bool = True) -> None:
    """SIGKILL `pid` and all its descendants (only the descendants with include_root=False: `pid` may be this
    process). Everything is stopped first, so that no process can start a new child between the listing and the
    kill, and children are listed before their parent dies (an orphan is re-parented and could no longer be
    found)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    if not include_root:
        procs = procs[1:]
    for p in procs:
        try:
            p.suspend()
        except psutil.Error:
            pass
    seen = {p.pid for p in procs}
    for p in list(procs):  # children started before the stop took effect
        try:
            procs += [c for c in p.children(recursive=True) if c.pid not in seen and not seen.add(c.pid)]
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    # This process's own children are left for their owner to reap (Popen, multiprocessing); the others are
    # waited for here.
    own = {os.getpid(), *(c.pid for c in psutil.Process().children())}
    psutil.wait_procs([p for p in procs if p.pid not in own], timeout=10)


class Interrupted(BaseException):
    """A stop signal reached the check (stop_on_signals). A BaseException, like KeyboardInterrupt: no
    `except Exception` turns it into a model's row, and every `finally` on the way out still runs."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def stop_on_signals() -> None:
    """SIGTERM, SIGHUP or SIGINT to this process: kill every process below it at once (workers, a training
    subprocess and whatever they started), then raise Interrupted in the main thread, so that the file being
    written is left whole (its temporary file removed) and the caller prints its line (exit_interrupted). A second
    signal meanwhile is ignored: the first one's clean-up goes on."""
    import psutil  # noqa: F401  imported now, not inside the handler (it may run in the middle of an import)

    caught = []

    def stop(signum, _frame):
        if caught:
            return
        caught.append(signum)
        kill_tree(os.getpid(), include_root=False)
        raise Interrupted(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


CHECK_STOPPED = "every process the check started was stopped; the rows already written stay, and a rerun skips them"


def exit_interrupted(e: Interrupted, what: str = CHECK_STOPPED):
    """The end of an interrupted check or subcommand: nothing below it left alive, one `error: interrupted by
    SIG...: <what>` line, exit 128 + the signal's number."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    kill_tree(os.getpid(), include_root=False)
    sys.stdout.flush()
    print(f"error: interrupted by {e.name}: {what}", file=sys.stderr, flush=True)
    os._exit(128 + e.signum)


def run_limited(cmd: list[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) whose timeout kills the whole tree
    (raises subprocess.TimeoutExpired after that). The subprocess dies with this process (die_with_parent)."""
    from common.processes import die_with_parent

    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=die_with_parent(), **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except BaseException:  # the time limit, Ctrl-C, anything: nothing it started may outlive us
            kill_tree(proc.pid)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_ranks(target, job: dict, cores: int, timeout_s: float) -> dict:
    """Spawn `cores` processes `target(rank, job, results)`, wait for every rank's report or the time limit,
    then kill whatever is left of every process and its children (compile workers). Each rank puts
    (rank, "ok", report) or (rank, "error", text) on `results`, and calls die_with_parent(job["parent_pid"])
    first. Returns rank 0's report, with the peak memory of the busiest rank and the first rank's non-finite
    finding."""
    import queue
    import time

    import torch.multiprocessing as mp

    from common import device, processes

    # Neuron: the runtime must not be forked; CUDA neither. On the CPU the ranks are forked where that is safe
    # (processes.fork_is_safe), each with the stack already imported; a forked rank computes on one thread (an OpenMP
    # pool this process has used is not in it).
    fork = job["device"] == "cpu" and processes.fork_is_safe()
    ctx = mp.get_context("fork" if fork else "spawn")
    results = ctx.Queue()
    job = dict(job, port=device._free_port(), parent_pid=os.getpid(), forked=fork)
    procs = [ctx.Process(target=target, args=(rank, job, results)) for rank in range(cores)]
    for p in procs:
        p.start()
    deadline, reports = time.monotonic() + timeout_s, {}
    try:
        while len(reports) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out after {timeout_s} s (load, compile and generate); "
                                   f"{len(reports)} of {len(procs)} ranks had finished")
            try:
                rank, status, payload = results.get(timeout=min(left, 2.0))
            except queue.Empty:
                dead = [(i, p.exitcode) for i, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and i not in reports]
                if dead:
                    time.sleep(1.0)  # a report written just before exiting may still be in the pipe
                    if results.empty():
                        raise RuntimeError(f"rank {dead[0][0]} died with exit code {dead[0][1]} without a report")
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank}: {payload}")
            reports[rank] = payload
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.pid is None:  # never started: a stop signal came while the ranks were being started
                continue
            if p.is_alive():
                kill_tree(p.pid)
            p.join()
    first = reports[0]
    first["peak_bytes"] = max(r["peak_bytes"] for r in reports.values())
    first["nonfinite"] = next((r["nonfinite"] for r in reports.values() if r["nonfinite"]), None)
    return first
