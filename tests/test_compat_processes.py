"""The processes of examples/generate_compat_check.py: per-model time limits, signals and SIGKILL to a sharded check
(nothing it started outlives it), and several writers of one results file or one --out_dir at the same time.

The check runs as a subprocess, eager (--no_compile); the tests read its rows and watch its processes.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from compat_check import processes, rows
from tools import prepare_assets as assets
from conftest import ROOT, example_command, kill_tree, read_results, run_example, script_env, start_python

SCRIPT = "generate_compat_check.py"


@pytest.fixture(scope="module")
def model_assets(prepared_assets):
    return assets.prepare(["tiny_qwen3", "tiny_qwen3_moe"])


def _only_file(out: Path) -> Path:
    files = sorted(out.glob("*.parquet"))
    assert len(files) == 1, files
    return files[0]


# --------------------------------------------------------------------------- time limits
def test_timeout_gives_an_error_row_and_the_next_model_runs(tmp_path, model_assets):
    """Past --timeout_s every process of the model's run is killed and its row is a FAIL that says so; the next
    model still runs. A run cut short is not audited, --compile_audit or not (nor is one that crashes: the same
    path)."""
    out = tmp_path / "out"
    proc = run_example(SCRIPT, "--models", "tiny-qwen3,tiny-qwen3-moe", "--cores", "2", "--timeout_s", "1",
                       "--no_compile", "--compile_audit", "--out_dir", str(out))
    by_id = {r["model_id"]: r for r in pd.read_parquet(_only_file(out)).to_dict("records")}
    for model_id in ("tiny-qwen3", "tiny-qwen3-moe"):  # the second ran (and timed out) after the first
        assert by_id[model_id]["result"] == "FAIL" and "timed out after 1 s" in by_id[model_id]["error"]
        assert pd.isna(by_id[model_id]["compile_graphs"]) and pd.isna(by_id[model_id]["compile_audit"])
    assert proc.stdout.count("[model]") == 2


def test_timeout_kills_the_whole_process_tree(tmp_path):
    """What --task train relies on: past the limit the subprocess and its own children (train_hf_backend.py's
    verification subprocess) are killed; nothing outlives the command."""
    import psutil

    grandchild = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(grandchild)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    with pytest.raises(processes.subprocess.TimeoutExpired):
        processes.run_limited([sys.executable, "-c", code], timeout_s=3)
    pid = int(grandchild.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


# --------------------------------------------------------------------------- writers at the same time
# Writes rows.write_row N times into one file, from a process of its own (two of them race in the test below).
_WRITER = """
import sys
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/examples"]
from compat_check import rows
for i in range(int(sys.argv[4])):
    rows.write_row(Path(sys.argv[2]), {"model_id": f"{sys.argv[3]}-{i}", "result": "PASS", "run_py": "#" * 20_000})
