"""common/kernels/moe_nki.py on CPU: what surrounds the NKI MoE kernels, through the very functions Trainium runs.

The two kernels are replaced here by PyTorch references written from their documented contract in
aws-neuron/nki-library (experimental/moe/forward/bwmm_shard_on_H.py: docstring pseudocode, POST_SCALE;
experimental/moe/bwd/bwmm_bwd_dropless.py: the step list and its Notes; the integration tests' golden functions
in test/integration/nkilib/experimental/moe/). pack -> reference -> unpack must equal the grouped-expert op's
forward and gradients (x, router scores, w1, w2, w3): float32 within 1e-5, bfloat16 within 2e-2 of the largest
value (nki-library's own relative tolerance for the forward kernel against its golden), several expert counts and
top-k, an expert without tokens, blocks with padding slots, full blocks and a block of padding only.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.errors import UserError
from common.kernels import moe_nki
from common.kernels.moe_op import grouped_experts


def blockwise_fwd_reference(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                            block_size, token_position_to_id, block_to_expert, gate_up_activations_T=None,
                            down_activations=None, is_tensor_update_accumulating=True, returns="output", **_constants):
    """blockwise_mm_baseline_shard_hidden, per its docstring: for each block of one expert, gather the block's
    tokens, gate/up projections (float32 accumulation, checkpointed transposed [2, I, B] in the io dtype),
    silu(gate) * up, down projection (checkpointed before scaling), times the token's affinity for the block's
    expert, added into output[token]. `returns`: "output" (nki-library 2026-04: checkpoints written into the
    buffers passed in) or "tuple" (newer copies: (output, gate_up_activations_T) returned, the gate/up buffer
    passed in left untouched, as a non-aliased NKI V2 buffer would be)."""
    T1, H = hidden_states.shape
    E, I = down_proj_weight.shape[:2]
    dt = hidden_states.dtype
    aff = expert_affinities_masked.reshape(T1, E).float()
    out = torch.zeros(T1, H, dtype=dt)
    gate_up_out = torch.zeros_like(gate_up_activations_T) if returns == "tuple" else gate_up_activations_T
    for b, tok in enumerate(token_position_to_id.long().view(-1, block_size)):
        e = int(block_to_expert[b])
        gu = hidden_states[tok].float() @ gate_up_proj_weight[e].float().reshape(H, 2 * I)  # [B, 2I]
        gate, up = gu[:, :I], gu[:, I:]
        gate_up_out[b] = torch.stack([gate.t(), up.t()]).to(dt)
        down = (F.silu(gate) * up).to(dt).float() @ down_proj_weight[e].float()  # [B, H]
        down_activations[b] = down.to(dt)
        scaled = (down * aff[tok, e, None]).to(dt)
        if is_tensor_update_accumulating:
            out.index_add_(0, tok, scaled)
        else:
            out[tok] = scaled
    return (out, gate_up_out) if returns == "tuple" else out


def blockwise_bwd_reference(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                            gate_up_proj_act_checkpoint_T, down_proj_act_checkpoint, token_position_to_id,
                            block_to_expert, output_hidden_states_grad, block_size, drop=None, **_constants):
    """blockwise_mm_bwd (dropless, SiLU, no bias, no clamp), per its step list: affinity gradient = sum over H of
    upstream gradient x down checkpoint; down-output gradient = upstream x affinity; through silu(gate) * up from
    the gate/up checkpoint; weight gradients summed over the expert's blocks; hidden-state gradients scattered to
    the tokens. float32 math, outputs in the inputs' dtypes. `drop` removes one named term (the tests' own check
    that a dropped gradient term is caught)."""
    T1, H = hidden_states.shape
    E, I = down_proj_weight.shape[:2]
    aff = expert_affinities_masked.reshape(T1, E).float()
    d_hidden = torch.zeros(T1, H)
    d_aff = torch.zeros(T1, E)
    d_gate_up = torch.zeros(E, H, 2 * I)
    d_down = torch.zeros(E, I, H)
    for b, tok in enumerate(token_position_to_id.long().view(-1, block_size)):
        e = int(block_to_expert[b])
        grad = output_hidden_states_grad[tok].float()
        d_aff[tok, e] = (grad * down_proj_act_checkpoint[b].float()).sum(-1)
        d_out = grad * aff[tok, e, None]
        gate, up = gate_up_proj_act_checkpoint_T[b].float().transpose(1, 2)  # [2, I, B] -> 2 x [B, I]
        d_down[e] += (F.silu(gate) * up).t() @ d_out
        d_act = d_out @ down_proj_weight[e].float().t()
        sig = torch.sigmoid(gate)
        d_gate = d_act * up * sig * (1 + gate * (1 - sig))
        d_up = torch.zeros_like(d_act) if drop == "up" else d_act * F.silu(gate)
        d_gu = torch.cat([d_gate, d_up], dim=-1)  # [B, 2I]
        d_gate_up[e] += hidden_states[tok].float().t() @ d_gu
        d_hidden.index_add_(0, tok, d_gu @ gate_up_proj_weight[e].float().reshape(H, 2 * I).t())
    return (d_hidden.to(hidden_states.dtype), d_aff.reshape(-1, 1).to(expert_affinities_masked.dtype),
            d_gate_up.reshape(E, H, 2, I).to(gate_up_proj_weight.dtype), d_down.to(down_proj_weight.dtype))


@pytest.fixture(autouse=True)
def _fresh_checkpoint_check(monkeypatch):
    monkeypatch.setattr(moe_nki, "_checkpoints_checked", False)  # each test is a "first step"


def _case(T, D, F_, E, K, seed, unused=(), ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    logits = torch.randn(T, E, generator=g)
    if unused:
        logits[:, list(unused)] = -1e4
    scores, top = F.softmax(logits, -1).topk(K, dim=-1)
    ids = top if ids is None else ids
    w = [0.1 * torch.randn(s, generator=g) for s in ((E, F_, D), (E, D, F_), (E, F_, D))]
    return x, (scores / scores.sum(-1, keepdim=True)), ids, w, torch.randn(T, D, generator=g)


def _op(x, scores, ids, w1, w2, w3, grad, cd):
    """The grouped-expert op (PyTorch path) with autograd: out and the gradients of x, scores, w1, w2, w3."""
    leaves = [t.clone().requires_grad_() for t in (x, scores, w1, w2, w3)]
    out, _ = grouped_experts(leaves[0], leaves[1], ids, *leaves[2:], compute_dtype=cd)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def _packed(x, scores, ids, w1, w2, w3, grad, cd, block, returns="output", drop=None):
    """The Trainium branch's own pack/unpack code, with the references in place of the kernels."""
    fwd = moe_nki.run_forward(lambda **a: blockwise_fwd_reference(**a, returns=returns), {}, x, scores, ids,
                              w1, w2, w3, cd, block)
    out, saved = fwd[0], fwd[1:]
    grads = moe_nki.run_backward(lambda **a: blockwise_bwd_reference(**a, drop=drop), {}, grad, x, scores, ids,
                                 w1, w2, w3, *saved, cd)
    return out, list(grads)


