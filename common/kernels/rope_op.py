"""Rotary position embedding (RoPE) as a torch.library custom op with its own backward op.

On a Trainium device the op runs nki-library's `rope_hf` kernel
(https://github.com/aws-neuron/nki-library, src/nkilib_src/nkilib/core/embeddings/rope_hf.py);
everywhere else it runs the same math in PyTorch, so CPU runs and tests exercise the very op,
autograd wiring and shape checks that Trainium runs.

    q_out, k_out = rope(q, k, rope_cache)            # q, k: [batch, seq, heads, head_dim]

`rope_cache` is `[seq, head_dim * 2]` = cat(cos, sin) for the positions being rotated: the rows of
torchtitan's `CosSinRoPE.cache` for those positions (the caller slices them, e.g.
`cache[start:start + seq]`), or `[batch, seq, head_dim * 2]` when each sequence has positions of its
own (packed documents). q and k may have different head counts (grouped-query attention).

Math (rotate-half convention of HF Llama/Qwen3 and torchtitan's CosSinRoPE), h = head_dim / 2:
    forward   y  = x * cos + rotate_half(x) * sin,            rotate_half(x) = cat(-x[..., h:], x[..., :h])
    backward  dx = g * cos + rotate_half_backward(g * sin),   rotate_half_backward(x) = cat(x[..., h:], -x[..., :h])
The cache is a constant table of the positions, so it gets no gradient (the backward returns None).

Numerics. The PyTorch path computes in float32 and rounds once (bit-equal to torchtitan's CosSinRoPE). rope_hf
computes in the input dtype with cos and sin cast to it, rounding each product and sum; in bfloat16 it is
therefore not bit-equal to CosSinRoPE, and examples/rope_parity.py --preset trn2 checks it against a reference
that rounds as the kernel does. How the kernel is launched (`NKI_LAUNCH`, `launch_nki`) is stated below.
"""
from __future__ import annotations

import os

import torch

from common import device
from common.errors import UserError

__all__ = ["rope", "rope_fwd", "rope_bwd", "check_rope_shapes", "check_kernel_rule", "launch_nki", "rope_kernel_call"]

# rope_hf tiles the sequence in 128-row blocks (the SBUF partition count), split across the physical
# cores of a logical core; the kernel asserts seq_len % (128 * LNC) == 0.
KERNEL_SEQ_TILE = 128
# Bound on head_dim kept at the 128-lane partition size, which covers Qwen3 (head_dim 128).
MAX_HEAD_DIM = 128


def check_rope_shapes(q: torch.Tensor, k: torch.Tensor, rope_cache: torch.Tensor, *,
                      lnc: int, kernel_shape: bool) -> None:
    """Raise UserError for inputs the op cannot rotate; with `kernel_shape`, also for those the NKI
    kernel cannot take. q, k, rope_cache are in the kernel layout: [batch, heads, seq, head_dim]."""
    if q.dim() != 4 or k.dim() != 4:
        raise UserError(f"rope expects 4-D q and k [batch, seq, heads, head_dim], got {tuple(q.shape)} "
                        f"and {tuple(k.shape)}")
    if q.dtype != k.dtype:
        raise UserError(f"rope expects q and k of one dtype, got {q.dtype} and {k.dtype}")
    (bq, _, sq, d), (bk, _, sk, dk) = q.shape, k.shape
    if (bq, sq, d) != (bk, sk, dk):
        raise UserError(f"rope expects q and k with the same batch, sequence length and head_dim, got "
                        f"q {tuple(q.shape)} and k {tuple(k.shape)} (kernel layout [batch, heads, seq, head_dim])")
    if d % 2:
        raise UserError(f"head_dim {d} is odd; rotate-half RoPE pairs dimension i with i + head_dim/2, "
                        "so head_dim must be even")
    if rope_cache.dim() not in (2, 3) or rope_cache.shape[-1] != 2 * d:
        raise UserError(f"rope_cache has shape {tuple(rope_cache.shape)}, expected [seq, head_dim * 2] = "
                        f"[{sq}, {2 * d}] or [batch, seq, head_dim * 2] (cat(cos, sin), as torchtitan's "
                        "CosSinRoPE cache)")
    if rope_cache.shape[-2] != sq:
        raise UserError(f"rope_cache has {rope_cache.shape[-2]} rows but the sequence has {sq} positions; "
                        "slice the cache rows for the positions being rotated, e.g. cache[start:start + seq]")
    if rope_cache.dim() == 3 and rope_cache.shape[0] != bq:
        raise UserError(f"rope_cache has tables for {rope_cache.shape[0]} sequences but the batch has {bq}")
    if kernel_shape:
        check_kernel_rule(sq, d, lnc)


