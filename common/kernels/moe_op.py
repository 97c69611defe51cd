"""Grouped-expert SwiGLU MLP (the routed experts of a MoE block) as a torch.library custom op
with its own backward op.

    out, counts = grouped_experts(x, scores, expert_ids, w1, w2, w3)

x [tokens, dim]; scores and expert_ids [tokens, top_k] (the router's top-k weights and choices);
w1, w3 [experts, hidden, dim] and w2 [experts, dim, hidden] (torchtitan's GroupedExperts layout,
HF's gate_proj / up_proj / down_proj per expert). For each token t:
    out[t] = sum_k scores[t, k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])),   e = expert_ids[t, k]
`counts` [experts] is how many (token, slot) pairs each expert received.

The forward groups the token copies by expert (one stable sort), runs each expert's MLP on its
contiguous group (grouped matmuls; an expert with no token gets an empty group), and saves the
routing tables (the sort order and the group sizes) and the activations (gate and up projections,
the unweighted expert outputs) that the backward op reuses; nothing is recomputed there but the
cheap row gather of x. Matmuls run in `compute_dtype` (torchtitan's stock experts use bfloat16);
the score weighting and the sum over the top-k copies run in float32, as torchtitan's combine does.

On a Neuron device the op calls nki-library's blockwise MoE kernels (common/kernels/moe_nki.py: its
packing and unpacking are tested on CPU against a reference of the kernels; the device parity test has not run);
everywhere else the PyTorch path below.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common import device
from common.errors import UserError

__all__ = ["grouped_experts", "check_expert_shapes"]


def check_expert_shapes(x, scores, expert_ids, w1, w2, w3) -> None:
    """Raise UserError for inputs the op cannot take, naming the mismatch."""
    if x.dim() != 2 or scores.dim() != 2 or expert_ids.shape != scores.shape:
        raise UserError(f"grouped experts expect x [tokens, dim] and scores/expert_ids [tokens, top_k], got "
                        f"{tuple(x.shape)}, {tuple(scores.shape)}, {tuple(expert_ids.shape)}")
    if scores.shape[0] != x.shape[0]:
        raise UserError(f"{scores.shape[0]} routing rows for {x.shape[0]} tokens")
    E, F_, D = w1.shape
    if w3.shape != w1.shape or w2.shape != (E, D, F_):
        raise UserError(f"expert weights must be w1, w3 [experts, hidden, dim] and w2 [experts, dim, hidden]; got "
                        f"{tuple(w1.shape)}, {tuple(w3.shape)}, {tuple(w2.shape)}")
    if x.shape[1] != D:
        raise UserError(f"tokens have dim {x.shape[1]} but the experts take {D}")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise UserError(f"expert_ids must be integers, got {expert_ids.dtype}")


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
    """Grouped matmul: rows of `a` in groups (ends `offs`) times b[e] ([E, k, n] -> [rows, n]), or,
    with `a` [k, rows] and b [rows, n], the per-group products [E, k, n] (weight gradients; an empty
    group gives zeros). torch._grouped_mm has CPU kernels for float32 and bfloat16; CUDA needs bf16
    on sm90+, so elsewhere the groups run one matmul each."""
    if a.device.type == "cpu" or (a.device.type == "cuda" and a.dtype == torch.bfloat16
                                  and torch.cuda.get_device_capability(a.device) >= (9, 0)):
        return torch._grouped_mm(a, b, offs=offs)
    counts = counts if counts is not None else torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    if b.dim() == 3:
        return torch.cat([g @ b[e] for e, g in enumerate(torch.split(a, counts, dim=0))])
    return torch.stack([ga @ gb for ga, gb in zip(torch.split(a, counts, dim=1), torch.split(b, counts, dim=0))])


def _routing(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the (token, slot) pairs sorted by expert, stable; tokens per expert."""
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).to(torch.int32)
    return order, counts


def _experts_torch(x, scores, expert_ids, w1, w2, w3, compute_dtype):
    T, K = scores.shape
    order, counts = _routing(expert_ids, w1.shape[0])
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // K].to(compute_dtype)  # token copies grouped by expert
    h1 = _gmm(xs, w1.to(compute_dtype).transpose(-2, -1), offs)  # gate projection
    h3 = _gmm(xs, w3.to(compute_dtype).transpose(-2, -1), offs)  # up projection
    y = _gmm(F.silu(h1) * h3, w2.to(compute_dtype).transpose(-2, -1), offs)  # unweighted expert outputs
    weighted = y.float() * scores.reshape(-1)[order].float().unsqueeze(1)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, order // K, weighted)
    return out.to(x.dtype), order, counts, h1, h3, y


