"""bench/: every benchmark runs in its tiny mode, exits 0 and writes results.json with its ratios
present, finite and positive, and says what they are compared with. The harness is checked, not the
speed: no test asserts a timing or a ratio's size.

The training benches and bench_compat_check run as `python bench/<bench>.py --preset tiny ...` runs them: their
own `__main__` entry, in this test process (run_in_process); what they start with `python` (the training runs, the
example's command of bench_compat_check) is a process of its own, as the bench starts it. The benches that start no
python command, bench_compat_lookup (its CPU figure is its children's CPU time: its commands must be its own
children) and bench_compat_page run as a process of their own (run_python)."""
from __future__ import annotations

import json
import math
import sys

import pytest

from conftest import ROOT, run_in_process, run_python, script_env


def run_bench(script: str, out_dir, *args: str, in_process: bool = False) -> dict:
    """`python bench/SCRIPT --preset tiny --out_dir OUT_DIR ARGS`, checks what every bench writes, and returns its
    results.json. A bench that starts python commands (`in_process`): its __main__ in this process (the environment
    of a test's command, script_env), the commands it times each a process of their own as it starts them; the
    others in a process of their own (run_python)."""
    cmd = [str(ROOT / "bench" / script), "--preset", "tiny", "--out_dir", str(out_dir), *args]
    if in_process:
        proc = run_in_process(*cmd, env=script_env())  # an absolute path: run_in_process's examples/ not joined
    else:
        proc = run_python([sys.executable, *cmd], timeout=900)
    assert proc.returncode == 0, \
        f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    results = json.loads((out_dir / "results.json").read_text())
    assert results["table"] in proc.stdout  # the table printed is the table stored
    for key in ("benchmark", "machine", "versions", "config"):
        assert key in results, key
    assert results["machine"]["cpus"] >= 1 and results["machine"]["cpu_model"]
    assert not {"target", "met", "MISSED"} & set(results), "ratios are reported, not a verdict"
    assert "MISSED" not in results["table"]
    return results


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_common_bench_alternates_and_takes_medians():
    sys.path.insert(0, str(ROOT))
    from bench import common_bench as cb

    order = []
    samples = cb.alternate({"a": lambda: order.append("a") or 1.0, "b": lambda: order.append("b") or 3.0},
                           repeats=3, warmup=1, log=None)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]  # reversed every other round
    assert samples == {"a": [1.0, 1.0, 1.0], "b": [3.0, 3.0, 3.0]}  # warm-up round dropped
    assert cb.summary([3.0, 1.0, 2.0, float("nan")])["median"] == 2.0
    assert cb.ratio(3.0, 1.5) == 2.0 and math.isnan(cb.ratio(1.0, 0.0))
    stats = cb.step_stats({"times": [0.0, 5.0, 6.0, 8.0, 9.0], "cpu_times": [0, 1, 2, 3, 4],
                           "tokens_seen": [10, 20, 30, 40]})
    assert stats["step_s"] == 1.0 and stats["tokens_per_step"] == 10  # step 1 left out
    assert stats["tokens_per_s"] == 10.0
    # defaults: 1 process, no launcher flags, no variables of its own
    assert cb.TrainingRun("ours", "x.py", []) == ("ours", "x.py", [], 1, (), None)
    nominal = cb.nominal_peak_flops()
    assert nominal["flops_per_cycle_per_core"] in (8, 16, 32, 64) and nominal["cores"] >= 1


def test_timed_train_takes_the_rotary_fix_as_a_flag():
    """The Transformers-backend fix is asked for by a flag, never picked from the script's name;
    it belongs to the stock mode (in ours the example applies its own fixes)."""
    proc = run_in_process(str(ROOT / "bench" / "timed_train.py"), "--mode", "ours", "--fix_hf_rotary",
                          "--timing_file", "unused.json", str(ROOT / "examples" / "train_hf_backend.py"))
    assert proc.returncode == 2 and "--fix_hf_rotary is for --mode stock" in proc.stderr
    sys.path.insert(0, str(ROOT))
    from bench import bench_train_overhead as overhead

    assert overhead.STOCK_LAUNCHER_FLAGS == {"hf": ("--fix_hf_rotary",)}  # what the hf kind's stock run passes


@pytest.mark.extended
def test_bench_rope(tmp_path):
    r = run_bench("bench_rope.py", tmp_path)
    assert r["rows"] and "CosSinRoPE" in r["compared_with"]
    assert finite(r["lowest"]["cossin_over_op_float32"]) and finite(r["lowest"]["cossin_over_op_first_layer_float32"])
    lowest = f"{r['lowest']['cossin_over_op_float32']:.2f}"
    assert f"CosSinRoPE / op, float32, lowest over the shapes: {lowest}" in r["table"]
    for row in r["rows"]:
        for key in ("op_ms", "op_first_layer_ms", "cossin_ms", "hf_ms", "cossin_over_op", "cossin_over_op_first_layer",
                    "hf_over_op"):
            assert finite(row[key]), (key, row[key])