def check_kernel_rule(seq_len: int, head_dim: int, lnc: int) -> None:
    """rope_hf's shape rule as a UserError naming it. Scripts call it at preflight with their sizes, before any
    device work, so a Trainium-bound config fails in seconds rather than inside the first forward."""
    if lnc < 1:
        raise UserError(f"LNC must be a positive integer, got {lnc}")
    if head_dim > MAX_HEAD_DIM:
        raise UserError(f"head_dim {head_dim} is larger than {MAX_HEAD_DIM} (the partition size), which the NKI "
                        "rope_hf path of this op supports")
    multiple = KERNEL_SEQ_TILE * lnc
    if seq_len % multiple:
        raise UserError(f"sequence length {seq_len} is not a multiple of {KERNEL_SEQ_TILE} x LNC = {multiple}, which "
                        "the NKI rope_hf kernel requires; pad the sequence or change --seq_len")


# How the NKI kernels are launched (one switch for rope_hf and the MoE kernels):
#   "jit":      call the @nki.jit kernel on neuron tensors, inside this file's torch.library ops. The 2.33 how-to
#               ("How to work with NKI kernels from torch-neuronx") documents this eager call; the scripts run eager.
#   "wrap_nki": call torch_neuronx.wrap_nki(kernel), the form torch.compile can trace (TorchNeuron's own kernels use
#               it inside torch_neuronx.nki_op). For a compiled run the ops themselves would also have to be
#               registered with nki_op instead of torch.library.custom_op; not done here.
NKI_LAUNCH = "jit"
NKI_GRID_DEPRECATED = (0, 7)  # nki 0.7.0 (Neuron 2.33) deprecates kernel[lnc] for NEURON_LOGICAL_NC_CONFIG