def _assert_close(ours, ref, cd):
    names = ["out", "x", "scores", "w1", "w2", "w3"]
    for name, a, b in zip(names, [ours[0], *ours[1]], [ref[0], *ref[1]]):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        err = (a.float() - b.float()).abs().max().item()
        tol = 1e-5 if cd == torch.float32 else 2e-2 * b.float().abs().max().item()
        assert err <= tol, f"{name}: max abs diff {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("cd", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T, E, K, block, unused", [
    (48, 8, 4, 8, (3,)),      # several blocks per expert, an expert without tokens
    (40, 16, 2, 128, ()),     # the kernel's smallest block: every block mostly padding
    (24, 4, 1, 16, (0,)),     # top-1 (no accumulation), one expert without tokens
])
def test_pack_reference_unpack_equals_the_op(cd, T, E, K, block, unused):
    x, scores, ids, (w1, w2, w3), grad = _case(T, 32, 64, E, K, seed=T + E + K, unused=unused)
    assert not torch.isin(torch.tensor(unused, dtype=torch.long), ids).any()
    _assert_close(_packed(x, scores, ids, w1, w2, w3, grad, cd, block),
                  _op(x, scores, ids, w1, w2, w3, grad, cd), cd)


def test_full_blocks_and_a_padding_only_block():
    """Two experts of exactly one full block each; the spare block (num_blocks' worst case) goes to the last
    expert and holds only padding slots."""
    T, block = 16, 8
    ids = torch.tensor([[0]] * 8 + [[1]] * 8)
    x, scores, ids, (w1, w2, w3), grad = _case(T, 32, 64, 2, 1, seed=3, ids=ids)
    args, counts = moe_nki.pack_forward(x, torch.ones(T, 1), ids, w1, w2, w3, torch.float32, block)
    slots = args["token_position_to_id"].view(-1, block)
    assert slots.shape[0] == 3 and (slots[2] == T).all() and (slots[:2] != T).all()
    assert args["block_to_expert"].view(-1).tolist() == [0, 1, 1]
    _assert_close(_packed(x, torch.ones(T, 1), ids, w1, w2, w3, grad, torch.float32, block),
                  _op(x, torch.ones(T, 1), ids, w1, w2, w3, grad, torch.float32), torch.float32)


