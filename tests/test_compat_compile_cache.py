"""examples/generate_compat_check.py --compile_cache URL: the check pulls this compiler's graphs from the shared store
before the first model, pushes this host's compiled graphs after each compiled row (the check itself, one process),
and the row records the store's URL (`compile_cache_url`), from which the lookup prints the pull command; eager rows
record none, a push that fails is a warning and the row stands, a store this host cannot reach is one `error:` line
before any model.

The check runs as its own `__main__` in this process (run_in_process) on the tiny Qwen3 and Qwen3-MoE; only its
per-model run (compat_check/processes.run_ranks: the ranks that load, compile and generate, minutes of inductor on
CPU) is replaced by one that writes real files into inductor's cache folder, as a compile does, and reports what the
ranks report. In the extended tier, the check runs as a process with nothing replaced, on two "hosts" that share one
store. The copy itself (SharedCache): tests/test_compile_cache.py.
"""
from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest

from common.harness import compile_cache
from compat_check import lookup, processes, rows
from tools import prepare_assets as assets
from conftest import run_example, run_in_process

SCRIPT = "generate_compat_check.py"
QUICK = ("--no-judge_single_core",)  # the judge (SmolLM2) is not what these tests are about
KEY = compile_cache.cache_key("cpu")
ELSEWHERE = {"fxgraph/zz/compiled-on-another-host": b"graph of another host"}  # in the store before the check


@pytest.fixture(scope="module")
def model_assets(prepared_assets):
    return assets.prepare(["tiny_qwen3", "tiny_qwen3_moe"])


@pytest.fixture
def host(tmp_path, monkeypatch):
    """(this host's inductor cache, the shared store's folder holding one entry of this key, the run stand-in's
    calls): the check's per-model run replaced by one that compiles (writes a graph file into the cache) where the
    job compiles and the model is not a MoE (the tiny MoE as a model without static-cache support: eager)."""
    local, store = tmp_path / "inductor", tmp_path / "shared-store"
    for rel, data in ELSEWHERE.items():
        (store / KEY / rel).parent.mkdir(parents=True, exist_ok=True)
        (store / KEY / rel).write_bytes(data)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(local))
    calls = []

    def run_ranks(worker, job, cores, timeout_s):
        compiled = job["compile"] and "moe" not in Path(job["folder"]).name
        calls.append({"folder": job["folder"], "compiled": compiled,
                      "pulled": (local / next(iter(ELSEWHERE))).is_file()})
        if compiled:  # what inductor leaves: generated code and its FX graph, beside a lock (never an entry)
            name = Path(job["folder"]).name
            for rel in (f"fxgraph/{name}/graph", f"{name[:2]}/c{name}.py", f"locks/c{name}.lock"):
                (local / rel).parent.mkdir(parents=True, exist_ok=True)
                (local / rel).write_text(f"compiled {name}")
        return {"tokens": [1, 2, 3], "cpu_tokens": [1, 2, 3], "text": "the sea", "wall_s": 1.0, "static": compiled,
                "compile_s": 0.5 if compiled else 0.0, "compiled": compiled, "nonfinite": None, "peak_bytes": 2**20,
                "compile_cache": f"TORCHINDUCTOR_CACHE_DIR={local}" if compiled else None,
                "timings": {"load_s": 0.1, "generate_s": 0.9, "reference_s": 0.1}}

    monkeypatch.setattr(processes, "run_ranks", run_ranks)
    return local, store, calls


def _rows(out: Path) -> dict:
    (path,) = sorted(out.glob("*.parquet"))
    return {r["model_id"]: r for r in rows.read_table(path).to_dict("records")}


