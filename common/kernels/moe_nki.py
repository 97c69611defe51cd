"""Trainium only: the grouped-expert op on nki-library's blockwise MoE training kernels.

Not run on hardware by this project (no Trainium here). Written from the kernels' signatures, docstrings, asserts
and tests in aws-neuron/nki-library (src/nkilib_src/nkilib/experimental/moe/forward/bwmm_shard_on_H.py,
experimental/moe/bwd/blockwise_mm_backward.py and moe_bwd_parameters.py, test/integration/nkilib/experimental/moe/)
and from neuronx-distributed's caller, which builds the same routing tables (modules/moe/expert_mlps_v2.py,
get_blockwise_expert_and_token_mapping). Imported only from common/kernels/moe_op.py when the tensors are on a
Neuron device.

What runs where. Packing the kernels' inputs and unpacking their outputs (`pack_forward`, `unpack_forward`,
`pack_backward`, `unpack_backward`, through `run_forward` / `run_backward`) runs on CPU in
tests/test_moe_nki_pack.py, against a PyTorch reference of the two kernels written from their documented
contract. The parity of this branch with the PyTorch op on a Neuron device, forward and backward, at the reduced
Qwen3-30B-A3B preset's shapes, is tests/test_neuron_device.py: skipped (with its reason) where
`neuron_available()` is false, so it has not run.

Layouts the kernels take: hidden states [T+1, H] with a zero padding row T; affinities [(T+1)*E, 1] (the top-k
scores scattered into [T+1, E]); gate_up [E, H, 2, I] (gate, up); down [E, I, H]; token slots
`token_position_to_id` [N*B] (padding slots point at row T) and `block_to_expert` [N, 1] for N blocks of B tokens,
each block holding tokens of one expert.

Outputs. Every stored version of this forward (nki-library 2026-02-27, 2026-04-13) returns `output` alone and
writes its activation checkpoints (pre-activation gate/up [N, 2, I, B], unscaled down outputs [N, B, H]), which
the backward reads, only into buffers the caller passes. TorchNeuron's NKI V2 does not alias written inputs (its
tests: "aliasing is not supported in NKI V2 yet"), so such a buffer may come back untouched. The forward kernel is
therefore used for its output only: `pack_forward` passes `gate_up_activations_T=None` and `down_activations=None`
(the kernel's defaults: no write), and `recompute_gate_up_activations` / `recompute_down_activations` compute both
checkpoints on the device with torch ops from the kernel's own inputs, with the kernel's math (cost: the forward
kernel's expert FLOPs once more, see `recompute_gate_up_activations`). The forms `(output,
gate_up_activations_T)` and `(output, gate_up_activations_T, down_activations)` (nki-library's core moe_cte
kernels, bwmm_shard_on_I) are accepted too: a returned checkpoint is used instead of its recompute. A checkpoint
that would still be read from a buffer passed in (none in these forms) is checked on the first call: all zeros
stops the run instead of training on with wrong gradients.

How the kernels come. nki-library decorates the forward `@nki.jit(mode="trace")` (2026-04-13; 2026-02-27 adds
`platform_target="trn2"`) and the backward plain `@nki.jit`; nki 0.7's `nki.jit(fn=None, *, compile_config=None,
specialization_config=None, **kwargs)` documents no `mode`. `launchable` takes either form: an object a jit
decorator made (whatever its mode) is launched as it is, a plain Python function is wrapped with `nki.jit` (no
mode) first. `kernel_jit_form()` names the installed kernels' forms for the preflight.
"""
from __future__ import annotations

import inspect
import math
import os

import torch
import torch.nn.functional as F

from common.errors import UserError

BLOCK_SIZE = 512  # tokens per block
BWD_BLOCK_SIZES = (128, 256, 512, 1024)  # blockwise_mm_bwd's rule (MOEBwdParameters.validate)


