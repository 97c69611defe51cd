"""Every rank's output of the scripts' own launch is kept under OUT_DIR/logs, and a rank that fails alone is named on
the console with its error: torchrun's --local-ranks-filter alone sends the other ranks' output to /dev/null."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from common.harness import launcher
from conftest import ROOT, run_python, script_env


def test_a_self_launched_run_keeps_each_ranks_output_in_its_folder(shared_run):
    out, results = shared_run("native_2_ranks_8_steps")
    launch = out / results["rank_logs"]
    assert launch.parent == out / "logs" / "node0", results["rank_logs"]
    (rank1,) = launch.glob("attempt_*/1")
    assert "Building device mesh" in (rank1 / "stdout.log").read_text()  # torchtitan's lines of rank 1, not /dev/null
    assert not list(launch.glob("attempt_*/0/std*.log"))  # local rank 0 prints on the console, as it was


def test_the_flags_leave_rank_0_on_the_console_and_put_the_others_in_files(tmp_path):
    assert launcher.rank_log_flags(1, tmp_path) == ["--local-ranks-filter=0", f"--log-dir={tmp_path}"]
    assert launcher.rank_log_flags(4, tmp_path)[-1] == "--redirects=1:3,2:3,3:3"


def test_a_rank_that_fails_alone_is_named_with_its_error_and_its_output_kept(tmp_path):
    out = tmp_path / "out"
    env = dict(script_env(), FAIL_RANK="1")
    proc = run_python([sys.executable, str(ROOT / "tests" / "failing_rank_native.py"), "--nproc_per_node", "2",
                       "--steps", "2", "--no-export", "--out_dir", str(out)], env=env, timeout=300)
    assert proc.returncode != 0
    named = [line for line in proc.stderr.splitlines() if line.startswith("[launch] local rank 1 failed")]
    assert len(named) == 1 and "rank 1 cannot reach its device" in named[0], proc.stderr[-3000:]
    stderr = Path(named[0].rsplit("(its whole output: ", 1)[1].rstrip(")"))
    assert stderr.is_relative_to(out / "logs" / "node0") and "rank 1 cannot reach its device" in stderr.read_text()
    error = json.loads((stderr.parent / "error.json").read_text())  # torch.distributed.elastic's record
    assert "rank 1 cannot reach its device" in error["message"]["message"]