def test_kernel_input_layouts():
    x, scores, ids, (w1, w2, w3), _ = _case(10, 32, 64, 4, 2, seed=1)
    args, counts = moe_nki.pack_forward(x, scores, ids, w1, w2, w3, torch.float32, 128)
    hidden, aff = args["hidden_states"], args["expert_affinities_masked"].view(11, 4)
    assert torch.equal(hidden[:10], x) and not hidden[10].any()  # padding row T
    assert torch.equal(aff[:10].gather(1, ids), scores) and int((aff != 0).sum()) == 20 and not aff[10].any()
    assert torch.equal(args["gate_up_proj_weight"][:, :, 0], w1.transpose(1, 2))  # [E, H, 2, I]
    assert torch.equal(args["gate_up_proj_weight"][:, :, 1], w3.transpose(1, 2))
    assert torch.equal(args["down_proj_weight"], w2.transpose(1, 2))  # [E, I, H]
    assert args["block_to_expert"].shape == (moe_nki.num_blocks(10, 2, 4, 128), 1)
    assert counts.tolist() == torch.bincount(ids.flatten(), minlength=4).tolist()


def test_returned_checkpoint_form_is_used():
    """Newer nki-library returns (output, gate_up_activations_T); the op must take that checkpoint (the buffer
    passed in stays zeros, as a non-aliased NKI V2 buffer would)."""
    x, scores, ids, (w1, w2, w3), grad = _case(32, 32, 64, 8, 2, seed=5)
    _assert_close(_packed(x, scores, ids, w1, w2, w3, grad, torch.float32, 16, returns="tuple"),
                  _op(x, scores, ids, w1, w2, w3, grad, torch.float32), torch.float32)


def test_a_checkpoint_the_kernel_never_wrote_stops_the_first_step():
    x, scores, ids, (w1, w2, w3), _ = _case(16, 32, 64, 4, 2, seed=2)

    def writes_nothing(**a):  # output only; the checkpoint buffers come back as they went in
        a = dict(a, gate_up_activations_T=torch.zeros_like(a["gate_up_activations_T"]),
                 down_activations=torch.zeros_like(a["down_activations"]))
        return blockwise_fwd_reference(**a)

    with pytest.raises(RuntimeError, match="gate_up_activations_T, down_activations all zeros"):
        moe_nki.run_forward(writes_nothing, {}, x, scores, ids, w1, w2, w3, torch.float32, 16)
    out = moe_nki.run_forward(lambda **a: blockwise_fwd_reference(**a), {}, x, scores, ids, w1, w2, w3,
                              torch.float32, 16)
    assert moe_nki._checkpoints_checked and out[3].any()


@pytest.mark.parametrize("hidden, inter, dtype, lnc, block, needles", [
    (64, 32, torch.float32, 2, 512, ["moe_intermediate_size) 32", "compute dtype torch.float32"]),  # tiny preset
    (2048, 768, torch.bfloat16, 1, 512, ["LNC=1"]),
    (2080, 768, torch.bfloat16, 2, 96, ["hidden size 2080", "block size 96"]),
])
def test_kernel_shape_rules(hidden, inter, dtype, lnc, block, needles):
    with pytest.raises(UserError) as e:
        moe_nki.check_nki_shapes(hidden, inter, dtype, lnc=lnc, block=block)
    assert all(n in str(e.value) for n in needles), str(e.value)
    assert moe_nki.check_nki_shapes(2048, 768, torch.bfloat16, lnc=2) == 2  # Qwen3-30B-A3B's experts


def test_the_tiny_preset_fails_preflight_with_the_rules_it_breaks():
    """train_moe_nki.py's tiny preset (hidden 64, experts 32 wide, head_dim 16, 128-token sequences, float32
    experts) cannot take the kernels: one error naming each rule; the reduced Qwen3-30B-A3B preset passes."""
    with pytest.raises(UserError) as e:
        moe_nki.check_training_shapes(seq_len=128, head_dim=16, hidden=64, inter=32, compute_dtype=torch.float32,
                                      lnc=2)
    for needle in ("sequence length 128 is not a multiple of 128 x LNC = 256", "moe_intermediate_size) 32",
                   "compute dtype torch.float32"):
        assert needle in str(e.value)
    moe_nki.check_training_shapes(seq_len=4096, head_dim=128, hidden=2048, inter=768, compute_dtype=torch.bfloat16,
                                  lnc=2)
