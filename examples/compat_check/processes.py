"""A process that runs with a time limit and leaves nothing behind: past the limit, or if the caller
fails, the process and everything it started (a verification subprocess, compile workers) are killed.

The whole tree is found by walking the children (psutil, installed with accelerate), not by process
group: children stay in the caller's process group, so that a Ctrl-C or a kill of the caller's
group still reaches them too."""
from __future__ import annotations

import subprocess


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and all its descendants. Everything is stopped first, so that no process can start
    a new child between the listing and the kill, and children are listed before their parent dies
    (an orphan is re-parented and could no longer be found)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
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
    psutil.wait_procs(procs[1:], timeout=10)  # the root is left for its parent to reap (Popen, multiprocessing)


def run_limited(cmd: list[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) whose timeout kills the whole tree
    (raises subprocess.TimeoutExpired after that)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as proc:
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
    (rank, "ok", report) or (rank, "error", text) on `results`. Returns rank 0's report, with the peak
    memory of the busiest rank and the first rank's non-finite finding."""
    import queue
    import time

    import torch.multiprocessing as mp

    from common import device

    ctx = mp.get_context("spawn")  # Neuron: the runtime must not be forked; CUDA neither
    results = ctx.Queue()
    job = dict(job, port=device._free_port())
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
            if p.is_alive():
                kill_tree(p.pid)
            p.join()
    first = reports[0]
    first["peak_bytes"] = max(r["peak_bytes"] for r in reports.values())
    first["nonfinite"] = next((r["nonfinite"] for r in reports.values() if r["nonfinite"]), None)
    return first
