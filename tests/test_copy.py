"""Each example runs from a copy of itself and the files its header lists, in the same layout, outside this
repository and with nothing of it on the path: what the header lists is all a user copies. Two copies each:

- with the core alone (common/ without common/harness/; tests/test_copy_core.py): the example still does its job (a
  training example trains and writes an HF export that re-reads as the trained model) and says in one line that
  the guards are off;
- with the core and the harness: everything it does in this repository (a training run's stop-and-resume record
  and its pilot report in results.json).

This catches what the header check of test_layout.py cannot see: a file read or a script run beside the repository
at run time, or a core file that needs the harness."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, read_results, run_python, script_env
from test_layout import header_files

# The shortest run of each example that still reaches its run-time paths with the harness: the stop-and-resume
# record and the pilot report (every training example), the load check of an HF start (hf), the override registry's
# import strings (moe), the compatibility check's helper folder and Parquet rows (compat).
RUNS = {
    "train_native_qwen3.py": ["--steps", "1", "--no-export"],  # its export: tests/test_copy_core.py
    "train_hf_backend.py": ["--steps", "1", "--no-export"],
    "train_moe_nki.py": ["--steps", "1", "--no-export"],
    "rope_parity.py": ["--seq_len", "64", "--model_batch", "1"],  # its default shapes: tests/test_rope_parity.py
    "generate_compat_check.py": ["--models", "tiny-qwen3", "--no_compile"],
}
# With the core alone: each training example trains one step and exports (native under torchrun, 2 processes); the
# HF start's load check is the harness copy's (RUNS), here only the export's re-read.
CORE_RUNS = {
    "train_native_qwen3.py": (2, ["--steps", "1", "--seq_len", "64"]),
    "train_hf_backend.py": (0, ["--steps", "1", "--seq_len", "64", "--no-load_check"]),
    "train_moe_nki.py": (0, ["--steps", "1", "--seq_len", "64"]),
    "rope_parity.py": (0, ["--seq_len", "64", "--model_batch", "1"]),
    "generate_compat_check.py": (0, ["--models", "tiny-qwen3", "--no_compile"]),
}
TRAINING = ("train_native_qwen3.py", "train_hf_backend.py", "train_moe_nki.py")
# `make test` runs one copy per kind of run-time path: the MoE script with the harness (the override registry's
# import strings), the compatibility check with the harness (its helper folder) and the native script with the core
# alone under torchrun (a training run and its export without the harness). The other seven are `extended`
# (`make test-extended`): each is a fresh interpreter of some 10 CPU-seconds (docs/testing.md).
IN_THE_SUITE = {"harness": ("train_moe_nki.py", "generate_compat_check.py"), "core": ("train_native_qwen3.py",)}


def copies(runs: dict, kind: str) -> list:
    """The examples of `runs`, those not IN_THE_SUITE[kind] marked extended."""
    return [name if name in IN_THE_SUITE[kind] else pytest.param(name, marks=pytest.mark.extended)
            for name in sorted(runs)]


def test_every_example_is_run_from_a_copy():
    assert sorted(RUNS) == sorted(CORE_RUNS) == sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def copy_example(name: str, dest, core_only: bool = False):
    files = header_files(ROOT / "examples" / name, core_only=core_only)
    for f in [ROOT / "examples" / name, *files]:
        target = dest / f.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)
    assert not core_only or not (dest / "common" / "harness").exists()
    script = dest / "examples" / name
    if core_only and GUARDED_ENTRY in script.read_text():  # the one line the header says to change
        header = script.read_text().split('"""')[0]
        assert f"#   {CORE_ENTRY}" in header, f"{name}'s header does not say which entry line the core alone takes"
        script.write_text(script.read_text().replace(GUARDED_ENTRY, CORE_ENTRY, 1))
    return script


GUARDED_ENTRY = "from common.harness.lifecycle import run"  # a training example's entry: the guarded run
CORE_ENTRY = "from common.recipe import run_core as run"  # the core alone's, as the header says


def run_copy(cmd: list[str], project) -> subprocess.CompletedProcess:
    env = {k: v for k, v in script_env().items() if k != "PYTHONPATH"}  # the copy alone, not this repository
    proc = run_python(cmd, cwd=project, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.mark.parametrize("name", copies(RUNS, "harness"))
def test_example_runs_from_a_copy(name, tmp_path, prepared_assets):
    script = copy_example(name, tmp_path / "project")
    out_dir = tmp_path / "run"
    run_copy([sys.executable, str(script), *RUNS[name], "--out_dir", str(out_dir)], tmp_path / "project")
    results = read_results(out_dir)
    if name in TRAINING:  # the harness's fields: the stop-and-resume record, the pilot report
        assert results["stopped"] is None and results["resumed_from_step"] == 0
        assert (out_dir / "checkpoint" / "run.json").is_file()
        assert results["timing"]["first_step_s"] > 0 and "mfu" in results and results["memory"]["peak_gib"]
    if name == "train_hf_backend.py":
        assert results["load_check"]["passed"]
    elif name == "train_moe_nki.py":
        assert results["replacements"]
    elif name == "rope_parity.py":
        assert results["passed"]
    elif name == "generate_compat_check.py":
        assert [m["result"] for m in results["models"]] == ["PASS"]
