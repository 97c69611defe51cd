"""Smoke and contract tests for examples/train_native_qwen3.py (issue: foundation). The round trip of a
non-default shape (untied, head_dim != hidden / heads, grouped-query attention) trained on a folder of JSON lines:
tests/test_export_matrix.py (odd_dense)."""
from __future__ import annotations

import json

import pytest

from conftest import GOLDEN_DIR, GOLDEN_TOL, assert_clean_error, known_noise, read_results, run_example, run_in_process

SCRIPT = "train_native_qwen3.py"
GOLDEN = GOLDEN_DIR / "train_native_qwen3.tiny.json"


@pytest.fixture(scope="module")
def tiny_run(shared_run):
    """`--preset tiny --steps 10 --compare_losses GOLDEN` (conftest.SHARED_RUNS; the export matrix reads it too)."""
    return shared_run("native_tiny")


def test_tiny_lowers_loss_and_exports(tiny_run):
    out, res = tiny_run
    losses = res["losses"]
    assert len(losses) == 10
    assert losses[-1] < losses[0] - 0.3, losses
    assert res["tokens_per_s"] > 0
    check = res["export_check"]
    assert check["missing_keys"] == [] and check["unexpected_keys"] == []
    assert check["tied_lm_head"] is True and check["lm_head_in_file"] is False
    assert check["max_abs_logit_diff"] <= 1e-5
    assert check["passed"] is True
    assert check["version_mismatch"] == {}  # made and re-read with the same stack, stamped in config.json
    assert set(res["versions"]) >= {"python", "torch", "torchtitan", "transformers"}
    assert (out / "loss.png").stat().st_size > 1000
    # the export opens as is: config.json and tokenizer files sit beside the weights
    exported = out / "hf_export"
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert (exported / "tokenizer.json").is_file()


def test_torchrun_two_ranks_fsdp_over_gloo(shared_run):
    """The tiny Qwen3 from its HF folder on 2 ranks, the scripts' own launch of torchrun (conftest.SHARED_RUNS; the
    stop tests' runs resume to its losses): loaded, trained and exported from FSDP shards."""
    _, res = shared_run("native_2_ranks_8_steps")
    assert res["world_size"] == 2 and len(res["losses"]) == 8
    assert res["load_check"]["passed"] is True, res["load_check"]
    assert res["export_check"]["passed"] is True, res["export_check"]


def test_pretrained_beats_random(tiny_run, tmp_path):
    """The tiny run's export (10 steps) loaded back: its first loss is well below the random init's, and the load
    check passes. (The HF load into FSDP shards over 2 processes: test_torchrun_two_ranks_fsdp_over_gloo.)"""
    trained, res = tiny_run
    random_first = res["losses"][0]
    again = tmp_path / "again"
    run_example(SCRIPT, "--hf_checkpoint", str(trained / "hf_export"), "--steps", "1", "--seq_len", "128",
                "--no-export", "--out_dir", str(again))
    assert read_results(again)["load_check"]["passed"]
    pretrained_first = read_results(again)["losses"][0]
    assert pretrained_first < random_first - 0.4, (pretrained_first, random_first)


def test_missing_neuron(tmp_path):
    """The script's own preflight: torch-neuronx, and none of the kernels it never calls."""
    proc = run_in_process(SCRIPT, "--device", "neuron", "--out_dir", str(tmp_path))
    assert_clean_error(proc, "not installed: torch-neuronx (")
    assert "nki" not in proc.stderr and "rope" not in proc.stderr and "moe" not in proc.stderr, proc.stderr


def test_golden_losses(tiny_run):
    """The first 10 losses of the tiny preset equal the stored golden losses."""
    _, res = tiny_run
    golden = json.loads(GOLDEN.read_text())["losses"]
    comp = res["loss_comparison"]
    assert comp["steps_compared"] == 10 and comp["reference"] == str(GOLDEN)
    assert [s["reference"] for s in comp["per_step"]] == golden
    assert max(abs(a - b) for a, b in zip(res["losses"], golden)) <= GOLDEN_TOL
    assert comp["passed"] is True


def test_compare_losses_reports_the_first_differing_step(tiny_run, tmp_path):
    """A reference perturbed from step 4 on is reported as differing from step 4 (the same
    function --compare_losses calls, on the losses of the tiny run)."""
    from common.harness.checks import compare_losses, format_loss_comparison

    _, res = tiny_run
    golden = json.loads(GOLDEN.read_text())
    golden["losses"] = golden["losses"][:3] + [x + 0.01 for x in golden["losses"][3:]]
    perturbed = tmp_path / "perturbed.json"
    perturbed.write_text(json.dumps(golden))
    comp = compare_losses(res["losses"], perturbed, GOLDEN_TOL)
    assert comp["first_differing_step"] == 4 and comp["passed"] is False
    assert "from step 4" in format_loss_comparison(comp)
    assert res["loss_comparison"]["first_differing_step"] is None


def test_compare_losses_bad_reference(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert_clean_error(run_in_process(SCRIPT, "--out_dir", str(tmp_path / "o"), "--compare_losses", str(bad)),
                       "not a JSON file with a 'losses' list")


def test_export_version_stamp_mismatch_is_reported(tmp_path):
    from common.export import version_check

    stamp = version_check({"python": "3.11.7", "torch": "0.0.1"})
    assert stamp["version_mismatch"]["torch"][0] == "0.0.1"
    assert version_check(stamp["reader_versions"])["version_mismatch"] == {}


@pytest.mark.parametrize("run", ["native_tiny", "hf_tiny", "moe_tiny_2_ranks"])
def test_a_clean_run_prints_no_line_the_user_cannot_act_on(run, shared_run):
    """The shared runs' whole output (each script; the MoE one on 2 ranks): none of the torchtitan and torch lines
    every run printed that ask nothing of the user (common/torchtitan_fixes.py: 11 to 13 of them a run before)."""
    out, _ = shared_run(run)
    assert known_noise((out.parent / f"{run}.log").read_text()) == []
