"""--dry_run: the trn2 presets built at full size on the meta device and sharded by
torchtitan's own plan at 64 ranks over a fake process group, on this CPU machine."""
from __future__ import annotations

from conftest import assert_clean_error, read_results, run_example


def _dry(script, tmp_path, *args, check=True):
    proc = run_example(script, "--dry_run", "--out_dir", str(tmp_path), *args, check=check)
    return proc, read_results(tmp_path)["dry_run"]


def _table_ok(r):
    assert set(r["per_rank_bytes"]) == {"parameters", "gradients", "optimizer_state", "gathered_blocks",
                                        "gradient_buffers", "activations"}
    assert all(v > 0 for v in r["per_rank_bytes"].values())
    assert r["total_bytes"] == sum(r["per_rank_bytes"].values())
    assert r["per_core_limit_bytes"] == 24 * 2**30


def test_native_qwen3_4b_at_64_ranks(tmp_path):
    proc, r = _dry("train_native_qwen3.py", tmp_path, "--preset", "qwen3_4b")
    assert abs(r["parameters"] / 4.0e9 - 1) <= 0.01, r["parameters"]  # Qwen3-4B: 4.0 B
    assert r["world_size"] == 64 and r["data_parallel_shard"] == 64
    # FSDP shards every parameter over 64 ranks: a rank holds about 1/64 (padding adds a little)
    assert r["parameters"] / 64 <= r["local_parameters_per_rank"] <= 1.2 * r["parameters"] / 64
    _table_ok(r)
    assert r["fits"] and "per core: fits" in proc.stdout
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


def test_native_qwen3_4b_on_one_small_core_does_not_fit(tmp_path):
    proc, r = _dry("train_native_qwen3.py", tmp_path, "--preset", "qwen3_4b", "--dry_run_ranks", "1",
                   "--per_core_gib", "8", check=False)
    assert_clean_error(proc, "does not fit 8 GiB per core at 1 ranks", "optimizer_state")
    assert r["fits"] is False and r["local_parameters_per_rank"] == r["parameters"]


def test_world_size_must_divide_global_batch(tmp_path):
    proc = run_example("train_native_qwen3.py", "--preset", "qwen3_4b", "--dry_run", "--dry_run_ranks", "3",
                       "--out_dir", str(tmp_path), check=False)
    assert_clean_error(proc, "global batch 64 is not a multiple of local batch 1 x 3 ranks")


def test_moe_full_depth_counts_qwen3_30b_a3b(tmp_path):
    _, r = _dry("train_moe_nki.py", tmp_path, "--preset", "qwen3_30b_a3b_reduced", "--num_layers", "48",
                "--num_experts", "128", "--top_k", "8")
    assert abs(r["parameters"] / 30.5e9 - 1) <= 0.01, r["parameters"]  # Qwen3-30B-A3B: 30.5 B in total
    _table_ok(r)
    assert r["fits"]


def test_moe_reduced_preset_reports_its_own_size(tmp_path):
    _, r = _dry("train_moe_nki.py", tmp_path, "--preset", "qwen3_30b_a3b_reduced")
    assert r["published_parameters"] is None
    assert 1.5e9 < r["parameters"] < 2.5e9  # 4 layers x 64 experts of the 30B-A3B shape plus embeddings
    _table_ok(r)


def test_hf_backend_qwen3_4b_instruct_at_64_ranks(tmp_path):
    """Without the download: the published config.json embedded in the script."""
    _, r = _dry("train_hf_backend.py", tmp_path, "--preset", "qwen3_4b_instruct")
    assert abs(r["parameters"] / 4.0e9 - 1) <= 0.01, r["parameters"]
    _table_ok(r)
    assert r["fits"]
