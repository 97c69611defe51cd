"""The pilot fields every training script writes into results.json: timing (first step apart from the steady
steps), FLOPs per token from the model's shape (the same for the HF backend and the native model), MFU against a
stated peak, memory against the dry run's plan, cost; the dry run's projection of the full run (TensorBoard:
tests/test_eval.py)."""
from __future__ import annotations

import pytest

from conftest import read_results, run_example

PILOT = ("timing", "flops_per_token", "mfu", "peak_flops_per_device", "memory", "cost")


def _check_pilot(r: dict, *, ranks: int = 1, priced: bool = False) -> None:
    assert all(k in r for k in PILOT), sorted(set(PILOT) - set(r))
    t = r["timing"]
    # which is larger depends on how busy the machine is; the arithmetic: test_timing_sets_the_warm_up_apart
    assert t["first_step_s"] > 0 and t["steady_step_s"] > 0 and t["warmup_steps_excluded"] >= 1
    assert t["compile_or_warmup_s"] == pytest.approx(t["first_step_s"] - t["steady_step_s"])
    assert t["steady_tokens_per_s_per_rank"] == pytest.approx(t["steady_tokens_per_s"] / ranks)
    peak = r["peak_flops_per_device"]
    assert peak["value"] > 1e9 and peak["source"].startswith("measured:"), peak  # CPU: a matmul in the process
    assert 0 < r["mfu"] < 1, r["mfu"]  # a fraction, and not torchtitan's 0.00% against an accelerator's peak
    assert r["mfu"] == pytest.approx(r["flops_per_token"] * t["steady_tokens_per_s"] / (peak["value"] * ranks))
    m = r["memory"]
    assert len(m["peak_gib"]) == ranks and all(g > 0 for g in m["peak_gib"]) and m["measured_by"]
    assert m["planned_gib"] > 0 and m["ratio"] == pytest.approx(max(m["peak_gib"]) / m["planned_gib"], rel=1e-3)
    if priced:
        c = r["cost"]
        assert c["run_cost"] == pytest.approx(c["price_per_hour"] * c["run_hours"])
        assert c["per_million_tokens"] == pytest.approx(c["price_per_hour"] / (t["steady_tokens_per_s"] * 3600) * 1e6)
    else:
        assert r["cost"] is None


def test_timing_sets_the_warm_up_apart():
    """Step 1 on its own, the steady figure the median of the steps after the warm-up (2 steps from 5 steps on),
    tokens a second from the tokens seen."""
    from common.losses import LossRecorder
    from common.harness.pilot import timing

    ends = [0.0, 9.0, 12.0, 13.0, 14.5, 15.5, 16.5]  # start, then the end of steps 1..6: 9, 3, 1, 1.5, 1, 1 s
    rec = LossRecorder(steps=list(range(1, 7)), losses=[1.0] * 6, times=ends, tokens_seen=[64 * s for s in range(1, 7)])
    t = timing(rec, world_size=2)
    assert (t["first_step_s"], t["steady_step_s"], t["warmup_steps_excluded"]) == (9.0, 1.0, 2)
    assert t["compile_or_warmup_s"] == 8.0 and t["tokens_per_step"] == 64
    assert (t["steady_tokens_per_s"], t["steady_tokens_per_s_per_rank"]) == (64.0, 32.0)
    short = timing(LossRecorder(steps=[1, 2, 3], losses=[1.0] * 3, times=ends[:4], tokens_seen=[64, 128, 192]), 1)
    assert (short["steady_step_s"], short["warmup_steps_excluded"]) == (2.0, 1)  # median of 3 s and 1 s


def test_native_pilot_fields(shared_run):
    _check_pilot(shared_run("native_tiny")[1])
    _check_pilot(shared_run("native_tiny_2_ranks")[1], ranks=2)


def test_hf_backend_pilot_fields_and_the_same_flops_as_the_native_model(shared_run):
    """The same tiny Qwen3 counts the same FLOPs per token through torchtitan's Transformers backend and its own
    model (torchtitan's own count for the backend is about a hundredth of it)."""
    hf_run = shared_run("hf_tiny")[1]
    _check_pilot(hf_run, priced=True)
    native = shared_run("native_tiny")[1]
    assert hf_run["flops_per_token"] == pytest.approx(native["flops_per_token"], rel=0.01)
    assert native["flops_per_token"] > 50e6  # 6 x ~9.8 M parameters a token passes through, plus attention


def test_moe_pilot_fields_count_active_experts_only(shared_run):
    r = shared_run("moe_tiny_2_ranks")[1]
    _check_pilot(r, ranks=2)
    from common.harness.pilot import flops_per_token

    shape, seq = r["model_shape"], r["config"]["seq_len"]
    all_experts = dict(shape, num_experts_per_tok=shape["num_experts"])
    assert r["flops_per_token"] == flops_per_token(shape, seq) < flops_per_token(all_experts, seq)


def test_dry_run_projects_the_full_runs_time_and_cost(tmp_path):
    """--dry_run with --assumed_mfu and --price_per_hour: the full run's time from its FLOPs at that MFU of trn2's
    peak (158 TFLOPS a logical core), and its cost."""
    out = tmp_path / "dry"
    proc = run_example("train_native_qwen3.py", "--preset", "qwen3_4b", "--dry_run", "--assumed_mfu", "0.3",
                       "--price_per_hour", "50", "--out_dir", str(out))
    p = read_results(out)["projection"]
    assert p["world_size"] == 64 and p["tokens_per_step"] == 64 * 4096 and p["peak_flops_per_device"] == 158e12
    seconds = 10 * 64 * 4096 * p["flops_per_token"] / (0.3 * 158e12 * 64)
    assert p["seconds"] == pytest.approx(seconds) and p["cost"] == pytest.approx(50 * seconds / 3600)
    assert 25e9 < p["flops_per_token"] < 40e9  # Qwen3-4B: 6 x ~4 B + attention at 4096 tokens
    assert "[plan] 10 steps x 262,144 tokens" in proc.stdout


PLAN_AFTER_THREADED_OPS = """
import sys, torch
sys.path.insert(0, {root!r})
from common.harness import pilot
torch.set_num_threads(2)
x = torch.randn(2000, 2000)
torch.nn.functional.gelu(x @ x).sum()  # the parent's OpenMP pool now has a second thread
plan = lambda: int(torch.nn.functional.gelu(torch.randn(2000, 2000)).numel())  # a parallel region in the child
print(pilot._plan_in_a_child(plan, "cpu", lambda device_type: None))
"""


def test_the_plan_is_made_in_a_child_after_the_parent_ran_ops_on_several_threads(tmp_path):
    """torch's default threads: once an op has run, a forked child's first parallel region waits forever for the
    parent's OpenMP threads (the plan then came back only at PLAN_TIMEOUT_S, as None). The child plans on one
    thread and answers."""
    import subprocess
    import sys

    from conftest import ROOT, script_env

    env = dict(script_env(), OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", PLAN_AFTER_THREADED_OPS.format(root=str(ROOT))], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [str(round(4_000_000 / (1 << 30), 4))], proc.stdout

