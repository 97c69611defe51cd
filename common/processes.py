"""Processes a script starts: they die with it (`die_with_parent`), and a fork is made only where it is safe
(`fork_is_safe`). The compatibility check's ranks, the harness's forked children (the export verifier, the dry
run's plan) and the core's export check process (`python -m common.export`) use them.
"""
from __future__ import annotations

import os
import signal
import sys


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None):
    """A function that makes the process calling it get `sig` when its parent dies (Linux: prctl PR_SET_PDEATHSIG),
    however the parent ends (kill -9 included), and `sig` at once if the parent (`parent_pid`; by default the
    process that calls die_with_parent) is already gone. Pass it as Popen's preexec_fn, or call it first thing in a
    worker with its parent's pid. prctl is looked up here, before any fork: the child only calls it. Elsewhere only
    the parent check."""
    parent = os.getpid() if parent_pid is None else parent_pid
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            pass

    def arm() -> None:
        if prctl is not None:
            prctl(ctypes.c_int(1), ctypes.c_ulong(int(sig)), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return arm


def fork_is_safe() -> bool:
    """Whether this process may fork a child that runs on in Python: it has no other Python thread (one holding a
    lock would leave it held in the child forever) and no process group. tqdm's monitor thread, which progress bars
    start (`datasets` reading a folder among them) and which only redraws a stalled bar, is ended first and not
    started again. The child still must not use the parent's OpenMP pool: one torch thread, before any op."""
    import threading

    import torch.distributed as dist

    if "tqdm.std" in sys.modules:
        sys.modules["tqdm.std"].tqdm.monitor_interval = 0
        for thread in threading.enumerate():
            if isinstance(thread, sys.modules["tqdm._monitor"].TMonitor):
                thread.exit()
    return threading.active_count() == 1 and not (dist.is_available() and dist.is_initialized())
