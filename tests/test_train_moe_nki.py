"""examples/train_moe_nki.py: the tiny preset trains 10 steps as plain python (to the stored golden losses) and 6
under torchrun 2 with the grouped-expert, SDPA and RoPE replacements, exports a Qwen3MoeForCausalLM that
transformers re-reads (no missing or unexpected keys, max abs logit diff <= 1e-5 with float32
experts), counts tokens per expert; and the replaced model matches torchtitan's stock MoE over 3
steps from the same weights (bfloat16 experts on both sides: losses within 1e-4). A resume after SIGKILL:
tests/test_resume.py (the native script: the same harness code resumes both); this script's checkpoint resumed on
another number of ranks: tests/test_reshard.py."""
from __future__ import annotations

import json
import re

import pytest

from conftest import ROOT, assert_clean_error, read_results, run_example, run_in_process

SCRIPT = "train_moe_nki.py"
GOLDEN = ROOT / "tests" / "assets" / "golden_losses" / "train_moe_nki.tiny.json"
GOLDEN_TOL = 1e-3  # float32 on CPU: 0.0 run to run here; CPU kernels of other instruction sets may move it
LAYERS, BATCH, SEQ, TOP_K, EXPERTS = 2, 2, 128, 4, 16  # the tiny preset
STOCK_TOL = 1e-4  # bf16 expert matmuls: grouped vs torchtitan's _grouped_mm, same math, rounding order may differ
OVERRIDE = re.compile(r"\[Override\] (common\.[\w.]+): (\S+) (\w+)\.Config -> (\w+)\.Config")


def _expected_replacements():
    return sorted(f"model_spec.model.layers.{i}.{m}" for i in range(LAYERS)
                  for m in ("attention.inner_attention", "attention.rope", "moe.routed_experts"))


def _check_run(res, world):
    losses, steps = res["losses"], len(res["steps"])
    assert losses[-1] < res["history"]["losses"][0] - 0.1, res["history"]
    assert res["world_size"] == world and res["tokens_per_s"] > 0
    assert res["replacements"] == _expected_replacements()
    load = res["expert_load"]  # this run's steps (a resumed run counts only its own)
    assert len(load) == EXPERTS and sum(load) == steps * world * BATCH * SEQ * TOP_K * LAYERS
    check = res["export_check"]
    assert check["missing_keys"] == [] and check["unexpected_keys"] == []
    assert check["tied_lm_head"] is False and check["max_abs_logit_diff"] <= 1e-5 and check["passed"]
    assert res["routing_bias"] == {"load_balance_coeff": None, "exported": False, "expert_bias_max_abs": 0.0}


def test_tiny_plain_python_matches_the_golden_losses(tmp_path, prepared_assets):
    """The default command (plain python, one process) for 10 steps: its curve equals the stored golden losses of
    the tiny preset, it exports a Qwen3MoeForCausalLM, and torchtitan logs one line per replaced module."""
    proc = run_example(SCRIPT, "--steps", "10", "--compare_losses", str(GOLDEN), "--loss_tolerance", str(GOLDEN_TOL),
                       "--out_dir", str(tmp_path))
    res = read_results(tmp_path)
    assert res["resumed_from_step"] == 0 and res["steps"] == list(range(1, 11))
    _check_run(res, 1)
    golden = json.loads(GOLDEN.read_text())["losses"]  # the first 10 losses are stored
    assert res["history"]["steps"] == list(range(1, 11))
    assert max(abs(a - b) for a, b in zip(res["history"]["losses"], golden)) <= GOLDEN_TOL
    assert res["loss_comparison"]["passed"] and res["loss_comparison"]["steps_compared"] == 10
    logged = sorted(m.group(2) for m in OVERRIDE.finditer(proc.stdout + proc.stderr))
    assert logged == res["replacements"]  # torchtitan logs one line per replaced module
    cfg = json.loads((tmp_path / "hf_export" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts"] == EXPERTS
    assert (tmp_path / "loss.png").is_file()


def test_tiny_torchrun_two_ranks(shared_run):
    """The tiny preset under torchrun over 2 processes, 6 steps (validated every 2: conftest.SHARED_RUNS)."""
    res = shared_run("moe_tiny_2_ranks")[1]
    assert res["steps"] == list(range(1, 7))
    _check_run(res, 2)


def test_replacements_match_torchtitan_stock_moe(tmp_path, prepared_assets):
    """From the tiny Qwen3-MoE's HF weights, float32 with bfloat16 experts on both sides: the load check passes
    within the export's tolerance for bfloat16 experts (1e-3; measured about 4e-4 for the stock experts, past the
    float32 load check's own 1e-4), and the losses agree within STOCK_TOL."""
    from tools import prepare_assets as assets

    weights = str(assets.prepare(["tiny_qwen3_moe"])["tiny_qwen3_moe"])
    runs = {}
    for name, flags in (("stock", ["--stock"]), ("ours", ["--expert_dtype", "bfloat16"])):
        out = tmp_path / name
        run_example(SCRIPT, "--hf_checkpoint", weights, "--steps", "3", "--seq_len", "64", "--no-export",
                    "--out_dir", str(out), *flags)
        runs[name] = read_results(out)
        check = runs[name]["load_check"]
        assert check["passed"] and check["tolerance"] == 1e-3, check
    assert runs["stock"]["replacements"] == [f"model_spec.model.layers.{i}.attention.inner_attention"
                                             for i in range(LAYERS)]
    diffs = [abs(a - b) for a, b in zip(runs["stock"]["losses"], runs["ours"]["losses"])]
    print("stock vs replaced losses", runs["stock"]["losses"], runs["ours"]["losses"], diffs)
    assert len(diffs) == 3 and max(diffs) <= STOCK_TOL


@pytest.mark.parametrize("args, needle", [
    (["--top_k", "20"], "--top_k 20 is larger than --num_experts 16"),
    (["--preset", "qwen3_30b_a3b"], "invalid choice: 'qwen3_30b_a3b'"),
    (["--steps", "0"], "--steps must be positive"),
])
def test_bad_input_is_one_clear_error(tmp_path, args, needle):
    assert_clean_error(run_in_process(SCRIPT, "--out_dir", str(tmp_path), *args), needle)
