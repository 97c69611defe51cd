"""Launching a training run on this host: the world size it will have, whether the batch splits over it,
and the self-launch under torchrun (`--nproc_per_node N` without torchrun) with its checks of cores and memory.
"""
from __future__ import annotations

import os
import signal
import sys

from common.device import GIB
from common.errors import UserError


def under_launcher() -> bool:
    """Inside torchrun (or any launcher that set the rank variables)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def planned_world_size(nproc_per_node: int) -> int:
    """The world size this run will have: the launcher's, or --nproc_per_node for a self-launch."""
    return int(os.environ.get("WORLD_SIZE", "1")) if under_launcher() else nproc_per_node


def check_batch_split(global_batch: int, local_batch: int, world_size: int) -> None:
    """The global batch (-1: local x ranks) must split into local batches on every rank (torchtitan adds
    gradient accumulation for the rest)."""
    if global_batch > 0 and global_batch % (local_batch * world_size):
        raise UserError(f"global batch {global_batch} is not a multiple of local batch {local_batch} x "
                        f"{world_size} ranks")


PROCESS_GIB = 1.5  # one tiny-preset training process on CPU: torchtitan logs about 1.4 GiB resident at step 1


def check_nproc(nproc_per_node: int, device_type: str, oversubscribe: bool = False) -> None:
    """Before a self-launch: no more processes than the host has cores (CPU) or GPUs, and memory for their
    start-up, unless `oversubscribe`."""
    if nproc_per_node <= 1 or oversubscribe:
        return
    import psutil
    import torch

    have = {"cpu": os.cpu_count() or 1, "cuda": torch.cuda.device_count() if device_type == "cuda" else 0}
    free = psutil.virtual_memory().available / GIB
    if device_type in have and nproc_per_node > have[device_type]:
        raise UserError(f"--nproc_per_node {nproc_per_node} starts more processes than this host has "
                        f"{'cores' if device_type == 'cpu' else 'GPUs'} ({have[device_type]}); pass --oversubscribe "
                        "to start them anyway")
    if nproc_per_node * PROCESS_GIB > free:
        raise UserError(f"--nproc_per_node {nproc_per_node} needs about {nproc_per_node * PROCESS_GIB:.0f} GiB to start "
                        f"and {free:.1f} GiB are free; pass --oversubscribe to start them anyway")


def self_launch(nproc_per_node: int, argv: list[str]) -> int:
    """Re-run this script under torchrun with `nproc_per_node` workers on this host; returns its exit code.
    torchrun runs in a process group of its own, each worker in a session of its own: SIGINT, SIGTERM or SIGHUP sent
    to this process alone (a scheduler's kill, `kill -INT PID`) stops every one of them, so nothing outlives it."""
    import subprocess
    import threading

    rest, skip = [], False
    for arg in argv:  # drop our own --nproc_per_node (both `--flag N` and `--flag=N`)
        if skip:
            skip = False
        elif arg == "--nproc_per_node":
            skip = True
        elif not arg.startswith("--nproc_per_node="):
            rest.append(arg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc_per_node}", "--local-ranks-filter=0", *rest]
    proc = subprocess.Popen(cmd, start_new_session=True)
    stopped = []

    def stop(signum, _frame):  # only signals here: the main thread's wait() below sees the exit
        stopped.append(signum)
        for sig, delay in ((signal.SIGTERM, 0), (signal.SIGKILL, 30)):  # torchrun stops its workers on SIGTERM
            timer = threading.Timer(delay, _killpg, (proc.pid, sig))
            timer.daemon = True  # never keeps this process alive once the workers are gone
            timer.start()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    code = proc.wait()
    if stopped:
        raise KeyboardInterrupt  # run_cli: one `error: interrupted` line, exit 130
    return code


def _killpg(pid: int, sig: int) -> None:
    """`sig` to torchrun's process group; a SIGKILL also to its workers: torchrun starts each worker in a session
    of its own and passes SIGTERM on to them, but it cannot pass on its own SIGKILL."""
    import psutil

    try:
        workers = psutil.Process(pid).children(recursive=True) if sig == signal.SIGKILL else []
    except psutil.NoSuchProcess:
        workers = []
    for worker in workers:
        try:
            worker.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
