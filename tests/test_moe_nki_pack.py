"""common/kernels/moe_nki.py on CPU: what surrounds the NKI MoE kernels, through the very functions Trainium runs.

The two kernels are replaced here by PyTorch references written from their documented contract in
aws-neuron/nki-library (experimental/moe/forward/bwmm_shard_on_H.py: docstring pseudocode, POST_SCALE;
experimental/moe/bwd/bwmm_bwd_dropless.py: the step list and its Notes; the integration tests' golden functions
in test/integration/nkilib/experimental/moe/). pack -> reference -> unpack must equal the grouped-expert op's
forward and gradients (x, router scores, w1, w2, w3): float32 within 1e-5, bfloat16 within 2e-2 of the largest
value (nki-library's own relative tolerance for the forward kernel against its golden), several expert counts and
top-k, an expert without tokens, blocks with padding slots, full blocks and a block of padding only. The routing
tables (token slots, block_to_expert, counts) have static shapes: they trace as one graph under torch.compile and
equal, index for index, the data-dependent formulation they replace.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from common import device
from common.errors import UserError
from common.harness import preflight
from common.kernels import moe_nki
from common.kernels.moe_op import grouped_experts


def blockwise_fwd_reference(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                            block_size, token_position_to_id, block_to_expert, gate_up_activations_T=None,
                            down_activations=None, is_tensor_update_accumulating=True, returns="output", **_constants):
    """blockwise_mm_baseline_shard_hidden, per its docstring: for each block of one expert, gather the block's
    tokens, gate/up projections (float32 accumulation, checkpointed transposed [2, I, B] in the io dtype),
    silu(gate) * up, down projection (checkpointed before scaling), times the token's affinity for the block's
    expert, added into output[token]. `returns`: "output" (nki-library 2026-04: checkpoints written into the
    buffers passed in, those that are not None; pack_forward passes none) or, writing no buffer passed in (as a
    non-aliased NKI V2 kernel would): "tuple" -> (output, gate_up_activations_T), "triple" -> (output,
    gate_up_activations_T, down_activations)."""
    T1, H = hidden_states.shape
    E, I = down_proj_weight.shape[:2]
    N = token_position_to_id.numel() // block_size
    dt = hidden_states.dtype
    aff = expert_affinities_masked.reshape(T1, E).float()
    out = torch.zeros(T1, H, dtype=dt)
    gate_up_out = gate_up_activations_T if returns == "output" else torch.zeros(N, 2, I, block_size, dtype=dt)
    down_out = down_activations if returns == "output" else torch.zeros(N, block_size, H, dtype=dt)
    for b, tok in enumerate(token_position_to_id.long().view(-1, block_size)):
        e = int(block_to_expert[b])
        gu = hidden_states[tok].float() @ gate_up_proj_weight[e].float().reshape(H, 2 * I)  # [B, 2I]
        gate, up = gu[:, :I], gu[:, I:]
        if gate_up_out is not None:
            gate_up_out[b] = torch.stack([gate.t(), up.t()]).to(dt)
        down = (F.silu(gate) * up).to(dt).float() @ down_proj_weight[e].float()  # [B, H]
        if down_out is not None:
            down_out[b] = down.to(dt)
        scaled = (down * aff[tok, e, None]).to(dt)
        if is_tensor_update_accumulating:
            out.index_add_(0, tok, scaled)
        else:
            out[tok] = scaled
    return {"output": out, "tuple": (out, gate_up_out), "triple": (out, gate_up_out, down_out)}[returns]


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


@pytest.mark.parametrize("returns", ["output", "tuple", "triple"])
@pytest.mark.parametrize("cd", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T, E, K, block, unused", [
    (48, 8, 4, 8, (3,)),      # several blocks per expert, an expert without tokens
    (40, 16, 2, 128, ()),     # the kernel's smallest block: every block mostly padding
    (24, 4, 1, 16, (0,)),     # top-1 (no accumulation), one expert without tokens
])
def test_pack_reference_unpack_equals_the_op(cd, T, E, K, block, unused, returns):
    """Every form of the forward, none given a buffer: "output" (both checkpoints recomputed), "tuple" (gate/up
    returned, down recomputed), "triple" (both returned)."""
    x, scores, ids, (w1, w2, w3), grad = _case(T, 32, 64, E, K, seed=T + E + K, unused=unused)
    assert not torch.isin(torch.tensor(unused, dtype=torch.long), ids).any()
    _assert_close(_packed(x, scores, ids, w1, w2, w3, grad, cd, block, returns),
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


def _data_dependent_tables(expert_ids, E, block):
    """The routing tables as this file's module first built them, with data-dependent shapes (bincount, one_hot,
    a boolean-mask store, repeat_interleave without output_size): (token slots, block_to_expert, counts), the
    reference the static-shape builders must match index for index."""
    T, K = expert_ids.shape
    n = moe_nki.num_blocks(T, K, E, block)
    counts = torch.bincount(expert_ids.reshape(-1), minlength=E).to(torch.int32)
    per_expert = torch.ceil(counts.float() / block).long()
    mask = F.one_hot(expert_ids, E).sum(1)  # [T, E]
    pos = torch.cumsum(mask, 0)
    pos[:, 1:] += (torch.cumsum(per_expert, 0) * block)[:-1]
    pos[mask == 0] = 0
    slots = torch.full((n * block + 1,), -1, dtype=torch.long)
    slots[pos] = torch.arange(T)[:, None].expand(T, E)
    slots = slots[1:].masked_fill(slots[1:] == -1, T).to(torch.int32)
    per_expert[-1] += n - per_expert.sum()
    b2e = torch.repeat_interleave(torch.arange(E), per_expert).to(torch.int32)
    return slots, b2e, counts


ROUTING_SHAPES = [(48, 8, 4, 8), (40, 16, 2, 128), (24, 4, 1, 16), (300, 32, 8, 16), (64, 8, 2, 8)]  # T, E, K, B


def _routings():
    """Five seeded routings for each of ROUTING_SHAPES: router logits with a growing bias toward the first
    experts (seed 0: none), so experts go from evenly loaded to several blocks each or none at all; and one
    routing of exactly full blocks (two experts, one block each, a spare block of padding only)."""
    for T, E, K, block in ROUTING_SHAPES:
        for seed in range(5):
            g = torch.Generator().manual_seed(seed)
            logits = torch.randn(T, E, generator=g) - 2.0 * seed * torch.arange(E) / E
            yield f"T{T}-E{E}-K{K}-B{block}-seed{seed}", logits.topk(K, dim=-1).indices, E, block
    yield "full-blocks", torch.tensor([[0]] * 8 + [[1]] * 8), 2, 8


def test_static_shape_tables_equal_the_data_dependent_ones():
    """pack_forward's token slots, block_to_expert and counts, and the backward's block_to_expert from those
    counts, equal the data-dependent formulation index for index on 26 routings (ROUTING_SHAPES x 5 seeds and
    the full-block case), among them experts without tokens, experts of several blocks and padding-only blocks."""
    x_dim, inter = 4, 8
    seen_empty = seen_multi = seen_padding_only = 0
    for name, ids, E, block in _routings():
        T, K = ids.shape
        w = [torch.zeros(s) for s in ((E, inter, x_dim), (E, x_dim, inter), (E, inter, x_dim))]
        args, counts = moe_nki.pack_forward(torch.zeros(T, x_dim), torch.ones(T, K), ids, *w, torch.float32, block)
        slots, b2e, ref_counts = _data_dependent_tables(ids, E, block)
        n = moe_nki.num_blocks(T, K, E, block)
        for got, ref, what in ((args["token_position_to_id"], slots, "token slots"),
                               (args["block_to_expert"].view(-1), b2e, "block_to_expert"),
                               (moe_nki.block_to_expert(counts, n, block), b2e, "backward block_to_expert"),
                               (counts, ref_counts, "counts")):
            assert got.dtype == ref.dtype == torch.int32 and torch.equal(got, ref), f"{name}: {what}"
        seen_empty += int((counts == 0).any())
        seen_multi += int((counts > block).any())
        seen_padding_only += int((slots.view(-1, block) == T).all(1).any())
    assert seen_empty and seen_multi and seen_padding_only


def test_the_routing_tables_trace_as_one_graph():
    """pack_forward (token slots, block_to_expert, counts) and pack_backward (block_to_expert from the saved
    counts) trace under torch.compile(fullgraph=True, dynamic=False), which raises at any graph break: no
    data-dependent shape, no host sync. The compiled tables equal the eager ones."""
    T, E, K, block = 40, 8, 2, 16
    x, scores, ids, (w1, w2, w3), grad = _case(T, 32, 64, E, K, seed=11, unused=(5,))
    compile_ = lambda f: torch.compile(f, fullgraph=True, dynamic=False, backend="aot_eager")  # noqa: E731
    args, counts = compile_(moe_nki.pack_forward)(x, scores, ids, w1, w2, w3, torch.float32, block)
    eager_args, eager_counts = moe_nki.pack_forward(x, scores, ids, w1, w2, w3, torch.float32, block)
    for name in ("token_position_to_id", "block_to_expert"):
        assert torch.equal(args[name], eager_args[name]), name
    assert torch.equal(counts, eager_counts)
    n = args["block_to_expert"].shape[0]
    saved = (args["token_position_to_id"].long(), counts, torch.zeros(n, 2, 64, block), torch.zeros(n, block, 32))
    bwd = compile_(moe_nki.pack_backward)(grad, x, scores, ids, w1, w2, w3, *saved, torch.float32)
    assert torch.equal(bwd["block_to_expert"], eager_args["block_to_expert"])


def _written_checkpoints(args):
    """The checkpoints an aliasing kernel writes: the reference given a buffer for each."""
    n, block = args["block_to_expert"].shape[0], args["block_size"]
    I, H, cd = args["down_proj_weight"].shape[1], args["hidden_states"].shape[1], args["hidden_states"].dtype
    gate_up, down = torch.zeros(n, 2, I, block, dtype=cd), torch.zeros(n, block, H, dtype=cd)
    blockwise_fwd_reference(**dict(args, gate_up_activations_T=gate_up, down_activations=down))
    return gate_up, down


def _padding(args, tokens):
    """[N, B]: the slots that point at the padding row T."""
    return args["token_position_to_id"].view(-1, args["block_size"]) == tokens


@pytest.mark.parametrize("returns", ["tuple", "triple"])
def test_the_forward_is_given_no_buffer_and_the_non_aliasing_forms_write_none(returns):
    """pack_forward asks the kernel for no checkpoint (both keywords kept, None: the preflight keyword rows list
    them); the non-aliasing forms write no buffer even when given one; so nothing is read from a buffer."""
    x, scores, ids, (w1, w2, w3), _ = _case(40, 32, 64, 8, 2, seed=7)
    args, _ = moe_nki.pack_forward(x, scores, ids, w1, w2, w3, torch.float32, 16)
    assert {"gate_up_activations_T", "down_activations"} <= set(args)
    assert args["gate_up_activations_T"] is None and args["down_activations"] is None
    given = {name: torch.zeros_like(t) for name, t in zip(moe_nki.CHECKPOINTS, _written_checkpoints(args))}
    result = blockwise_fwd_reference(**dict(args, **given), returns=returns)
    assert not any(t.any() for t in given.values())  # untouched
    assert all(t.any() for t in result[1:])
    for form in ("output", returns):
        unpacked = moe_nki.unpack_forward(blockwise_fwd_reference(**args, returns=form), args, 40, torch.float32)
        assert unpacked[3] == {}  # nothing read from a buffer: nothing for check_checkpoints_once to sync on


@pytest.mark.parametrize("cd", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_recomputed_checkpoints_are_what_the_kernel_writes(cd):
    """recompute_gate_up_activations (from the kernel's inputs) and recompute_down_activations (from the gate/up
    checkpoint) equal what the aliasing reference writes into its buffers, padding slots (row T: zeros) included."""
    x, scores, ids, (w1, w2, w3), _ = _case(40, 32, 64, 8, 2, seed=7, unused=(5,))
    args, _ = moe_nki.pack_forward(x, scores, ids, w1, w2, w3, cd, 16)
    gate_up, down = _written_checkpoints(args)
    ours_gate_up = moe_nki.recompute_gate_up_activations(args["hidden_states"], args["gate_up_proj_weight"],
                                                         args["token_position_to_id"], args["block_to_expert"])
    ours_down = moe_nki.recompute_down_activations(ours_gate_up, args["down_proj_weight"], args["block_to_expert"],
                                                   cd)
    padding = _padding(args, x.shape[0])
    assert padding.any() and (~padding).any()
    for ours, written in ((ours_gate_up, gate_up), (ours_down, down)):
        assert ours.shape == written.shape and ours.dtype == cd and ours.is_contiguous()
        tol = 1e-6 if cd == torch.float32 else 2e-2 * written.float().abs().max().item()
        assert (ours.float() - written.float()).abs().max().item() <= tol  # every slot, padding included
    assert not ours_gate_up.permute(0, 3, 1, 2)[padding].any() and not ours_down[padding].any()


@pytest.mark.parametrize("recompute, forms, first_wrong", [
    ("recompute_down_activations", ("output", "tuple"), "scores"),  # d_affinity reads the down checkpoint
    ("recompute_gate_up_activations", ("output",), "x"),  # d_hidden reads the gate/up checkpoint (not the down one)
])
def test_zeros_in_place_of_a_recomputed_checkpoint_break_the_gradients(monkeypatch, recompute, forms, first_wrong):
    """Each recompute is what makes the backward right: with zeros in its place (in every form that recomputes
    it) the gradients no longer match the op's."""
    x, scores, ids, (w1, w2, w3), grad = _case(32, 32, 64, 8, 2, seed=5)
    ref = _op(x, scores, ids, w1, w2, w3, grad, torch.float32)
    real = getattr(moe_nki, recompute)
    monkeypatch.setattr(moe_nki, recompute, lambda *a: torch.zeros_like(real(*a)))
    for returns in forms:
        with pytest.raises(AssertionError, match=f"^{first_wrong}: max abs diff"):
            _assert_close(_packed(x, scores, ids, w1, w2, w3, grad, torch.float32, 16, returns), ref, torch.float32)