"""


def test_two_writers_of_one_results_file_lose_no_row(tmp_path):
    """Two processes adding rows to one Parquet file at the same time (two checks into one --out_dir): every row of
    both is there, and neither crashes on a file the other is replacing."""
    path = tmp_path / "r.parquet"
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(ROOT), str(path), name, "50"], cwd=ROOT,
                                env=script_env(), stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    errors = [w.communicate(timeout=600)[1] for w in writers]
    assert [w.returncode for w in writers] == [0, 0], errors
    ids = list(pq.read_table(path, columns=["model_id"]).column("model_id").to_pylist())
    assert sorted(ids) == sorted(f"{name}-{i}" for name in "ab" for i in range(50)), len(ids)


def _text_only_folders(folder: Path, prefix: str, n: int) -> list[str]:
    """Folders whose config.json names a text model: `--task image-text-to-text` gives each an EXCLUDED row at once,
    nothing loaded (the cheapest model to check)."""
    specs = []
    for i in range(n):
        (folder / f"{prefix}{i}").mkdir(parents=True)
        (folder / f"{prefix}{i}" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
        specs.append(str(folder / f"{prefix}{i}"))
    return specs


@pytest.mark.extended
def test_concurrent_checks_into_one_out_dir_keep_every_row_and_model(tmp_path):
    """Two checks at once into one --out_dir: the Parquet file holds both runs' rows, results.json lists both runs'
    models (each merged in under its lock)."""
    out = tmp_path / "out"
    runs = {p: _text_only_folders(tmp_path / "models", p, 12) for p in ("a", "b")}
    procs = [start_python(example_command(SCRIPT, "--task", "image-text-to-text", "--models", ",".join(specs),
                                          "--out_dir", str(out)), tmp_path / f"log_{name}")
             for name, specs in runs.items()]
    codes = [p.wait(timeout=600) for p in procs]
    assert codes == [0, 0], [(tmp_path / f"log_{name}").read_text()[-3000:] for name in runs]
    everything = sorted(runs["a"] + runs["b"])
    df = rows.read_table(_only_file(out))
    assert sorted(df["model_id"]) == everything and set(df["result"]) == {"EXCLUDED"}
    assert sorted(m["model_id"] for m in read_results(out)["models"]) == everything


@pytest.mark.extended
def test_ranks_forked_after_the_checks_own_threads_ran_still_finish(tmp_path, model_assets):
    """On the CPU the ranks are forked from the check. After a sharded model the check has judged its text with
    two OpenMP threads of its own; the next model's forked rank must still run (on one thread: a parallel region
    there would wait forever for the check's pool) and pass, not time out into a FAIL row. The sharded model is the
    tiny Qwen3-MoE: a --core_memory_gib between its weights (0.03669 GiB) and the tiny Qwen3's (0.03650 GiB) puts
    it on 2 cores (tensor parallel, judged in the check) and the tiny Qwen3 after it on one forked rank."""
    out = tmp_path / "out"
    proc = subprocess.run(example_command(SCRIPT, "--models", "tiny-qwen3-moe,tiny-qwen3", "--core_memory_gib",
                                          "0.0366", "--new_tokens", "4", "--no_compile", "--timeout_s", "120",
                                          "--out_dir", str(out)),
                          cwd=ROOT, env=dict(script_env(), OMP_NUM_THREADS="2"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_id = {r["model_id"]: r for r in pd.read_parquet(_only_file(out)).to_dict("records")}
    sharded = by_id["tiny-qwen3-moe"]
    assert (sharded["tp"], sharded["runner"]) == (2, "tp") and json.loads(sharded["judge"])["perplexity"] > 0
    assert pd.isna(sharded["error"]) or not sharded["error"], sharded["error"]  # judged, not timed out
    assert by_id["tiny-qwen3"]["tp"] == 1 and by_id["tiny-qwen3"]["result"] == "PASS", by_id["tiny-qwen3"]["error"]


# --------------------------------------------------------------------------- signals to a sharded check
def _family_once_sharded(proc, deadline: float) -> list:
    """Every process below the check, once both ranks of its sharded run are at work: each holds a TCP connection
    (its process group, made inside the rank's function, after its first line). On the CPU the ranks are forked from
    the check (its command line), not spawned."""
    import psutil

    while True:
        assert proc.poll() is None, f"the check ended (exit {proc.returncode}) before its ranks started"
        assert time.monotonic() < deadline, "the ranks did not start in time"
        try:
            family = psutil.Process(proc.pid).children(recursive=True)
            ranks = [p for p in family if p.net_connections("tcp")]
            forked = all(p.cmdline() == psutil.Process(proc.pid).cmdline() for p in ranks)
        except psutil.Error:
            family, ranks = [], []
        if len(ranks) >= 2:
            assert forked, [p.cmdline() for p in ranks]
            return family
        time.sleep(0.1)


def _alive(procs: list) -> list:
    import psutil

    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(procs: list, timeout: float = 60) -> list:
    deadline = time.monotonic() + timeout
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(procs)


# The cheapest sharded check: the tiny Qwen3 over 2 gloo processes, eager, generating long enough (4096 tokens,
# about 100 s) that its ranks are busy whenever the signal comes.
SHARDED = ("--models", "tiny-qwen3", "--cores", "2", "--no_compile", "--new_tokens", "4096")


def test_sigterm_ends_every_process_of_a_sharded_check(tmp_path, model_assets):
    """SIGTERM to the check alone: its ranks and every other process below it (a resource tracker) end with it,
    one `error:` line, exit 143, and no row (an interrupted run is no verdict). SIGHUP and SIGINT take the same
    path (processes.stop_on_signals), with exit 129 and 130."""
    sig = signal.SIGTERM
    out = tmp_path / "out"
    proc = start_python(example_command(SCRIPT, *SHARDED, "--out_dir", str(out)), tmp_path / "log")  # its own group
    family = []
    try:
        family = _family_once_sharded(proc, time.monotonic() + 300)
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        kill_tree(proc)
    left = _wait_gone(family)
    for p in left:  # before the fix: the orphaned ranks, no longer below the check
        p.kill()
    err = (tmp_path / "log").read_text()
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert [line.split(":")[:2] for line in err.splitlines() if line.startswith("error:")] == [
        ["error", f" interrupted by {signal.Signals(sig).name}"]], err[-3000:]
    assert not left, [p.cmdline() for p in left]
    assert not list(out.glob("*.parquet"))


def test_ranks_die_with_a_sigkilled_check(tmp_path, model_assets):
    """SIGKILL to the check alone (no handler can run): its ranks die with it (PR_SET_PDEATHSIG), and with them any
    resource tracker, instead of generating on for a minute and more."""
    proc = start_python(example_command(SCRIPT, *SHARDED, "--out_dir", str(tmp_path / "out")), tmp_path / "log")
    family = []
    try:
        family = _family_once_sharded(proc, time.monotonic() + 300)
        proc.kill()
        proc.wait(timeout=60)
        left = _wait_gone(family)
        assert not left, [p.cmdline() for p in left]
    finally:
        kill_tree(proc)
        for p in _alive(family):  # before the fix: the orphaned ranks, no longer below the check
            p.kill()