def _nki_version() -> tuple[int, ...] | None:
    from importlib import metadata

    try:
        return tuple(int(p) for p in metadata.version("nki").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return None


def launch_nki(kernel, lnc: int):
    """`kernel`, ready to call at LNC `lnc` on this stack. Neuron 2.33 (nki 0.7.0) takes the LNC from
    NEURON_LOGICAL_NC_CONFIG (set by common.device.set_neuron_env) and deprecates the launch grid `kernel[lnc]`;
    earlier releases need the grid (without it a kernel runs at LNC=1). A grid equal to the variable works on
    both, so the grid is passed whenever the installed nki is older than 0.7.0 or unknown."""
    env = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    if env is not None and env != str(lnc):
        raise UserError(f"the NKI kernels were asked for LNC={lnc} but NEURON_LOGICAL_NC_CONFIG={env}; neuronx-cc "
                        "rejects the mismatch (NCC_EVRF066): pass --lnc equal to the variable, or unset it")
    if NKI_LAUNCH == "wrap_nki":
        from torch_neuronx import wrap_nki

        kernel = wrap_nki(kernel)
    version = _nki_version()
    if env is not None and version is not None and version >= NKI_GRID_DEPRECATED:
        return kernel
    return kernel[lnc]


def _rope_nki(x_q: torch.Tensor, x_k: torch.Tensor, rope_cache: torch.Tensor, lnc: int,
              backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainium only: nki-library's kernel, [batch, heads, seq, head_dim] in and out."""
    from nkilib.core.embeddings.rope_hf import rope_hf

    check_rope_shapes(x_q, x_k, rope_cache, lnc=lnc, kernel_shape=True)
    return rope_kernel_call(launch_nki(rope_hf, lnc), x_q, x_k, rope_cache, backward)


def rope_kernel_call(kernel, x_q: torch.Tensor, x_k: torch.Tensor, rope_cache: torch.Tensor,
                     backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout around one rope_hf call (tests run it on CPU with a PyTorch stand-in for the kernel).

    rope_hf reads q, k as dense [batch, heads, seq, head_dim] and the cache as dense [seq, 2 * head_dim] or
    [batch, seq, 2 * head_dim] (one table per sequence), in q's dtype (it loads cos/sin tiles in that dtype):
    one call covers the whole batch. Its outputs are the tensors it returns, not the q_out/k_out buffers passed
    in: TorchNeuron's NKI V2 does not alias written inputs, so a buffer may come back untouched. The results
    are copied back into the caller's strides when those differ, as the fake impl promises."""
    q_in, k_in = x_q.contiguous(), x_k.contiguous()
    cache = rope_cache.to(x_q.dtype).contiguous()
    q_out, k_out = kernel(q_in, k_in, torch.empty_like(q_in), torch.empty_like(k_in), rope_cache=cache,
                          backward=backward)
    if q_out.stride() != x_q.stride():
        q_out = torch.empty_like(x_q).copy_(q_out)  # empty_like keeps a dense permutation's strides
    if k_out.stride() != x_k.stride():
        k_out = torch.empty_like(x_k).copy_(k_out)
    return q_out, k_out


def _rope_torch(x_q: torch.Tensor, x_k: torch.Tensor, rope_cache: torch.Tensor, lnc: int,
                backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's math in PyTorch (same signature as `_rope_nki`), gather-free.

    rotate_half(x) * sin is a swap of x's halves times a signed sin, and its adjoint likewise:
        forward   y  = x * cos + swap(x) * cat(-sin1, sin2)      swap(x) = cat(x2, x1)
        backward  dx = g * cos + swap(g) * cat(sin2, -sin1)
    equal bit for bit to the rotate-half form (x2 * -s1 == -(x2 * s1) in IEEE arithmetic). The signed
    tables are built from the cache rows ([seq, head_dim] work, not per head).

    Takes q and k in any dense strides (`rope()` hands it [batch, heads, seq, head_dim] views of the
    caller's [batch, seq, heads, head_dim] tensors: no layout copy off Trainium) and writes outputs
    with the same strides, as the fake impl promises. Computes in float32 (float64 for float64
    inputs) and rounds once to the input dtype, as torchtitan's CosSinRoPE does, so bf16 results
    match torchtitan bit for bit. `lnc` only matters to the kernel."""
    del lnc
    compute = torch.promote_types(x_q.dtype, torch.float32)
    d = x_q.shape[-1]
    h = d // 2
    cos, sin = rope_cache[..., :d].to(compute), rope_cache[..., d:].to(compute)
    if backward:
        signed_sin = torch.cat((sin[..., h:], -sin[..., :h]), dim=-1)
    else:
        signed_sin = torch.cat((-sin[..., :h], sin[..., h:]), dim=-1)
    if rope_cache.dim() == 3:  # [batch, seq, 2d] -> [batch, 1, seq, d] against [batch, heads, seq, d]
        cos, signed_sin = cos.unsqueeze(1), signed_sin.unsqueeze(1)

    def one(x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute)
        return torch.add(xf * cos, torch.roll(xf, h, dims=-1) * signed_sin, out=torch.empty_like(x))

    return one(x_q), one(x_k)


def _rope_any(x_q, x_k, rope_cache, lnc, backward):
    if x_q.device.type == "neuron" and device.neuron_available():
        return _rope_nki(x_q, x_k, rope_cache, lnc, backward)
    return _rope_torch(x_q, x_k, rope_cache, lnc, backward)


@torch.library.custom_op("qwen3_recipes::rope_fwd", mutates_args=())
def rope_fwd(q: torch.Tensor, k: torch.Tensor, rope_cache: torch.Tensor, lnc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [batch, q_heads, seq, head_dim] and k [batch, k_heads, seq, head_dim] (kernel layout)."""
    return _rope_any(q, k, rope_cache, lnc, backward=False)


@torch.library.custom_op("qwen3_recipes::rope_bwd", mutates_args=())
def rope_bwd(grad_q: torch.Tensor, grad_k: torch.Tensor, rope_cache: torch.Tensor,
             lnc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of rope_fwd's q and k inputs from those of its outputs (kernel layout)."""
    return _rope_any(grad_q, grad_k, rope_cache, lnc, backward=True)


@rope_fwd.register_fake
def _(q, k, rope_cache, lnc):
    return torch.empty_like(q), torch.empty_like(k)  # the inputs' strides


@rope_bwd.register_fake
def _(grad_q, grad_k, rope_cache, lnc):
    return torch.empty_like(grad_q), torch.empty_like(grad_k)


def _setup_context(ctx, inputs, output) -> None:
    _, _, rope_cache, lnc = inputs
    ctx.save_for_backward(rope_cache)  # the backward kernel reuses the forward's rotation table
    ctx.lnc = lnc


def _backward(ctx, grad_q, grad_k):
    (rope_cache,) = ctx.saved_tensors
    dq, dk = torch.ops.qwen3_recipes.rope_bwd(grad_q, grad_k, rope_cache, ctx.lnc)
    # No gradient for the cache: it is a fixed function of the positions, not a parameter.
    return dq, dk, None, None


rope_fwd.register_autograd(_backward, setup_context=_setup_context)


def rope(q: torch.Tensor, k: torch.Tensor, rope_cache: torch.Tensor, *, lnc: int = 2,
         check_kernel_shape: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE to q [batch, seq, q_heads, head_dim] and k [batch, seq, k_heads, head_dim]
    (torchtitan's layout) with `rope_cache` [seq, head_dim * 2] = cat(cos, sin) for those positions,
    or [batch, seq, head_dim * 2] for per-sequence positions.

    `lnc` is the kernel's launch grid (must match NEURON_LOGICAL_NC_CONFIG). The kernel's shape rule
    (seq a multiple of 128 x LNC, head_dim <= 128) is always checked on a Neuron device, and on
    other devices when `check_kernel_shape` is set, so a CPU run can catch a Trainium-bound config.
    The cache gets no gradient, even with requires_grad set."""
    # The kernel layout is [batch, heads, seq, head_dim]. The NKI kernel reads it densely, so on
    # Trainium the permute is materialised; the PyTorch path takes the permuted views as they are.
    on_neuron = q.device.type == "neuron"
    q_k, k_k = q.transpose(1, 2), k.transpose(1, 2)
    if on_neuron:
        q_k, k_k = q_k.contiguous(), k_k.contiguous()
    check_rope_shapes(q_k, k_k, rope_cache, lnc=lnc, kernel_shape=check_kernel_shape or on_neuron)
    q_out, k_out = torch.ops.qwen3_recipes.rope_fwd(q_k, k_k, rope_cache, lnc)
    return q_out.transpose(1, 2), k_out.transpose(1, 2)
