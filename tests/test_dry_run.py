"""--dry_run: the trn2 presets built at full size on the meta device and sharded by
torchtitan's own plan at 64 ranks over a fake process group, on this CPU machine."""
from __future__ import annotations

import pytest

from conftest import assert_clean_error, read_results, run_example


def _dry(script, tmp_path, *args, check=True):
    """A dry run as a process of its own, as users start it: a second sharded meta build in one process fails in
    FSDP ("different mesh objects"), which no command of the scripts does."""
    proc = run_example(script, "--dry_run", "--out_dir", str(tmp_path), *args, check=check, process=True)
    return proc, read_results(tmp_path)["dry_run"]


def _table_ok(r):
    assert set(r["per_rank_bytes"]) == {"parameters", "gradients", "optimizer_state", "gathered_blocks",
                                        "gradient_buffers", "activations"}
    assert all(v > 0 for v in r["per_rank_bytes"].values())
    assert r["total_bytes"] == sum(r["per_rank_bytes"].values())
    assert r["per_core_limit_bytes"] == 24 * 2**30


def test_native_qwen3_4b_at_64_ranks(shared_run):
    out, results = shared_run("native_4b_dry_run")
    r, stdout = results["dry_run"], (out.parent / "native_4b_dry_run.log").read_text()
    assert abs(r["parameters"] / 4.0e9 - 1) <= 0.01, r["parameters"]  # Qwen3-4B: 4.0 B
    assert r["world_size"] == 64 and r["data_parallel_shard"] == 64
    # FSDP shards every parameter over 64 ranks: a rank holds about 1/64 (padding adds a little)
    assert r["parameters"] / 64 <= r["local_parameters_per_rank"] <= 1.2 * r["parameters"] / 64
    _table_ok(r)
    assert r["fits"] and "per core: fits" in stdout
    # FSDP's units read from torchtitan's plan: the tied embedding + norm + lm_head unit holds the shared
    # 151,936 x 2560 matrix twice (one copy per module), and dwarfs a block (~0.1 B parameters)
    vocab, dim = 151936, 2560
    units = r["fsdp_units"]
    assert units["largest_outside_blocks"] == 2 * vocab * dim + dim
    assert 0.09e9 < units["largest_block"] < 0.11e9
    # bfloat16 compute at 64 ranks: the flat all-gather output beside the unsharded parameters (x2),
    # and the local shard's bfloat16 copy that the all-gather sends
    unit = units["largest_outside_blocks"] + units["largest_block"]
    gathered = 2 * unit * 2 + unit // 64 * 2
    assert r["per_rank_bytes"]["gathered_blocks"] == gathered
    # the chunked loss (8 chunks): logits of 512 tokens at a time, never the whole sequence's
    act = r["activation_terms"]
    assert act["loss_working_set"] < 4096 * vocab * 4
    # what fits: every layout of the 64 ranks sized from this one build, the preset's own among them
    rows = {(x["tensor_parallel"], x["activation_checkpoint"], x["local_batch_size"]): x for x in r["layouts"]}
    assert rows[(1, "full", 1)]["total_bytes"] == r["total_bytes"]
    assert {tp for tp, _, _ in rows} == {1, 2, 4, 8}  # dividing 64 ranks, 32 heads and 8 key/value heads
    assert {b for tp, _, b in rows if tp == 1} == {1}  # global batch 64 on 64 data-parallel ranks: 1 a rank
    none, selective, full = (rows[(1, ac, 1)]["total_bytes"] for ac in ("none", "selective", "full"))
    assert none > selective > full
    assert rows[(4, "full", 1)]["total_bytes"] < rows[(2, "full", 1)]["total_bytes"] < full
    assert r["preferred_fitting_layout"] == next(x for x in r["layouts"] if x["fits"])
    assert "[dry run] first layout that fits, in the order above (the fewest tensor-parallel ranks" in stdout
    assert "[dry run] the run's own layout: --tensor_parallel_degree" in stdout


