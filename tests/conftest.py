"""Shared helpers: run an example as a subprocess (the real CLI) and read its results.json."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def script_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    return env


def run_example(script: str, *args: str, torchrun: int = 0, timeout: int = 600,
                check: bool = True) -> subprocess.CompletedProcess:
    path = str(ROOT / "examples" / script)
    cmd = [sys.executable, path, *args]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={torchrun}", path, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


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
    from common import assets

    return assets.prepare(["tokenizer", "corpus", "tiny_qwen3"])