def check_nki_shapes(hidden: int, inter: int, compute_dtype: torch.dtype, *, lnc: int | None = None,
                     block: int = BLOCK_SIZE) -> int:
    """The kernels' shape rules, from their asserts; raises one UserError naming each rule broken, returns the LNC.
    Scripts call it at preflight with the model's sizes (`lnc` from the config); the op calls it again with the
    tensors' sizes (`lnc` from NEURON_LOGICAL_NC_CONFIG)."""
    lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2")) if lnc is None else lnc
    problems = []
    if lnc != 2:
        problems.append(f"LNC={lnc} (the forward kernel all-reduces gate/up between the two cores of an LNC=2 core)")
    unit = 32 * max(lnc, 1)
    if hidden % unit:
        problems.append(f"hidden size {hidden} (blockwise_mm_bwd: hidden / LNC must be a multiple of 32)")
    if inter % unit:
        problems.append(f"expert hidden size (moe_intermediate_size) {inter} (blockwise_mm_bwd: it / LNC must be "
                        "a multiple of 32)")
    if block not in BWD_BLOCK_SIZES:
        problems.append(f"block size {block} (blockwise_mm_bwd takes {', '.join(map(str, BWD_BLOCK_SIZES))})")
    if compute_dtype != torch.bfloat16:
        problems.append(f"expert compute dtype {compute_dtype} (this op runs both kernels in bfloat16, the dtype "
                        "nki-library tests its backward in; use --expert_dtype bfloat16)")
    if problems:
        raise UserError("the NKI blockwise MoE kernels cannot take " + "; ".join(problems))
    return lnc


def check_training_shapes(*, seq_len: int, head_dim: int, hidden: int, inter: int, compute_dtype: torch.dtype,
                          lnc: int) -> None:
    """Preflight of a MoE training run on Trainium, before any device work: the RoPE kernel's and the MoE kernels'
    shape rules together, as one UserError naming every rule the config breaks."""
    from common.kernels.rope_op import check_kernel_rule

    broken = []
    for check in (lambda: check_kernel_rule(seq_len, head_dim, lnc),
                  lambda: check_nki_shapes(hidden, inter, compute_dtype, lnc=lnc)):
        try:
            check()
        except UserError as e:
            broken.append(str(e))
    if broken:
        raise UserError("; ".join(broken))


def num_blocks(tokens: int, top_k: int, experts: int, block: int = BLOCK_SIZE) -> int:
    """Blocks for the worst case: every expert's last block partly empty."""
    return max(math.ceil((tokens * top_k - (experts - 1)) / block), 1) + experts - 1


# The routing tables below are built from static sizes only (tokens, top_k, experts, block size): every shape is
# known before the data, and nothing reads a tensor's value back to the host, so the Neuron device is not synced
# in each MoE layer, forward or backward (no bincount, boolean-mask indexing, one_hot or repeat_interleave with a
# data-dependent length). tests/test_moe_nki_pack.py traces them with torch.compile(fullgraph=True) and checks
# them index for index against the data-dependent formulation they replace.

def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int32: the (token, slot) pairs each expert receives; a scatter-add into E slots (bincount's length
    would depend on the data)."""
    flat = expert_ids.reshape(-1).long()
    return torch.zeros(num_experts, dtype=torch.int32, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))


def _blocks_per_expert(counts: torch.Tensor, block: int) -> torch.Tensor:
    return (counts.long() + block - 1) // block  # ceil(counts / block)


def block_to_expert(counts: torch.Tensor, n_blocks: int, block: int = BLOCK_SIZE) -> torch.Tensor:
    """[n_blocks] int32: the expert of each block, the experts' blocks in expert order; the spare blocks (beyond
    the experts' own) go to the last expert. Block i belongs to the number of experts whose blocks end at or
    before i, capped at E-1: one [n_blocks, E] comparison."""
    ends = torch.cumsum(_blocks_per_expert(counts, block), 0)  # [E] one past each expert's last block
    blocks = torch.arange(n_blocks, device=counts.device)
    return (ends[None, :] <= blocks[:, None]).sum(1).clamp_(max=len(counts) - 1).to(torch.int32)


def token_slots(expert_ids: torch.Tensor, counts: torch.Tensor, n_blocks: int, block: int = BLOCK_SIZE) -> torch.Tensor:
    """[n_blocks * block] int32 token index per slot; empty slots point at the padding row T. Each expert's
    tokens fill its blocks from its first slot on, in token order. Transient: a [T, E] int64 routing map and its
    cumulative sum over the tokens."""
    T, E = expert_ids.shape[0], len(counts)
    ids = expert_ids.long()
    routed = torch.zeros(T, E, dtype=torch.long, device=ids.device).scatter_add_(1, ids, torch.ones_like(ids))
    rank = torch.cumsum(routed, 0).gather(1, ids) - 1  # [T, K] 0-based rank of the token among its expert's
    per_expert = _blocks_per_expert(counts, block)
    first = (torch.cumsum(per_expert, 0) - per_expert) * block  # [E] each expert's first slot
    slot = first.gather(0, ids.reshape(-1)) + rank.reshape(-1)  # distinct for distinct (token, expert) pairs
    tokens = torch.arange(T, device=ids.device)[:, None].expand_as(ids).reshape(-1)
    slots = torch.full((n_blocks * block,), T, dtype=torch.long, device=ids.device)
    return slots.scatter_(0, slot, tokens).to(torch.int32)


def _kernel_inputs(x, scores, expert_ids, w1, w2, w3, cd):
    T, H = x.shape
    E = w1.shape[0]
    hidden = torch.cat([x.to(cd), x.new_zeros(1, H, dtype=cd)])
    aff = torch.zeros(T + 1, E, dtype=cd, device=x.device)
    aff[:T].scatter_(1, expert_ids, scores.to(cd))
    gate_up = torch.stack([w1.transpose(1, 2), w3.transpose(1, 2)], dim=2).to(cd).contiguous()  # [E, H, 2, I]
    down = w2.transpose(1, 2).to(cd).contiguous()  # [E, I, H]
    return hidden, aff.reshape(-1, 1), gate_up, down


def pack_forward(x, scores, expert_ids, w1, w2, w3, cd, block: int = BLOCK_SIZE) -> tuple[dict, torch.Tensor]:
    """The forward kernel's tensor and size arguments, by its parameter names; and tokens per expert."""
    T, K = scores.shape
    E, I, H = w1.shape
    counts = expert_counts(expert_ids, E)
    n = num_blocks(T, K, E, block)
    hidden, aff, gate_up, down = _kernel_inputs(x, scores, expert_ids, w1, w2, w3, cd)
    args = dict(hidden_states=hidden, expert_affinities_masked=aff, gate_up_proj_weight=gate_up,
                down_proj_weight=down, block_size=block, token_position_to_id=token_slots(expert_ids, counts, n, block),
                block_to_expert=block_to_expert(counts, n, block).view(-1, 1),
                # the checkpoints are optional (default None: not written); recomputed in unpack_forward instead
                gate_up_activations_T=None, down_activations=None,
                is_tensor_update_accumulating=K != 1)  # top-1: each token is written once
    return args, counts


