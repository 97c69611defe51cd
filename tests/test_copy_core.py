"""Each example from a copy of itself and the core alone (common/ without common/harness/), in a fresh folder with
nothing of this repository on the path: a training example trains (native: under torchrun, two processes) and
writes an HF export that re-reads as the trained model, and says in one line that the guards are off; rope_parity.py
checks the op; the compatibility check checks a model. The copy with the harness: tests/test_copy.py."""
from __future__ import annotations

import sys

import pytest

from conftest import read_results
from test_copy import CORE_RUNS, TRAINING, copy_example, run_copy

@pytest.mark.parametrize("name", sorted(CORE_RUNS))
def test_example_runs_from_a_copy_of_the_core_alone(name, tmp_path, prepared_assets):
    project = tmp_path / "project"
    script = copy_example(name, project, core_only=True)
    out_dir = tmp_path / "run"
    nproc, args = CORE_RUNS[name]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc else [sys.executable]
    proc = run_copy([*launch, str(script), *args, "--out_dir", str(out_dir)], project)
    results = read_results(out_dir)
    if name in TRAINING:
        guards_off = [ln for ln in proc.stdout.splitlines() if ln.startswith("[guards] off")]
        assert len(guards_off) == 1, proc.stdout[-3000:]
        assert "stopped" not in results and "timing" not in results  # no harness, none of its fields
        assert results["world_size"] == max(nproc, 1) and len(results["losses"]) == int(args[1])
        assert results["export_check"]["passed"], results["export_check"]
        assert results["export_check"]["max_abs_logit_diff"] <= results["export_check"]["tolerance"]
        assert (out_dir / "hf_export" / "config.json").is_file()
    elif name == "rope_parity.py":
        assert results["passed"]
    else:
        assert [m["result"] for m in results["models"]] == ["PASS"]
