"""Trainium only: the grouped-expert op on nki-library's blockwise MoE training kernels.

NOT RUN by this project (no Trainium here); written from the kernels' signatures and tests in
aws-neuron/nki-library (src/nkilib_src/nkilib/experimental/moe/forward/bwmm_shard_on_H.py,
experimental/moe/bwd/blockwise_mm_backward.py) and from neuronx-distributed's caller, which builds
the same routing tables (modules/moe/expert_mlps_v2.py, get_blockwise_expert_and_token_mapping).
Imported only from common/moe_op.py when the tensors are on a Neuron device.

Layouts the kernels take: hidden states [T+1, H] with a zero padding row T; affinities [(T+1)*E, 1]
(the top-k scores scattered into [T+1, E]); gate_up [E, H, 2, I] (gate, up); down [E, I, H];
token slots `token_position_to_id` [N*B] (padding slots point at row T) and `block_to_expert`
[N, 1] for N blocks of B tokens, each block holding tokens of one expert. The forward writes the
activation checkpoints (pre-activation gate/up [N, 2, I, B], unscaled down outputs [N, B, H]) into
buffers the caller allocates; the backward reads them. Whether those in-place writes reach PyTorch
through nki.jit is not shown by any caller we found: the first Trainium run must check it (the
parity test against the PyTorch path in tests/test_moe_op.py does, on a Neuron device).
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from common.errors import UserError

BLOCK_SIZE = 512  # tokens per block; the backward kernel takes 128, 256, 512 or 1024


def check_nki_shapes(hidden: int, inter: int, compute_dtype: torch.dtype) -> int:
    """The kernels' documented limits; returns the LNC degree."""
    lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))
    problems = []
    if lnc != 2:
        problems.append(f"LNC={lnc} (both kernels synchronise the two cores of an LNC=2 core)")
    if hidden % 512 or not 512 <= hidden <= 8192:
        problems.append(f"hidden size {hidden} (must be a multiple of 512 in [512, 8192])")
    if inter % 64:
        problems.append(f"expert hidden size {inter} (must be a multiple of 64)")
    if compute_dtype != torch.bfloat16:
        problems.append(f"compute dtype {compute_dtype} (the backward kernel runs bfloat16)")
    if problems:
        raise UserError("the NKI blockwise MoE kernels cannot take " + "; ".join(problems))
    return lnc


def num_blocks(tokens: int, top_k: int, experts: int, block: int = BLOCK_SIZE) -> int:
    """Blocks for the worst case: every expert's last block partly empty."""
    return max(math.ceil((tokens * top_k - (experts - 1)) / block), 1) + experts - 1


def block_to_expert(counts: torch.Tensor, n_blocks: int, block: int = BLOCK_SIZE) -> torch.Tensor:
    per_expert = torch.ceil(counts.float() / block).long()
    per_expert[-1] += n_blocks - per_expert.sum()  # spare blocks go to the last expert
    return torch.repeat_interleave(torch.arange(len(counts), device=counts.device), per_expert).to(torch.int32)


def token_slots(expert_ids: torch.Tensor, counts: torch.Tensor, n_blocks: int, block: int = BLOCK_SIZE) -> torch.Tensor:
    """[n_blocks * block] token index per slot; empty slots point at the padding row T."""
    T, E = expert_ids.shape[0], len(counts)
    mask = F.one_hot(expert_ids, E).sum(1)  # [T, E], 1 where the token goes to the expert
    per_expert = torch.ceil(counts.float() / block).long()
    pos = torch.cumsum(mask, 0)  # 1-based rank of the token within its expert
    pos[:, 1:] += (torch.cumsum(per_expert, 0) * block)[:-1]
    pos[mask == 0] = 0  # unrouted pairs all land in slot 0, dropped below
    slots = torch.full((n_blocks * block + 1,), -1, dtype=torch.long, device=expert_ids.device)
    slots[pos] = torch.arange(T, device=expert_ids.device)[:, None].expand(T, E)
    slots = slots[1:]
    return slots.masked_fill(slots == -1, T).to(torch.int32)