def recompute_gate_up_activations(hidden_states: torch.Tensor, gate_up_proj_weight: torch.Tensor,
                                  token_position_to_id: torch.Tensor, block_to_expert: torch.Tensor) -> torch.Tensor:
    """The forward kernel's gate/up checkpoint [N, 2, I, B] (pre-activation gate and up, transposed), from the
    kernel's own inputs: each block's token rows of the packed hidden states [T+1, H] (padding slots read the zero
    row T, so they give zeros, as the kernel's do) times its expert's packed gate_up weights [E, H, 2, I], one bmm
    with float32 accumulation, result in the hidden states' dtype (the compute dtype).
    One gather per operand and one bmm keep every shape static (no loop over experts, no data-dependent split) for
    the Neuron compiler. FLOPs: 4*N*B*H*I, two thirds of the forward kernel's 6*N*B*H*I; with the down recompute
    (2*N*B*H*I) the forward's expert FLOPs once more. Transient memory, in the compute dtype: the gathered rows
    [N, B, H], the gathered weights [N, H, 2I] and the bmm result [N, B, 2I] before its transposed copy (the
    checkpoint, kept for the backward); at the reduced Qwen3-30B-A3B preset (bfloat16, H 2048, I 768, B 512,
    N 95) 190 + 570 + 142.5 MiB = 0.88 GiB per MoE layer call, freed on return."""
    N = block_to_expert.numel()
    B = token_position_to_id.numel() // N
    H, I = gate_up_proj_weight.shape[1], gate_up_proj_weight.shape[3]
    rows = hidden_states.index_select(0, token_position_to_id.reshape(-1).long()).view(N, B, H)  # [N, B, H]
    w = gate_up_proj_weight.index_select(0, block_to_expert.reshape(-1).long()).view(N, H, 2 * I)  # [N, H, 2I]
    gate_up = torch.bmm(rows, w)  # [N, B, (gate, up) x I]; float32 accumulation (Neuron's PSUM, CPU's opmath)
    return gate_up.view(N, B, 2, I).permute(0, 2, 3, 1).contiguous()  # [N, 2, I, B]