def test_native_qwen3_8b_in_aws_layout(tmp_path):
    """AWS's Qwen3-8B layout: tensor parallel 4 x FSDP 16 over 64 ranks, selective activation checkpointing."""
    proc, r = _dry("train_native_qwen3.py", tmp_path, "--preset", "qwen3_8b")
    cfg = read_results(tmp_path)["config"]  # the preset's named source: AWS's TorchNeuron recipe of this layout
    assert (cfg["seq_len"], cfg["local_batch_size"], cfg["global_batch_size"], cfg["lr"]) == (4096, 1, 16, 3e-4)
    assert abs(r["parameters"] / 8.2e9 - 1) <= 0.01, r["parameters"]  # Qwen3-8B: 8.2 B
    assert (r["tensor_parallel"], r["data_parallel_shard"], r["activation_checkpoint"]) == (4, 16, "selective")
    # tensor parallel and FSDP together shard every parameter over all 64 ranks
    assert r["parameters"] / 64 <= r["local_parameters_per_rank"] <= 1.2 * r["parameters"] / 64
    _table_ok(r)
    assert r["fits"] and r["preferred_fitting_layout"]["fits"]
    own = next(x for x in r["layouts"] if (x["tensor_parallel"], x["activation_checkpoint"], x["local_batch_size"])
               == (4, "selective", 1))
    assert own["total_bytes"] == r["total_bytes"] and own["data_parallel"] == 16


@pytest.mark.extended
def test_native_qwen3_4b_on_one_small_core_does_not_fit(tmp_path):
    proc, r = _dry("train_native_qwen3.py", tmp_path, "--preset", "qwen3_4b", "--dry_run_ranks", "1",
                   "--per_core_gib", "8", check=False)
    assert_clean_error(proc, "does not fit 8 GiB per core at 1 ranks", "optimizer_state")
    assert r["fits"] is False and r["local_parameters_per_rank"] == r["parameters"]


def test_world_size_must_divide_global_batch(tmp_path):
    proc = run_example("train_native_qwen3.py", "--preset", "qwen3_4b", "--dry_run", "--dry_run_ranks", "3",
                       "--out_dir", str(tmp_path), check=False)
    assert_clean_error(proc, "global batch 64 is not a multiple of local batch 1 x 3 ranks")


@pytest.mark.extended
def test_moe_full_depth_counts_qwen3_30b_a3b(tmp_path):
    _, r = _dry("train_moe_nki.py", tmp_path, "--preset", "qwen3_30b_a3b_reduced", "--num_layers", "48",
                "--num_experts", "128", "--top_k", "8")
    assert abs(r["parameters"] / 30.5e9 - 1) <= 0.01, r["parameters"]  # Qwen3-30B-A3B: 30.5 B in total
    _table_ok(r)
    assert r["fits"]


def test_moe_reduced_preset_reports_its_own_size_at_tensor_parallel_4(tmp_path):
    """torchtitan's own MoE (--stock, AWS's 2.34 choice) at its tensor parallel 4 x FSDP 16: the 2.34 preset."""
    _, r = _dry("train_moe_nki.py", tmp_path, "--preset", "qwen3_30b_a3b_reduced_stock_tp4")
    assert (r["tensor_parallel"], r["data_parallel_shard"]) == (4, 16)
    assert r["published_parameters"] is None
    assert 1.5e9 < r["parameters"] < 2.5e9  # 4 layers x 64 experts of the 30B-A3B shape plus embeddings
    _table_ok(r)


@pytest.mark.extended
def test_hf_backend_qwen3_4b_instruct_at_64_ranks(tmp_path):
    """Without the download: the published config.json embedded in the script."""
    _, r = _dry("train_hf_backend.py", tmp_path, "--preset", "qwen3_4b_instruct")
    assert abs(r["parameters"] / 4.0e9 - 1) <= 0.01, r["parameters"]
    _table_ok(r)
    assert r["fits"]