def _kernel_inputs(x, scores, expert_ids, w1, w2, w3, cd):
    T, H = x.shape
    E = w1.shape[0]
    hidden = torch.cat([x.to(cd), x.new_zeros(1, H, dtype=cd)])
    aff = torch.zeros(T + 1, E, dtype=cd, device=x.device)
    aff[:T].scatter_(1, expert_ids, scores.to(cd))
    gate_up = torch.stack([w1.transpose(1, 2), w3.transpose(1, 2)], dim=2).to(cd).contiguous()  # [E, H, 2, I]
    down = w2.transpose(1, 2).to(cd).contiguous()  # [E, I, H]
    return hidden, aff.reshape(-1, 1), gate_up, down


def experts_fwd_nki(x, scores, expert_ids, w1, w2, w3, compute_dtype):
    import nki.language as nl
    from nkilib.core.moe.moe_cte.moe_cte_utils import ExpertAffinityScaleMode
    from nkilib.experimental.moe.forward.bwmm_shard_on_H import blockwise_mm_baseline_shard_hidden

    T, K = scores.shape
    E, I, H = w1.shape
    lnc = check_nki_shapes(H, I, compute_dtype)
    counts = torch.bincount(expert_ids.reshape(-1), minlength=E).to(torch.int32)
    n = num_blocks(T, K, E)
    slots = token_slots(expert_ids, counts, n)
    hidden, aff, gate_up, down = _kernel_inputs(x, scores, expert_ids, w1, w2, w3, compute_dtype)
    gate_up_act = torch.zeros(n, 2, I, BLOCK_SIZE, dtype=compute_dtype, device=x.device)  # written by the kernel
    down_act = torch.zeros(n, BLOCK_SIZE, H, dtype=compute_dtype, device=x.device)  # written by the kernel
    out = blockwise_mm_baseline_shard_hidden[lnc](
        hidden_states=hidden, expert_affinities_masked=aff, gate_up_proj_weight=gate_up, down_proj_weight=down,
        block_size=BLOCK_SIZE, token_position_to_id=slots, block_to_expert=block_to_expert(counts, n).view(-1, 1),
        gate_up_activations_T=gate_up_act, down_activations=down_act, compute_dtype=nl.bfloat16,
        is_tensor_update_accumulating=K != 1, expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE)
    # Saved slots of the op: (order, counts, h1, h3, y) <- (token slots, counts, gate/up checkpoint, unused, down checkpoint)
    return out[:T].to(x.dtype), slots.long(), counts, gate_up_act, gate_up_act.new_empty(0), down_act


def experts_bwd_nki(grad_out, x, scores, expert_ids, w1, w2, w3, slots, counts, gate_up_act, _unused, down_act,
                    compute_dtype):
    import nki.language as nl
    from nkilib.experimental.moe.bwd.blockwise_mm_backward import blockwise_mm_bwd

    T, K = scores.shape
    E, I, H = w1.shape
    lnc = check_nki_shapes(H, I, compute_dtype)
    hidden, aff, gate_up, down = _kernel_inputs(x, scores, expert_ids, w1, w2, w3, compute_dtype)
    grad = torch.cat([grad_out.to(compute_dtype), grad_out.new_zeros(1, H, dtype=compute_dtype)])
    d_hidden, d_aff, d_gate_up, d_down = blockwise_mm_bwd[lnc](
        hidden_states=hidden, expert_affinities_masked=aff, gate_up_proj_weight=gate_up, down_proj_weight=down,
        gate_up_proj_act_checkpoint_T=gate_up_act, down_proj_act_checkpoint=down_act,
        token_position_to_id=slots.to(torch.int32), block_to_expert=block_to_expert(counts, gate_up_act.shape[0]),
        output_hidden_states_grad=grad, block_size=BLOCK_SIZE, compute_dtype=nl.bfloat16,
        is_tensor_update_accumulating=K != 1)
    d_scores = d_aff.reshape(T + 1, E)[:T].gather(1, expert_ids).to(scores.dtype)
    dw1 = d_gate_up[:, :, 0, :].transpose(1, 2).to(w1.dtype)
    dw3 = d_gate_up[:, :, 1, :].transpose(1, 2).to(w3.dtype)
    return d_hidden[:T].to(x.dtype), d_scores, dw1, d_down.transpose(1, 2).to(w2.dtype), dw3