@pytest.mark.extended
def test_bench_moe(tmp_path):
    r = run_bench("bench_moe.py", tmp_path)
    assert [row["experts"] for row in r["rows"]] == [8, 16]
    for row in r["rows"]:
        for key in ("op_fp32_ms", "loop_fp32_ms", "matmuls_fp32_ms", "op_bf16_ms", "stock_bf16_ms", "loop_over_op",
                    "stock_over_op", "loop_over_matmuls", "op_over_matmuls"):
            assert finite(row[key]), (key, row[key])
    assert finite(r["at_16_experts"]["loop_over_op"]) and finite(r["at_16_experts"]["loop_over_matmuls"])
    assert f"loop / op {r['at_16_experts']['loop_over_op']:.2f} at 16 experts" in r["table"]
    assert "per-expert loop" in r["compared_with"]


@pytest.mark.extended
def test_bench_train_overhead(tmp_path):
    r = run_bench("bench_train_overhead.py", tmp_path, "--extra_args", "--seq_len 8 --local_batch_size 1",
                  in_process=True)
    (row,) = r["rows"]
    for key in ("ours_step_ms", "stock_step_ms", "ours_over_stock", "ours_tokens_per_s", "stock_tokens_per_s",
                "ours_mfu_measured_pct", "stock_mfu_measured_pct", "ours_mfu_nominal_pct", "ours_to_first_step_s",
                "stock_to_first_step_s", "ours_over_stock_to_first_step"):
        assert finite(row[key]), (key, row[key])
    assert finite(r["peak_flops"]["measured"]) and finite(r["peak_flops"]["nominal"]["flops"])
    # the same model, data and batch on both sides: the same losses
    assert row["first_losses"]["ours"] == pytest.approx(row["first_losses"]["stock"], abs=1e-4)
    assert "torchtitan.train.main" in r["baseline"] and "Trainer.Config = 1.00" in r["compared_with"]
    assert f"ours / stock step time {row['ours_over_stock']:.3f}" in r["table"]


@pytest.mark.extended
def test_bench_hf_vs_native(tmp_path):
    r = run_bench("bench_hf_vs_native.py", tmp_path, "--extra_args", "--seq_len 8 --local_batch_size 1 --no-load_check",
                  in_process=True)
    assert [row["path"] for row in r["rows"]] == ["native", "hf"]
    assert finite(r["hf_over_native"]) and "native Qwen3" in r["compared_with"]
    for row in r["rows"]:
        assert finite(row["step_ms"]) and finite(row["tokens_per_s"])
    # one model: the first losses of the two paths agree (README: within 2e-6)
    assert r["rows"][0]["first_losses"] == pytest.approx(r["rows"][1]["first_losses"], abs=1e-4)


@pytest.mark.extended
def test_bench_scaling(tmp_path):
    r = run_bench("bench_scaling.py", tmp_path, "--seq_len", "8", in_process=True)
    runs = {row["run"]: row for row in r["rows"]}
    assert set(runs) == {"tiny_1p", "small_1p", "tiny_2p"}
    for row in runs.values():
        assert finite(row["step_ms"]) and finite(row["step_over_tiny"]) and finite(row["flops_over_tiny"])
    assert runs["small_1p"]["flops_over_tiny"] > 1.0  # the larger model does more work per token
    assert finite(runs["tiny_2p"]["speedup"]) and finite(runs["tiny_2p"]["parallel_efficiency"])


@pytest.mark.extended
def test_bench_compat_check(tmp_path):
    r = run_bench("bench_compat_check.py", tmp_path, in_process=True)
    if r["skipped"]:
        pytest.skip(r["skipped"])
    (row,) = r["rows"]
    for key in ("load_s", "generation_s", "reference_s", "judging_s", "script_wall_s"):
        assert finite(row[key]), (key, row[key])
    assert row["compile_s"] == 0.0 and row["cpu_match"] is True


@pytest.mark.extended
def test_bench_compat_page(tmp_path):
    """The lookup page in headless Chromium (installed by set-up): 500 generated rows, its timings and a
    screenshot with a row open."""
    r = run_bench("bench_compat_page.py", tmp_path)
    assert r["generated_rows"] == 500 and r["console_errors"] == []
    assert [row["what"].split()[0] for row in r["rows"]] == ["open", "search", "filter"]
    assert all(finite(row["ms"]) and row["ms"] >= 0 for row in r["rows"])
    assert (tmp_path / "page.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.extended
def test_bench_compat_lookup(tmp_path):
    """The lookup with rankings, terminal and page, against its own start-up: 500 rows and ranked records."""
    r = run_bench("bench_compat_lookup.py", tmp_path)
    assert [row["command"] for row in r["rows"]] == ["start-up", "terminal", "html"]
    for row in r["rows"]:
        for key in ("wall_s", "cpu_s", "over_start_up", "cpu_over_start_up"):
            assert finite(row[key]), (row["command"], key, row[key])
    assert r["page_bytes"] > 0 and "start-up" in r["baseline"]