@pytest.mark.parametrize("returns, not_called", [
    ("tuple", ("recompute_gate_up_activations",)),
    ("triple", ("recompute_gate_up_activations", "recompute_down_activations")),
])
def test_a_returned_checkpoint_is_used(monkeypatch, returns, not_called):
    """A forward returning (output, gate_up_activations_T[, down_activations]), as nki-library's moe_cte kernels
    do: what it returns is used, not recomputed."""
    x, scores, ids, (w1, w2, w3), grad = _case(32, 32, 64, 8, 2, seed=5)
    for name in not_called:
        monkeypatch.setattr(moe_nki, name, None)  # a call would raise
    _assert_close(_packed(x, scores, ids, w1, w2, w3, grad, torch.float32, 16, returns),
                  _op(x, scores, ids, w1, w2, w3, grad, torch.float32), torch.float32)


@pytest.mark.parametrize("form", ["output-only", "returns-the-buffer"])
def test_a_checkpoint_read_from_a_buffer_the_kernel_never_wrote_stops_the_first_step(monkeypatch, form):
    """The guard, for a checkpoint still read from a buffer passed in (none from pack_forward): a packing that
    passes a gate/up buffer, and a kernel that hands it back untouched (returning only `output`, or returning
    the buffer itself) stop the first call; a kernel that writes it passes the check."""
    x, scores, ids, (w1, w2, w3), _ = _case(16, 32, 64, 4, 2, seed=2)
    pack = moe_nki.pack_forward

    def pack_with_a_buffer(*a, **k):
        args, counts = pack(*a, **k)
        n, I = args["block_to_expert"].shape[0], args["down_proj_weight"].shape[1]
        return dict(args, gate_up_activations_T=torch.zeros(n, 2, I, args["block_size"])), counts

    def kernel(writes):
        def forward(**a):
            out = blockwise_fwd_reference(**(a if writes else dict(a, gate_up_activations_T=None)))
            return out if form == "output-only" else (out, a["gate_up_activations_T"])
        return forward

    monkeypatch.setattr(moe_nki, "pack_forward", pack_with_a_buffer)
    with pytest.raises(RuntimeError, match=r"activation checkpoint\(s\) gate_up_activations_T all zeros"):
        moe_nki.run_forward(kernel(writes=False), {}, x, scores, ids, w1, w2, w3, torch.float32, 16)
    assert not moe_nki._checkpoints_checked
    out = moe_nki.run_forward(kernel(writes=True), {}, x, scores, ids, w1, w2, w3, torch.float32, 16)
    assert moe_nki._checkpoints_checked and out[3].any() and out[5].any()


