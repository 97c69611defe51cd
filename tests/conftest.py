"""Shared helpers: run an example as a subprocess (the real CLI) and read its results.json."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))  # the examples' own helper packages (compat_check, hf_backend)


def script_env() -> dict:
    # One torch thread per script process (as torchrun gives each worker): two test workers share the 2 cores
    # of CI, and a second thread per process only waits for a busy core.
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    return env


def example_command(script: str, *args: str, torchrun: int = 0) -> list[str]:
    """The command line of an example: plain python, or torchrun with `torchrun` processes."""
    path = str(ROOT / "examples" / script)
    if torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}",
                path, *args]
    return [sys.executable, path, *args]


def run_example(script: str, *args: str, torchrun: int = 0, timeout: int = 600,
                check: bool = True) -> subprocess.CompletedProcess:
    cmd = example_command(script, *args, torchrun=torchrun)
    proc = subprocess.run(cmd, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def kill_when(script: str, *args: str, ready: Callable[[], bool], what: str, torchrun: int = 0,
              timeout: float = 400) -> None:
    """Run an example and SIGKILL it, every process of it, as soon as `ready()` holds; fail if it
    ends first or `what` does not happen within `timeout` seconds."""
    proc = subprocess.Popen(example_command(script, *args, torchrun=torchrun), cwd=ROOT, env=script_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # apart from pytest: a stray signal stays with the run
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert proc.poll() is None, f"run ended (exit {proc.returncode}) before {what}"
            assert time.monotonic() < deadline, f"no {what} in time"
            time.sleep(0.1)
    finally:
        kill_tree(proc)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and every process below it, and wait until they are gone. A signal to the process group
    is not enough: torchrun starts each worker in a session of its own, so its workers would outlive it and
    finish the run. Each process is stopped before the kill, so none starts another between listing and kill."""
    procs: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(proc.pid)
        while new := [p for p in (root, *root.children(recursive=True)) if p.pid not in procs]:
            for p in new:
                procs[p.pid] = p
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.suspend()
    for p in procs.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()
    _, alive = psutil.wait_procs([p for pid, p in procs.items() if pid != proc.pid], timeout=60)
    assert not alive, f"still running after SIGKILL: {alive}"


def kill_after_checkpoint(script: str, *args: str, out_dir: Path, step: int, torchrun: int = 0) -> None:
    """Run an example, SIGKILL it (every process of it) once torchtitan's checkpoint for `step` is
    complete (its .metadata is written last), and check that it died mid-run."""
    marker = Path(out_dir) / "checkpoint" / f"step-{step}" / ".metadata"
    kill_when(script, *args, "--out_dir", str(out_dir), ready=marker.exists, what=f"the step-{step} checkpoint",
              torchrun=torchrun)
    assert not (Path(out_dir) / "results.json").exists()  # it really died mid-run


def read_results(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "results.json").read_text())


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """A bad input ends in a non-zero exit and one readable message, never a traceback."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:") or ": error:" in line]
    assert len(errors) == 1, proc.stderr[-4000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.fixture(scope="session")
def prepared_assets():
    from tools import prepare_assets as assets

    return assets.prepare(["tokenizer", "corpus", "tiny_qwen3"])