def _silu_mul(gate_up_act: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """silu(gate) * up [N, B, I] from the gate/up checkpoint [N, 2, I, B], in float32 rounded to `cd`; its float32
    temporaries (a [N, 2, I, B] copy, two [N, I, B]) are freed on return, before the down weights are gathered."""
    gate, up = gate_up_act.float().unbind(1)  # 2 x [N, I, B]
    return (F.silu(gate) * up).to(cd).transpose(1, 2)


def recompute_down_activations(gate_up_act: torch.Tensor, down_proj_weight: torch.Tensor,
                               block_to_expert: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """The forward kernel's down checkpoint [N, B, H] (down projection before the affinity scale), from its gate/up
    checkpoint [N, 2, I, B] (pre-activation gate and up, transposed) and the packed down weights [E, I, H]:
    silu(gate) * up in float32 rounded to `cd`, times each block's expert weights, float32 accumulation, result in
    `cd`. Padding slots (zero gate/up) give zeros, as the kernel's do.
    FLOPs: 2*N*B*H*I, a third of the forward kernel's. Transient memory: float32 [N, 2, I, B] + 2 x [N, I, B] for the
    activation (freed before the gather), then the activation [N, B, I] and the gathered weights [N, I, H] in `cd`;
    at the reduced preset 570 MiB, then 71 + 285 MiB, besides the checkpoint itself ([N, B, H], 190 MiB, kept).
    A gather + one bmm keeps every shape static for the Neuron compiler."""
    act = _silu_mul(gate_up_act, cd)  # [N, B, I]
    w = down_proj_weight.to(cd).index_select(0, block_to_expert.reshape(-1).long())  # [N, I, H]
    return torch.bmm(act, w)  # [N, B, H]; a bfloat16 matmul accumulates in float32 (Neuron's PSUM, CPU's opmath)


CHECKPOINTS = ("gate_up_activations_T", "down_activations")  # the forward kernel's checkpoint parameters, in order


def _is_buffer(t: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    return buffer is not None and (t is buffer or t.data_ptr() == buffer.data_ptr())


def unpack_forward(result, args: dict, tokens: int, dtype: torch.dtype):
    """(out [T, D], gate/up checkpoint, down checkpoint, {name: checkpoint read from a buffer passed in}) from what
    the forward kernel returned: `output`, `(output, gate_up_activations_T)` or `(output, gate_up_activations_T,
    down_activations)`. Each checkpoint is the returned one where the kernel returns it, else the buffer passed in
    where `args` has one (not so from `pack_forward`), else recomputed from the kernel's inputs (gate/up) and the
    gate/up checkpoint (down). A returned tensor that is a buffer passed in counts as read from that buffer."""
    parts = list(result) if isinstance(result, (tuple, list)) else [result]
    output, returned = parts[0], dict(zip(CHECKPOINTS, parts[1:]))
    found, from_buffers = {}, {}
    for name in CHECKPOINTS:
        t = returned.get(name)
        t = args.get(name) if t is None else t
        if t is not None and _is_buffer(t, args.get(name)):
            from_buffers[name] = t
        found[name] = t
    gate_up_act = found["gate_up_activations_T"]
    if gate_up_act is None:
        gate_up_act = recompute_gate_up_activations(args["hidden_states"], args["gate_up_proj_weight"],
                                                    args["token_position_to_id"], args["block_to_expert"])
    down_act = found["down_activations"]
    if down_act is None:
        down_act = recompute_down_activations(gate_up_act, args["down_proj_weight"], args["block_to_expert"],
                                              args["hidden_states"].dtype)
    return output[:tokens].to(dtype), gate_up_act, down_act, from_buffers


_checkpoints_checked = False


def check_checkpoints_once(from_buffers: dict) -> None:
    """On the first call only (one device sync, none when nothing is read from a buffer): a checkpoint read from a
    buffer the kernel was given that is all zeros means the kernel's write never reached PyTorch (a buffer NKI V2
    did not alias); the backward would compute wrong gradients silently. `pack_forward` passes no buffer, so in
    the known kernel forms nothing is read from one; returned and recomputed checkpoints need no check."""
    global _checkpoints_checked
    if _checkpoints_checked:
        return
    empty = [name for name, t in from_buffers.items() if not bool(t.any())]
    if empty:
        raise RuntimeError(f"the NKI MoE forward kernel left its activation checkpoint(s) {', '.join(empty)} all "
                           "zeros in the buffer passed in: its write did not reach PyTorch (TorchNeuron's NKI V2 "
                           "does not alias written inputs). Training would go on with wrong gradients, so it stops "
                           "here; run with --stock, and see docs/first-hour-trn2.md")
    _checkpoints_checked = True


def pack_backward(grad_out, x, scores, expert_ids, w1, w2, w3, slots, counts, gate_up_act, down_act, cd) -> dict:
    """The backward kernel's tensor and size arguments, by its parameter names, from what the forward saved."""
    K = scores.shape[1]
    n, block = gate_up_act.shape[0], gate_up_act.shape[-1]  # [N, 2, I, B]
    hidden, aff, gate_up, down = _kernel_inputs(x, scores, expert_ids, w1, w2, w3, cd)
    grad = torch.cat([grad_out.to(cd), grad_out.new_zeros(1, x.shape[1], dtype=cd)])  # padding row T: no gradient
    return dict(hidden_states=hidden, expert_affinities_masked=aff, gate_up_proj_weight=gate_up, down_proj_weight=down,
                gate_up_proj_act_checkpoint_T=gate_up_act, down_proj_act_checkpoint=down_act,
                token_position_to_id=slots.to(torch.int32),
                block_to_expert=block_to_expert(counts, n, block).view(-1, 1), output_hidden_states_grad=grad,
                block_size=block, is_tensor_update_accumulating=K != 1)


def unpack_backward(grads, x, scores, expert_ids, w1, w2, w3):
    """Gradients of x, scores, w1, w2, w3 from the backward kernel's (d_hidden, d_affinities, d_gate_up, d_down)."""
    d_hidden, d_aff, d_gate_up, d_down = grads[:4]
    T, E = x.shape[0], w1.shape[0]
    d_scores = d_aff.reshape(T + 1, E)[:T].gather(1, expert_ids).to(scores.dtype)  # only the routed pairs
    dw1 = d_gate_up[:, :, 0, :].transpose(1, 2).to(w1.dtype)  # [E, H, I] -> [E, I, H]
    dw3 = d_gate_up[:, :, 1, :].transpose(1, 2).to(w3.dtype)
    dw2 = d_down.transpose(1, 2).to(w2.dtype)  # [E, I, H] -> [E, H, I]
    return d_hidden[:T].to(x.dtype), d_scores, dw1, dw2, dw3


def run_forward(kernel, constants: dict, x, scores, expert_ids, w1, w2, w3, cd, block: int = BLOCK_SIZE):
    """pack -> kernel -> unpack, in the op's saved-slot order (order, counts, h1, h3, y) <- (token slots, counts,
    gate/up checkpoint, unused, down checkpoint)."""
    args, counts = pack_forward(x, scores, expert_ids, w1, w2, w3, cd, block)
    result = kernel(**args, **constants)
    out, gate_up_act, down_act, from_buffers = unpack_forward(result, args, x.shape[0], x.dtype)
    check_checkpoints_once(from_buffers)
    return out, args["token_position_to_id"].long(), counts, gate_up_act, gate_up_act.new_empty(0), down_act


def run_backward(kernel, constants: dict, grad_out, x, scores, expert_ids, w1, w2, w3, slots, counts, gate_up_act,
                 _unused, down_act, cd):
    args = pack_backward(grad_out, x, scores, expert_ids, w1, w2, w3, slots, counts, gate_up_act, down_act, cd)
    return unpack_backward(kernel(**args, **constants), x, scores, expert_ids, w1, w2, w3)


def launchable(kernel, jit):
    """`kernel` ready for launch_nki: a plain Python function is wrapped with `jit` (nki.jit, given no mode: nki 0.7
    documents none); anything else, the object a jit decorator made (`@nki.jit`, `@nki.jit(mode="trace")`), is
    launched as it is."""
    return jit(kernel) if inspect.isfunction(kernel) else kernel


def experts_fwd_nki(x, scores, expert_ids, w1, w2, w3, compute_dtype):
    import nki
    import nki.language as nl
    from nkilib.core.utils.common_types import ExpertAffinityScaleMode  # its canonical module
    from nkilib.experimental.moe.forward.bwmm_shard_on_H import blockwise_mm_baseline_shard_hidden

    from common.kernels.rope_op import launch_nki  # the one launch path of the NKI kernels (NKI_LAUNCH there)

    _, I, H = w1.shape
    lnc = check_nki_shapes(H, I, compute_dtype)
    constants = dict(compute_dtype=nl.bfloat16, expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE)
    kernel = launch_nki(launchable(blockwise_mm_baseline_shard_hidden, nki.jit), lnc)
    return run_forward(kernel, constants, x, scores, expert_ids, w1, w2, w3, compute_dtype)


def experts_bwd_nki(grad_out, x, scores, expert_ids, w1, w2, w3, slots, counts, gate_up_act, unused, down_act,
                    compute_dtype):
    import nki
    import nki.language as nl
    from nkilib.experimental.moe.bwd.blockwise_mm_backward import blockwise_mm_bwd

    from common.kernels.rope_op import launch_nki

    _, I, H = w1.shape
    lnc = check_nki_shapes(H, I, compute_dtype)
    kernel = launch_nki(launchable(blockwise_mm_bwd, nki.jit), lnc)
    return run_backward(kernel, dict(compute_dtype=nl.bfloat16), grad_out, x, scores, expert_ids, w1, w2, w3, slots,
                        counts, gate_up_act, unused, down_act, compute_dtype)
