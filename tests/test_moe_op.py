"""common/kernels/moe_op.py: the grouped-expert op against the per-expert loop (plain autograd, the baseline
bench/bench_moe.py times), outputs and gradients (hidden states, router, expert weights) in float32 within 1e-5,
experts without tokens included; op registration (opcheck); the routing tables of the Trainium branch, on CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.bench_moe import per_expert_loop
from common.errors import UserError
from common.kernels.moe_nki import block_to_expert, check_nki_shapes, num_blocks, token_slots
from common.kernels.moe_op import grouped_experts

TOL = 1e-5


def _model(T=48, D=32, H=64, E=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(T, D, generator=g), "gate": 0.3 * torch.randn(E, D, generator=g),
            "w1": 0.1 * torch.randn(E, H, D, generator=g), "w2": 0.1 * torch.randn(E, D, H, generator=g),
            "w3": 0.1 * torch.randn(E, H, D, generator=g), "grad": torch.randn(T, D, generator=g)}


def _route(x, gate, top_k, unused):
    """Softmax router with top-k and renormalised scores (Qwen3-MoE); experts in `unused` never win."""
    logits = x @ gate.t()
    logits = logits.index_fill(1, torch.tensor(unused, dtype=torch.long), -1e4) if unused else logits
    scores, ids = F.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return scores / scores.sum(-1, keepdim=True), ids


def _run(experts_fn, m, top_k, unused):
    leaves = {k: m[k].clone().requires_grad_() for k in ("x", "gate", "w1", "w2", "w3")}
    scores, ids = _route(leaves["x"], leaves["gate"], top_k, unused)
    out = experts_fn(leaves["x"], scores, ids, leaves["w1"], leaves["w2"], leaves["w3"])
    out.backward(m["grad"])
    return out.detach(), {k: v.grad for k, v in leaves.items()}, ids


@pytest.mark.parametrize("E, top_k, unused", [(8, 4, [3]), (16, 4, [0, 5, 15]), (16, 1, [])])
def test_matches_per_expert_loop(E, top_k, unused):
    m = _model(E=E, seed=E + top_k)
    ours = _run(lambda *a: grouped_experts(*a, compute_dtype=torch.float32)[0], m, top_k, unused)
    ref = _run(per_expert_loop, m, top_k, unused)
    assert not torch.isin(torch.tensor(unused, dtype=torch.long), ref[2]).any()  # really left without tokens
    assert (ours[0] - ref[0]).abs().max().item() <= TOL
    for name in ("x", "gate", "w1", "w2", "w3"):
        assert (ours[1][name] - ref[1][name]).abs().max().item() <= TOL, name
    for e in unused:  # an expert without tokens gets exactly zero gradient
        for name in ("w1", "w2", "w3"):
            assert ours[1][name][e].abs().max().item() == 0.0


def test_counts_and_bfloat16_compute():
    m = _model()
    scores, ids = _route(m["x"], m["gate"], 4, [2])
    out32, counts = grouped_experts(m["x"], scores, ids, m["w1"], m["w2"], m["w3"], compute_dtype=torch.float32)
    assert counts.tolist() == torch.bincount(ids.flatten(), minlength=16).tolist() and counts[2] == 0
    out16, _ = grouped_experts(m["x"], scores, ids, m["w1"], m["w2"], m["w3"], compute_dtype=torch.bfloat16)
    assert out16.dtype == torch.float32  # matmuls in bf16, weighting and sum in float32, output in x's dtype
    assert 0 < (out16 - out32).abs().max().item() < 2e-2 * out32.abs().max().item()


def test_opcheck():
    m = _model(T=12, D=16, H=16, E=4)
    scores, ids = _route(m["x"], m["gate"], 2, [])
    args = (m["x"].requires_grad_(), scores.detach().requires_grad_(), ids, m["w1"].requires_grad_(),
            m["w2"].requires_grad_(), m["w3"].requires_grad_(), torch.float32)
    torch.library.opcheck(torch.ops.qwen3_recipes.grouped_experts_fwd.default, args)


def test_shape_errors():
    m = _model(T=8, D=16, H=32, E=4)
    scores, ids = _route(m["x"], m["gate"], 2, [])
    with pytest.raises(UserError, match="w2 \\[experts, dim, hidden\\]"):
        grouped_experts(m["x"], scores, ids, m["w1"], m["w1"], m["w3"])
    with pytest.raises(UserError, match="7 routing rows for 8 tokens"):
        grouped_experts(m["x"], scores[:7], ids[:7], m["w1"], m["w2"], m["w3"])


def test_trainium_routing_tables():
    """The blocks the NKI kernels read: each block serves one expert, every routed (token, expert)
    pair sits in exactly one slot of a block of its expert, and empty slots point at padding row T."""
    T, K, E, B = 300, 4, 8, 128
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    counts = torch.bincount(ids.flatten(), minlength=E)
    n = num_blocks(T, K, E, B)
    b2e = block_to_expert(counts, n, B)
    slots = token_slots(ids, counts, n, B).view(n, B).long()
    assert len(b2e) == n
    pairs = set()
    for blk in range(n):
        for t in slots[blk].tolist():
            if t == T:
                continue
            assert int(b2e[blk]) in ids[t].tolist()
            pairs.add((t, int(b2e[blk])))
    assert pairs == {(t, int(e)) for t in range(T) for e in ids[t]}
    assert int((slots != T).sum()) == T * K


def test_trainium_shape_rules():
    """The kernels' rules, named (more cases in tests/test_moe_nki_pack.py): the tiny preset's experts break two."""
    assert check_nki_shapes(2048, 768, torch.bfloat16, lnc=2) == 2  # Qwen3-30B-A3B's expert shape
    with pytest.raises(UserError, match=r"moe_intermediate_size\) 32 .*compute dtype torch.float32"):
        check_nki_shapes(64, 32, torch.float32, lnc=2)
