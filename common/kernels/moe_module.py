"""OpRoutedExperts: torchtitan's RoutedExperts running the grouped-expert custom op
(common/kernels/moe_op.py), swapped in through torchtitan's override registry.

    trainer_config.override.imports = [("common.kernels.moe_module.grouped_experts_op", {"compute_dtype": "bfloat16"})]

torchtitan logs `[Override] common.kernels.moe_module.grouped_experts_op: model_spec.model.layers.N.moe.routed_experts
RoutedExperts.Config -> OpRoutedExperts.Config` for each MoE layer. Parameters keep their names
(`moe.routed_experts.inner_experts.w1_EFD`, ...), so checkpoints, torchtitan's HF adapter and FSDP
see no difference. The router, the load-balancing bias and the shared experts stay torchtitan's.

The module counts the tokens each expert received (`expert_load_E`, not saved in checkpoints),
skipping the forward that activation checkpointing replays during backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torchtitan.config import derive, override
from torchtitan.models.common.moe import RoutedExperts

from common.kernels.moe_op import grouped_experts

__all__ = ["OpRoutedExperts", "grouped_experts_op", "expert_load"]


class OpRoutedExperts(RoutedExperts):
    """Routed experts as one custom op: group by expert, expert MLPs, weighted sum; own backward."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # torchtitan's stock experts: bfloat16

    def __init__(self, config: Config):
        super().__init__(config)
        self.compute_dtype = getattr(torch, config.compute_dtype)
        # A plain attribute, not a buffer: torchtitan would ask for its sharding, checkpoints would carry it.
        self.expert_load_E: torch.Tensor | None = None

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        del num_local_tokens_per_expert_E  # the op counts while it groups
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.shape[-1]
        experts = self.inner_experts
        out_TD, counts_E = grouped_experts(x_BLD.reshape(B * L, D), topk_scores_BLK.reshape(B * L, K),
                                           topk_expert_ids_BLK.reshape(B * L, K), experts.w1_EFD,
                                           experts.w2_EDF, experts.w3_EFD, compute_dtype=self.compute_dtype)
        # Count once per step: activation checkpointing replays this forward inside backward. Not under
        # torch.compile (--compile): the autograd task id is not traceable, so a compiled run counts no load.
        if self.training and not torch.compiler.is_compiling() and torch._C._current_graph_task_id() == -1:
            counts_E = counts_E.detach().to(torch.int64)
            self.expert_load_E = counts_E if self.expert_load_E is None else self.expert_load_E + counts_E
        return out_TD.view(B, L, D)


@override(target=RoutedExperts.Config, exact=True,
          description="grouped-expert custom op (nki-library blockwise MoE on Trainium)")
def grouped_experts_op(cfg: RoutedExperts.Config, *, compute_dtype: str = "bfloat16") -> OpRoutedExperts.Config:
    """Override factory: every RoutedExperts becomes an OpRoutedExperts (same sub-configs)."""
    return derive(cfg, OpRoutedExperts.Config, compute_dtype=compute_dtype)


def expert_load(model: torch.nn.Module) -> list[int]:
    """Tokens routed to each expert, summed over the MoE layers of `model` (this rank)."""
    loads = [m.expert_load_E.cpu() for m in model.modules()
             if isinstance(m, OpRoutedExperts) and m.expert_load_E is not None]
    return torch.stack(loads).sum(0).tolist() if loads else []
