"""Each example runs from a copy of itself and the files its header lists, in the same layout, outside this
repository and with nothing of it on the path: what the header lists is all a user copies. This catches what
the header check of test_layout.py cannot see: a file read or a script run beside the repository at run time."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, read_results, run_python, script_env
from test_layout import header_files

# The shortest run of each example that still reaches its run-time paths: the HF export and its check in a
# fresh process (native), the load check of an HF start (hf), the override registry's import strings (moe),
# the compatibility check's helper folder and Parquet rows (compat).
RUNS = {
    "train_native_qwen3.py": ["--steps", "2"],
    "train_hf_backend.py": ["--steps", "1", "--no-export"],
    "train_moe_nki.py": ["--steps", "1", "--no-export"],
    "rope_parity.py": [],
    "generate_compat_check.py": ["--models", "tiny-qwen3", "--no_compile"],
}


def test_every_example_is_run_from_a_copy():
    assert sorted(RUNS) == sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def copy_example(name: str, dest):
    for f in [ROOT / "examples" / name, *header_files(ROOT / "examples" / name)]:
        target = dest / f.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)
    return dest / "examples" / name


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_runs_from_a_copy(name, tmp_path, prepared_assets):
    script = copy_example(name, tmp_path / "project")
    out_dir = tmp_path / "run"
    cmd = [sys.executable, str(script), *RUNS[name], "--out_dir", str(out_dir)]
    if "PYTHONPATH" in os.environ:  # the pre-forked runner's path would hold it: a process of its own without it
        env = {k: v for k, v in script_env().items() if k != "PYTHONPATH"}
        proc = subprocess.run(cmd, cwd=tmp_path / "project", env=env, capture_output=True, text=True, timeout=600)
    else:  # the pre-forked runner: none of this repository imported, the script's own folder first on the path
        proc = run_python(cmd, cwd=tmp_path / "project")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    results = read_results(out_dir)
    if name == "train_native_qwen3.py":
        assert results["export_check"]["passed"]
    elif name == "train_hf_backend.py":
        assert results["load_check"]["passed"]
    elif name == "train_moe_nki.py":
        assert results["replacements"]
    elif name == "rope_parity.py":
        assert results["passed"]
    else:
        assert [m["result"] for m in results["models"]] == ["PASS"]