def _experts_torch_bwd(grad_out, x, scores, w1, w2, w3, order, counts, h1, h3, y, compute_dtype):
    T, K = scores.shape
    tok = order // K
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    cd = compute_dtype
    gy = grad_out.float()[tok]  # gradient reaching each token copy
    s_sorted = scores.reshape(-1)[order].float()
    d_scores = torch.zeros(T * K, dtype=torch.float32, device=x.device)
    d_scores[order] = (gy * y.float()).sum(-1)
    gyw = (gy * s_sorted.unsqueeze(1)).to(cd)  # gradient of the unweighted outputs y
    silu_h1 = F.silu(h1)
    act = silu_h1 * h3
    dw2 = _gmm(gyw.t(), act, offs)  # [E, dim, hidden]
    d_act = _gmm(gyw, w2.to(cd), offs)  # [N, hidden]
    # silu'(h) = sig(h) (1 + h (1 - sig(h))), in aten's fused silu_backward (one pass, not six)
    d_h1 = torch.ops.aten.silu_backward(d_act.float() * h3.float(), h1.float()).to(cd)
    d_h3 = (d_act.float() * silu_h1.float()).to(cd)
    xs = x[tok].to(cd)
    dw1 = _gmm(d_h1.t(), xs, offs)
    dw3 = _gmm(d_h3.t(), xs, offs)
    dxs = _gmm(d_h1, w1.to(cd), offs).float() + _gmm(d_h3, w3.to(cd), offs).float()
    dx = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, dxs)
    return (dx.to(x.dtype), d_scores.view(T, K).to(scores.dtype),
            dw1.to(w1.dtype), dw2.to(w2.dtype), dw3.to(w3.dtype))


def _on_neuron(x: torch.Tensor) -> bool:
    return x.device.type == "neuron" and device.neuron_available()


@torch.library.custom_op("qwen3_recipes::grouped_experts_fwd", mutates_args=())
def grouped_experts_fwd(x: torch.Tensor, scores: torch.Tensor, expert_ids: torch.Tensor, w1: torch.Tensor,
                        w2: torch.Tensor, w3: torch.Tensor, compute_dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> out [T, D], order [T*K], counts [E], h1 and h3 [T*K, hidden], y [T*K, D] (the last five saved).
    On Trainium the saved slots hold the kernels' token slots, counts and activation checkpoints, in the kernels'
    own shapes (see common/kernels/moe_nki.py run_forward); the fake impl describes the PyTorch path's."""
    if _on_neuron(x):
        from common.kernels.moe_nki import experts_fwd_nki
        return experts_fwd_nki(x, scores, expert_ids, w1, w2, w3, compute_dtype)
    return _experts_torch(x, scores, expert_ids, w1, w2, w3, compute_dtype)


@grouped_experts_fwd.register_fake
def _(x, scores, expert_ids, w1, w2, w3, compute_dtype):
    N, (E, F_, D) = scores.numel(), w1.shape
    new = x.new_empty
    return (new(x.shape), new((N,), dtype=torch.int64), new((E,), dtype=torch.int32),
            new((N, F_), dtype=compute_dtype), new((N, F_), dtype=compute_dtype), new((N, D), dtype=compute_dtype))


@torch.library.custom_op("qwen3_recipes::grouped_experts_bwd", mutates_args=())
def grouped_experts_bwd(grad_out: torch.Tensor, x: torch.Tensor, scores: torch.Tensor, expert_ids: torch.Tensor,
                        w1: torch.Tensor,
                        w2: torch.Tensor, w3: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
                        h1: torch.Tensor, h3: torch.Tensor, y: torch.Tensor, compute_dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> gradients of x, scores, w1, w2, w3, from what the forward saved."""
    if _on_neuron(x):
        from common.kernels.moe_nki import experts_bwd_nki
        return experts_bwd_nki(grad_out, x, scores, expert_ids, w1, w2, w3, order, counts, h1, h3, y, compute_dtype)
    return _experts_torch_bwd(grad_out, x, scores, w1, w2, w3, order, counts, h1, h3, y, compute_dtype)


@grouped_experts_bwd.register_fake
def _(grad_out, x, scores, expert_ids, w1, w2, w3, order, counts, h1, h3, y, compute_dtype):
    return (torch.empty_like(x), torch.empty_like(scores), torch.empty_like(w1), torch.empty_like(w2),
            torch.empty_like(w3))


def _setup_context(ctx, inputs, output) -> None:
    x, scores, expert_ids, w1, w2, w3, compute_dtype = inputs
    _out, order, counts, h1, h3, y = output
    ctx.save_for_backward(x, scores, expert_ids, w1, w2, w3, order, counts, h1, h3, y)
    ctx.compute_dtype = compute_dtype
    ctx.mark_non_differentiable(order, counts, h1, h3, y)


def _backward(ctx, grad_out, *_unused):
    saved = ctx.saved_tensors
    dx, d_scores, dw1, dw2, dw3 = torch.ops.qwen3_recipes.grouped_experts_bwd(
        grad_out.contiguous(), *saved, ctx.compute_dtype)
    return dx, d_scores, None, dw1, dw2, dw3, None  # expert_ids are choices: no gradient


grouped_experts_fwd.register_autograd(_backward, setup_context=_setup_context)


def grouped_experts(x: torch.Tensor, scores: torch.Tensor, expert_ids: torch.Tensor, w1: torch.Tensor,
                    w2: torch.Tensor, w3: torch.Tensor, *, compute_dtype: torch.dtype | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed experts for x [tokens, dim]; returns (out [tokens, dim], tokens per expert [experts])."""
    check_expert_shapes(x, scores, expert_ids, w1, w2, w3)
    out, _order, counts, _h1, _h3, _y = torch.ops.qwen3_recipes.grouped_experts_fwd(
        x, scores, expert_ids.to(torch.int64), w1, w2, w3, compute_dtype or w1.dtype)
    return out, counts