class _KernelObject:
    """Stands in, in these tests only, for the object a jit decorator returns: callable, the function in `func`
    (as nki-library's test utilities find it), the decorator's options kept. No module is replaced."""

    def __init__(self, func, **options):
        self.func, self.options = func, options

    def __call__(self, **args):
        return self.func(**args)


def _stand_in_jit(fn=None, **options):
    """Stands in for nki.jit, passed to moe_nki.launchable by argument: `@_stand_in_jit` and
    `@_stand_in_jit(mode=...)` both give a _KernelObject."""
    return _KernelObject(fn, **options) if fn is not None else (lambda f: _KernelObject(f, **options))


@_stand_in_jit(mode="trace")
def _forward_jitted_with_a_mode(**args):
    return blockwise_fwd_reference(**args)


def _backward_as_a_plain_function(**args):
    return blockwise_bwd_reference(**args)


def test_launch_takes_a_kernel_object_as_it_is_and_wraps_a_plain_function():
    """launchable: the object a jit decorator made (here with mode="trace", as nki-library's forward) is launched
    as it is; a plain function is wrapped with the jit given (nki.jit on Trainium), with no mode. jit_form names
    the two forms for the preflight. Both launched kernels then run the packing path end to end."""
    fwd = moe_nki.launchable(_forward_jitted_with_a_mode, _stand_in_jit)
    bwd = moe_nki.launchable(_backward_as_a_plain_function, _stand_in_jit)
    assert fwd is _forward_jitted_with_a_mode and fwd.options == {"mode": "trace"}
    assert isinstance(bwd, _KernelObject) and bwd.func is _backward_as_a_plain_function and bwd.options == {}
    assert preflight.jit_form(_forward_jitted_with_a_mode) == (
        "jit kernel object (_KernelObject), launched as it is; declared @_stand_in_jit(mode='trace')")
    assert preflight.jit_form(_backward_as_a_plain_function) == "plain function, wrapped with nki.jit at launch"
    assert preflight.jit_form(_KernelObject(len)).endswith("declaration not readable")  # no Python function inside
    x, scores, ids, (w1, w2, w3), grad = _case(32, 32, 64, 8, 2, seed=5)
    fwd_out = moe_nki.run_forward(fwd, {}, x, scores, ids, w1, w2, w3, torch.float32, 16)
    grads = moe_nki.run_backward(bwd, {}, grad, x, scores, ids, w1, w2, w3, *fwd_out[1:], torch.float32)
    _assert_close((fwd_out[0], list(grads)), _op(x, scores, ids, w1, w2, w3, grad, torch.float32), torch.float32)


@pytest.mark.skipif(device.neuron_installed(), reason="names the installed kernels where torch-neuronx is installed")
def test_kernel_jit_form_without_torch_neuronx_imports_no_kernel():
    assert preflight.kernel_jit_form() == "not checked: torch-neuronx is not installed"
    assert "nkilib" not in sys.modules and "nki" not in sys.modules


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
