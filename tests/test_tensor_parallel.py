"""--tensor_parallel_degree and --activation_checkpoint. The native script from the tiny Qwen3's HF weights at tensor
parallel 2 on 2 ranks (one data-parallel rank), evaluated on held-out data and exported, against one rank without
activation checkpointing: the same weights, data and global batch. The load check and the export check read
whole-vocabulary logits from the sharded model (the run fails otherwise). A tensor-parallel run stopped and resumed
on 1 rank (--reshard), and the refusal without the flag: the chain of tests/test_stop.py. Activation checkpointing
against none on torchtitan's own model, in-process; the layout rules without training."""
from __future__ import annotations

import pytest

from common.harness import resume
from common.errors import UserError
from conftest import SAME_RUN, assert_clean_error, read_results, run_example, run_in_process

# float32 on CPU. Tensor parallel sums each layer's output over two half-width matmuls, in another order than one
# whole matmul: measured 3.8e-6 over 4 steps at loss 11 (TP 2 against 1 rank). A batch trained twice or left out
# moves a step's loss by some 1e-2.
LOSS_BOUND = 1e-4


# 3 steps of the tiny Qwen3 from its HF weights, float32, global batch 4: 2 micro-steps of 2 on the one
# data-parallel rank, whether that rank is one process or a tensor-parallel pair
RUN = ("--steps", "3", *SAME_RUN, "--global_batch_size", "4")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prepared_assets) -> dict:
    """One rank without activation checkpointing; tensor parallel 2 on 2 ranks (the scripts' own launch) with the
    builder's, held-out losses at steps 1 and 3, exported."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    weights = ("--hf_checkpoint", str(prepared_assets["tiny_qwen3"]))
    run_example("train_native_qwen3.py", *RUN, *weights, "--activation_checkpoint", "none", "--no-export",
                "--out_dir", str(root / "one"))
    proc = run_example("train_native_qwen3.py", *RUN, *weights, "--tensor_parallel_degree", "2", "--nproc_per_node",
                       "2", "--eval_every", "3", "--eval_steps", "1", "--out_dir", str(root / "tp2"))
    return {"one": read_results(root / "one"), "tp": read_results(root / "tp2"), "log": proc.stdout + proc.stderr}


@pytest.mark.extended
def test_tensor_parallel_trains_as_one_rank(runs):
    """Tensor parallel 2: every step's loss within LOSS_BOUND of one rank's, the load check and the held-out loss of
    the sharded model, its export re-read by transformers."""
    tp, one = runs["tp"], runs["one"]
    assert one["layout"] == {"data_parallel_shard": 1, "data_parallel_replicate": 1, "tensor_parallel": 1,
                             "activation_checkpoint": "none"}
    assert tp["layout"] == {**one["layout"], "tensor_parallel": 2, "activation_checkpoint": "full"}  # the builder's
    assert tp["world_size"] == 2 and tp["segments"][0]["data"]["data_parallel"] == 1  # two ranks, one data shard
    worst = max(abs(a - b) for a, b in zip(tp["losses"], one["losses"]))
    assert len(tp["losses"]) == 3 and worst <= LOSS_BOUND, (worst, tp["losses"], one["losses"])
    assert tp["load_check"]["passed"] and "[load check] max abs logit diff" in runs["log"]  # of the sharded model
    assert [row["step"] for row in tp["eval_losses"]] == [1, 3]  # held-out losses of the tensor-parallel model
    check = tp["export_check"]  # the export of a tensor-parallel run, re-read by transformers
    assert check["passed"] and check["max_abs_logit_diff"] <= 1e-5 and not check["missing_keys"], check


def test_full_activation_checkpointing_computes_what_none_does():
    """torchtitan's FullAC (the flag's `full`) around the tiny Qwen3's layers: the same loss and gradients as the
    model without it, to float32 rounding (it recomputes each layer's forward in the backward)."""
    import copy
    from types import SimpleNamespace

    import torch
    from torchtitan.config import ParallelismConfig

    from common import checkpoint, paths, torchtitan_fixes
    from common.recipe import activation_checkpoint_config

    spec = checkpoint.qwen3_spec_from_hf(checkpoint.read_hf_config(paths.asset_dir("tiny_qwen3")), where="tiny")
    torchtitan_fixes.use_attention_backend(spec.model, "sdpa")  # as the recipe runs it off CUDA
    spec.model.update_from_config(config=SimpleNamespace(parallelism=ParallelismConfig()))
    torch.manual_seed(0)
    plain = spec.model.build()
    plain.init_weights(buffer_device=None)
    wrapped = copy.deepcopy(plain)
    activation_checkpoint_config("full").build().apply(wrapped)
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())  # each layer recomputed
    tokens = torch.randint(0, 1000, (2, 32))
    grads = []
    for model in (plain, wrapped):
        model.zero_grad()
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        grads.append((loss.item(), {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                                    for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = grads
    assert set(ga) == set(gb) and abs(a - b) <= 1e-5
    assert max((ga[n] - gb[n]).abs().max().item() for n in ga) <= 1e-5


# ---- without training ---------------------------------------------------------------------------------------
def _layout(shape=None, *, tp, seq_len=64, world_size, global_batch=-1, local_batch=2, seq_divisor=1):
    from common.recipe import check_layout

    return check_layout(shape, tp=tp, seq_len=seq_len, world_size=world_size, global_batch=global_batch,
                        local_batch=local_batch, seq_divisor=seq_divisor)


def test_the_batch_splits_over_data_parallel_ranks_only():
    assert _layout(tp=2, world_size=2, global_batch=2) == 1  # 2 ranks at tensor parallel 2: one data-parallel rank
    assert _layout(tp=4, world_size=64, global_batch=64, local_batch=1) == 16
    with pytest.raises(UserError, match="does not divide the 6 ranks"):
        _layout(tp=4, world_size=6)
    with pytest.raises(UserError, match="--tensor_parallel_degree 2 does not divide the 1 rank$"):
        _layout(tp=2, world_size=1)  # the core copy on one process
    with pytest.raises(UserError, match=r"local batch 2 x 2 data-parallel ranks \(4 ranks / tensor parallel 2\)"):
        _layout(tp=2, world_size=4, global_batch=6)


@pytest.mark.parametrize("shape, seq_len, needle", [
    ({"num_attention_heads": 4, "num_key_value_heads": 2}, 30, "--seq_len 30 does not split"),
    ({"num_attention_heads": 4, "num_key_value_heads": 2}, 32, "num_key_value_heads 2"),
    ({"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 102}, 32, "intermediate_size 102"),
    ({"num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 151935}, 32, "vocab_size 151935"),
])
def test_a_model_that_does_not_split_over_the_degree_is_refused(shape, seq_len, needle):
    with pytest.raises(UserError, match=needle):
        _layout(shape, tp=4, seq_len=seq_len, world_size=4)
    _layout(shape, tp=1, seq_len=seq_len, world_size=4)  # no tensor parallel: nothing to split


def test_the_transformers_backend_s_sequence_divisor_is_checked_with_the_degree():
    """The Transformers backend asserts seq_len % (TP x 2 x CP) (torchtitan's ParallelDims.seq_len_divisor)."""
    with pytest.raises(UserError, match=r"--seq_len 66 does not split over --tensor_parallel_degree 2 x 2"):
        _layout(tp=2, seq_len=66, world_size=2, seq_divisor=2)
    assert _layout(tp=2, seq_len=68, world_size=2, seq_divisor=2) == 1


def test_a_resume_names_the_layout_that_changed():
    def record(tp: int, ac: str, ranks: int) -> dict:
        return {"script": "s", "world_size": ranks, "dataset": None, "settings": {
            "tensor_parallel_degree": tp, "activation_checkpoint": ac, "global_batch_size": -1, "local_batch_size": 2}}

    _, _, hint = resume.compared(record(2, "recipe", 4), record(1, "full", 4), reshard=False)
    assert hint == " (--activation_checkpoint full, --tensor_parallel_degree 1: add --reshard)"
    old, new, hint = resume.compared(record(2, "recipe", 4), record(1, "full", 2), reshard=True)
    assert hint == "" and old["settings"] == new["settings"]  # -1 resolved per data-parallel rank: 2 x 2 both
    # a record written before these flags existed reads as their defaults
    older = record(1, "recipe", 2)
    del older["settings"]["tensor_parallel_degree"], older["settings"]["activation_checkpoint"]
    assert resume._differences(older, record(1, "recipe", 2)) == []


def test_a_degree_that_does_not_divide_the_ranks_is_one_line_before_a_launch(tmp_path):
    proc = run_in_process("train_native_qwen3.py", "--tensor_parallel_degree", "3", "--nproc_per_node", "2",
                          "--out_dir", str(tmp_path / "o"))
    assert_clean_error(proc, "--tensor_parallel_degree 3 does not divide the 2 ranks")
    assert not (tmp_path / "o" / "logs").exists()  # nothing launched