def test_compiled_rows_push_their_graphs_and_the_lookup_prints_the_pull_command(tmp_path, model_assets, host,
                                                                                capsys):
    local, store, calls = host
    out, url = tmp_path / "out", store.as_uri()
    proc = run_in_process(SCRIPT, "--models", "tiny-qwen3,tiny-qwen3-moe", "--compile_cache", url,
                          "--out_dir", str(out), *QUICK)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [(Path(c["folder"]).name, c["compiled"], c["pulled"]) for c in calls] == [
        ("tiny-qwen3", True, True), ("tiny-qwen3-moe", False, True)]  # pulled before the first model
    assert f"[compile cache] 1 entries pulled from {url} ({KEY}) into {local}" in proc.stdout
    pushed = {p.relative_to(store / KEY).as_posix() for p in (store / KEY).rglob("*") if p.is_file()}
    assert pushed == {*ELSEWHERE, "fxgraph/tiny-qwen3/graph", "ti/ctiny-qwen3.py"}  # under the key, no lock file
    by_id = _rows(out)
    compiled, eager = by_id["tiny-qwen3"], by_id["tiny-qwen3-moe"]
    assert compiled["result"] == "PASS" and compiled["compile_cache_url"] == url
    assert f"2 new compile cache entries pushed to {url} ({KEY})" in compiled["notes"]
    assert eager["result"] == "PASS" and eager["compile_cache_url"] is None  # eager: nothing to push
    assert "--compile_cache" not in compiled["run_args"] and "[compile cache]" not in proc.stderr  # no warning
    capsys.readouterr()
    assert lookup.lookup_main([str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    command = f"python -m tools.compile_cache pull {shlex.quote(url)} --device cpu --key {KEY}"
    assert f"[1] {command}  (1 row(s))" in lines and "no shared compile cache recorded: 1 of 2 row(s)" in lines
    assert shlex.split(command)[4] == url


def test_a_failed_push_is_a_warning_and_eager_rows_record_no_url(tmp_path, model_assets, host, monkeypatch):
    """The store gone after the check started (a file where its folder was): the row stands, with no URL, and one
    warning line says why. With --no_compile nothing is pulled or pushed."""
    local, store, calls = host
    out = tmp_path / "out"
    real = processes.run_ranks

    def then_break_the_store(*args):
        shutil.rmtree(store)
        store.write_text("not a folder")
        return real(*args)

    monkeypatch.setattr(processes, "run_ranks", then_break_the_store)
    proc = run_in_process(SCRIPT, "--models", "tiny-qwen3", "--compile_cache", str(store), "--out_dir", str(out),
                          *QUICK)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = _rows(out)["tiny-qwen3"]
    assert row["result"] == "PASS" and row["compile_cache_url"] is None and "pushed" not in row["notes"]
    (warning,) = [line for line in proc.stderr.splitlines() if "[compile cache]" in line]
    assert warning.startswith("[compile cache] warning: tiny-qwen3: the push failed, its row records no shared "
                              f"compile cache: shared compile cache {store}: cannot "), warning

    monkeypatch.setattr(processes, "run_ranks", real)
    store.unlink()
    store.mkdir()
    eager_out = tmp_path / "eager"
    proc = run_in_process(SCRIPT, "--models", "tiny-qwen3", "--no_compile", "--compile_cache", str(store),
                          "--out_dir", str(eager_out), *QUICK)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[compile cache] unused with --no_compile: nothing is pulled or pushed" in proc.stdout
    assert "entries pulled" not in proc.stdout and not calls[-1]["compiled"]
    assert _rows(eager_out)["tiny-qwen3"]["compile_cache_url"] is None and not any(store.iterdir())


def test_a_store_this_host_cannot_reach_is_one_error_line_before_any_model(tmp_path, model_assets, host):
    """And a URL's user name and password are never printed or stored (the [config] line, results.json)."""
    _, store, calls = host
    out = tmp_path / "out"
    proc = run_in_process(SCRIPT, "--models", "tiny-qwen3", "--compile_cache", str(store / "missing"),
                          "--out_dir", str(out), *QUICK)
    assert proc.returncode == 2 and calls == [] and not list(out.glob("*.parquet"))
    assert proc.stderr.splitlines() == [f"error: shared compile cache {store / 'missing'}: no such folder; create "
                                        "the folder (mkdir -p) or mount the shared file system there"]
    secret = f"memory://someone:s3cret@cc-{tmp_path.name}"  # fsspec's in-memory store: reachable, never a folder
    proc = run_in_process(SCRIPT, "--models", "tiny-qwen3", "--no_compile", "--compile_cache", secret,
                          "--out_dir", str(out), *QUICK)
    assert proc.returncode == 0 and len(calls) == 1, proc.stderr[-3000:]
    assert f"compile_cache=memory://cc-{tmp_path.name}" in proc.stdout
    assert "s3cret" not in proc.stdout + proc.stderr + (out / "results.json").read_text()


@pytest.mark.extended
def test_a_real_compiled_row_pushes_its_graphs_and_a_second_host_pulls_every_one(tmp_path, model_assets, monkeypatch,
                                                                                 capsys):
    """End to end, nothing replaced: the check on the tiny Qwen3, compiled with inductor on CPU by its own ranks, as
    a process, on two "hosts" (two empty inductor caches) that share one store. The first pushes what its compile
    left; the second pulls all of it before its model and, its compile served from the pulled graphs, has no new
    graph to push. Then lookup prints the pull command of the row."""
    store = tmp_path / "store"
    store.mkdir()
    url = store.as_uri()

    def one_host(name: str) -> tuple[str, dict]:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / name / "inductor"))
        proc = run_example(SCRIPT, "--models", "tiny-qwen3", "--compile_cache", url, "--out_dir",
                           str(tmp_path / name / "out"), *QUICK, process=True)
        return proc.stdout, _rows(tmp_path / name / "out")["tiny-qwen3"]

    out_1, row_1 = one_host("host_1")
    in_store = sorted(p for p in (store / KEY).rglob("*") if p.is_file())
    assert row_1["result"] == "PASS" and row_1["compile_cache_url"] == url and row_1["compile_s"] > 0, row_1
    assert in_store and f"{len(in_store)} new compile cache entries pushed to {url} ({KEY})" in row_1["notes"]
    assert f"[compile cache] 0 entries pulled from {url}" in out_1  # an empty store

    out_2, row_2 = one_host("host_2")
    assert f"[compile cache] {len(in_store)} entries pulled from {url} ({KEY})" in out_2, out_2[-2000:]
    assert row_2["result"] == "PASS" and row_2["generated_text"] == row_1["generated_text"]
    assert f"; 0 new compile cache entries pushed to {url}" in row_2["notes"], row_2["notes"]  # nothing compiled anew
    assert sorted(p for p in (store / KEY).rglob("*") if p.is_file()) == in_store

    capsys.readouterr()
    assert lookup.lookup_main([str(tmp_path / "host_1" / "out")]) == 0
    assert f"[1] python -m tools.compile_cache pull {shlex.quote(url)} --device cpu --key {KEY}  (1 row(s))" in \
        capsys.readouterr().out.splitlines()
