"""MoE parity with transformers, at the AWS guide's reduced routing (64 experts, top-4, 4 layers) with a
small hidden size: transformers' own `Qwen3MoeSparseMoeBlock` (its eager per-expert loop) is the
reference, given the same weights as
  - the grouped-expert op alone (common/kernels/moe_op.py), fed the reference's routing, and
  - the MoE block training uses: torchtitan's MoE built from the Qwen3-MoE spec the training script
    uses (common/checkpoint.py), its routed experts replaced by OpRoutedExperts through the same
    override factory (common/kernels/moe_module.py).
Four layers are chained (h = h + moe(h)), so routing in later layers sees earlier outputs. Forward
and backward (input, router and expert weights) are compared, and the routing: the share of tokens
whose top-4 expert sets are equal. Float32: routing identical, everything within 1e-5. bfloat16 on
both sides: routing agreement at least 99% (near-ties may break the other way once earlier layers'
outputs differ by rounding), outputs within 2 bfloat16 units in the last place where the routing
agrees. Run with -s for the figures (max abs diffs, agreement per layer).
"""
from __future__ import annotations

import math

import pytest
import torch

from common import device

device.route_torchtitan_device("cpu")  # before torchtitan is imported below

from transformers import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

from common import checkpoint  # noqa: E402
from common.kernels.moe_module import OpRoutedExperts, grouped_experts_op  # noqa: E402
from common.kernels.moe_op import grouped_experts  # noqa: E402

LAYERS, EXPERTS, TOP_K, DIM, MOE_HIDDEN = 4, 64, 4, 64, 32
TOKENS = (4, 128)  # batch x sequence: 512 tokens, 2048 routed token-layer pairs over the 4 layers
TOL_FP32 = 1e-5
MIN_AGREEMENT_BF16 = 0.99
SHAPE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 1024, "hidden_size": DIM,
         "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "moe_intermediate_size": MOE_HIDDEN,
         "norm_topk_prob": True, "max_position_embeddings": 1024, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": False}


def _hf_blocks(seed: int = 0) -> list[Qwen3MoeSparseMoeBlock]:
    cfg = Qwen3MoeConfig(hidden_size=DIM, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                         moe_intermediate_size=MOE_HIDDEN, norm_topk_prob=True, experts_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(LAYERS):
        b = Qwen3MoeSparseMoeBlock(cfg)
        with torch.no_grad():
            # router logits of a few units (a peaked routing, as trained routers have); each block's
            # output a fraction of the hidden state's size, as in a residual stream
            b.gate.weight.copy_(0.3 * torch.randn(b.gate.weight.shape, generator=g))
            b.experts.gate_up_proj.copy_(0.1 * torch.randn(b.experts.gate_up_proj.shape, generator=g))
            b.experts.down_proj.copy_(0.1 * torch.randn(b.experts.down_proj.shape, generator=g))
        blocks.append(b)
    return blocks


def _titan_blocks(hf_blocks, compute_dtype: str) -> list[torch.nn.Module]:
    """torchtitan's MoE of each layer (the training script's spec, load balancing off as in its
    presets), routed experts replaced by OpRoutedExperts, weights copied from transformers' blocks."""
    spec = checkpoint.qwen3_spec_from_hf(SHAPE, where="test")
    blocks = []
    for layer_cfg, hf in zip(spec.model.layers, hf_blocks):
        moe_cfg = layer_cfg.moe
        moe_cfg.load_balance_coeff = None
        moe_cfg.routed_experts = grouped_experts_op(moe_cfg.routed_experts, compute_dtype=compute_dtype)
        moe = moe_cfg.build()
        assert isinstance(moe.routed_experts, OpRoutedExperts) and moe.shared_experts is None
        inner = moe.routed_experts.inner_experts
        with torch.no_grad():
            moe.router.gate.weight.copy_(hf.gate.weight)
            inner.w1_EFD.copy_(hf.experts.gate_up_proj[:, :MOE_HIDDEN])  # gate_proj
            inner.w3_EFD.copy_(hf.experts.gate_up_proj[:, MOE_HIDDEN:])  # up_proj
            inner.w2_EDF.copy_(hf.experts.down_proj)
        blocks.append(moe)
    return blocks


def _run(blocks, x, out_grad, routed_by) -> dict:
    """h = h + block(h) through the layers; backward of <h, out_grad>; the top-k expert ids per layer."""
    ids = []
    hooks = [routed_by(b).register_forward_hook(lambda _m, _i, out: ids.append(_ids(out))) for b in blocks]
    x = x.clone().requires_grad_()
    h, moe_scale = x, 0.0
    for b in blocks:
        y = b(h)
        moe_scale = max(moe_scale, y.detach().float().abs().max().item())
        h = h + y
    (h.float() * out_grad).sum().backward()
    for hook in hooks:
        hook.remove()
    return {"out": h.detach().float(), "x_grad": x.grad.float(), "ids": ids, "moe_scale": moe_scale}


def _ids(router_out) -> torch.Tensor:
    """Sorted top-k expert ids per token from either router: transformers returns (logits, scores,
    ids) [T, K]; torchtitan (scores, ids, all scores) [B, L, K]."""
    ids = router_out[2] if router_out[2].dtype in (torch.int32, torch.int64) else router_out[1]
    return ids.reshape(-1, TOP_K).sort(dim=-1).values


def _hf_grads(blocks) -> list[torch.Tensor]:
    return [t for b in blocks for t in (b.gate.weight.grad, b.experts.gate_up_proj.grad, b.experts.down_proj.grad)]


def _titan_grads(blocks) -> list[torch.Tensor]:
    out = []
    for b in blocks:
        e = b.routed_experts.inner_experts
        out += [b.router.gate.weight.grad, torch.cat([e.w1_EFD.grad, e.w3_EFD.grad], dim=1), e.w2_EDF.grad]
    return out


def _inputs(dtype):
    g = torch.Generator().manual_seed(1)
    return torch.randn(*TOKENS, DIM, generator=g).to(dtype), torch.randn(*TOKENS, DIM, generator=g)


def _compare(dtype: torch.dtype) -> dict:
    hf = _hf_blocks()
    titan = _titan_blocks(hf, "float32" if dtype == torch.float32 else "bfloat16")
    for b in (*hf, *titan):
        b.to(dtype)
    x, out_grad = _inputs(dtype)
    ref = _run(hf, x, out_grad, routed_by=lambda b: b.gate)
    got = _run(titan, x, out_grad, routed_by=lambda b: b.router)
    per_layer = [(a == b).all(dim=-1) for a, b in zip(ref["ids"], got["ids"])]
    same = torch.cat(per_layer)
    agree = torch.stack(per_layer).all(dim=0).view(*TOKENS)  # tokens routed alike in every layer
    grads = [(a.float() - b.float()).abs().max().item() for a, b in zip(_hf_grads(hf), _titan_grads(titan))]
    r = {"tokens_routed": same.numel(), "routing_agreement": same.float().mean().item(),
         "out_max_abs_diff": (ref["out"] - got["out"]).abs().max().item(), "out_scale": ref["out"].abs().max().item(),
         "moe_out_scale": ref["moe_scale"],
         "out_max_abs_diff_same_routing": (ref["out"] - got["out"])[agree].abs().max().item(),
         "x_grad_max_abs_diff": (ref["x_grad"] - got["x_grad"]).abs().max().item(),
         "weight_grad_max_abs_diff": max(grads), "layers_routed": len(got["ids"]),
         "agreement_by_layer": [round(x.float().mean().item(), 4) for x in per_layer]}
    print(f"\n[moe parity {str(dtype).removeprefix('torch.')}] " + ", ".join(f"{k}={v}" for k, v in r.items()))
    return r


def test_float32_routing_identical_and_values_within_1e5():
    r = _compare(torch.float32)
    assert r["layers_routed"] == LAYERS and r["tokens_routed"] == LAYERS * TOKENS[0] * TOKENS[1]
    assert r["routing_agreement"] == 1.0, r
    assert r["out_max_abs_diff"] <= TOL_FP32, r
    assert r["x_grad_max_abs_diff"] <= TOL_FP32, r
    assert r["weight_grad_max_abs_diff"] <= TOL_FP32, r
    assert r["moe_out_scale"] > 0.1  # the blocks change the hidden states: a diff of 1e-5 is meaningful


def test_bfloat16_routing_agreement():
    r = _compare(torch.bfloat16)
    assert r["routing_agreement"] >= MIN_AGREEMENT_BF16, r
    # where a token's routing differs somewhere, its output differs by that expert's share
    assert r["out_max_abs_diff"] <= 5e-2 * r["out_scale"], r
    # where it agrees in every layer, by rounding: at most 2 units in the last place of bfloat16 (8
    # significant bits) at the outputs' magnitude
    ulp = 2.0 ** (math.floor(math.log2(r["out_scale"])) - 7)
    assert r["out_max_abs_diff_same_routing"] <= 2 * ulp, r


def test_grouped_op_alone_against_transformers_experts():
    """The op and transformers' experts given the same routing (transformers' router, with expert 5
    left without tokens), one layer, forward and backward in float32 (input, scores, weights); the
    expert without tokens gets exactly zero gradient on both sides."""
    hf = _hf_blocks(seed=3)[0]
    x, out_grad = _inputs(torch.float32)
    x, out_grad = x.reshape(-1, DIM), out_grad.reshape(-1, DIM)

    def route(x):  # Qwen3MoeTopKRouter's arithmetic, expert 5 excluded
        probs = torch.softmax(torch.nn.functional.linear(x, hf.gate.weight).index_fill(1, torch.tensor([5]), -1e9),
                              dim=-1, dtype=torch.float)
        top, ids = probs.topk(TOP_K, dim=-1)
        return top / top.sum(-1, keepdim=True), ids

    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    scores_r, ids = route(xr)
    out_r = hf.experts(xr, ids, scores_r)
    (out_r * out_grad).sum().backward()
    w1 = hf.experts.gate_up_proj.detach()[:, :MOE_HIDDEN].clone().requires_grad_()
    w3 = hf.experts.gate_up_proj.detach()[:, MOE_HIDDEN:].clone().requires_grad_()
    w2 = hf.experts.down_proj.detach().clone().requires_grad_()
    scores_o, ids_o = route(xo)
    out_o, counts = grouped_experts(xo, scores_o, ids_o, w1, w2, w3, compute_dtype=torch.float32)
    (out_o * out_grad).sum().backward()
    assert counts[5] == 0 and counts.sum() == x.shape[0] * TOP_K and torch.equal(ids, ids_o)
    assert (out_r - out_o).abs().max().item() <= TOL_FP32
    assert (xr.grad - xo.grad).abs().max().item() <= TOL_FP32  # through the experts and the scores
    gate_up = torch.cat([w1.grad, w3.grad], dim=1)
    assert (hf.experts.gate_up_proj.grad - gate_up).abs().max().item() <= TOL_FP32
    assert (hf.experts.down_proj.grad - w2.grad).abs().max().item() <= TOL_FP32
    assert w1.grad[5].abs().max() == 0 and hf.experts.gate_up_proj.grad[5].abs().max() == 0


def test_agreement_measure_sees_a_different_router():
    """The check can fail: a block whose router rows are permuted routes other experts, and the
    agreement measure sees it."""
    hf = _hf_blocks()[:1]
    titan = _titan_blocks(hf, "float32")
    with torch.no_grad():
        titan[0].router.gate.weight.copy_(titan[0].router.gate.weight.roll(1, dims=0))
        x, _ = _inputs(torch.float32)
        ref, got = _ids(hf[0].gate(x.reshape(-1, DIM))), _ids(titan[0].router(x))
    assert (ref == got).all(dim=-1).float().mean() < 0.1
