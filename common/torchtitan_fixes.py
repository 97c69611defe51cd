"""The torchtitan 0.3.0 workarounds off CUDA that the training examples share: device settings on a
Trainer.Config, the attention every non-CUDA device can run, gloo-safe FSDP reductions.

Import only after `common.device.setup()` (torchtitan binds its device at import time).
Each workaround is a named function that says why it exists and when it can go.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from torchtitan.config import override
from torchtitan.models.common.attention import FlexAttention, VarlenAttention, VarlenMetadata
from torchtitan.trainer import Trainer

from common.device import DeviceInfo

ATTN_BACKENDS = ("sdpa", "flex")


class SDPADocumentAttention(VarlenAttention):
    """Causal attention with packed-document masking through `scaled_dot_product_attention`.

    Why: torchtitan 0.3.0 language models accept only FlexAttention (no CPU backward, needs Triton/inductor) or varlen
    attention (a CUDA kernel), and its plain SDPA class cannot mask documents. Subclassing the varlen config makes the
    trainer hand us the per-document boundaries it computes from `positions`; the mask is materialised once per
    forward (B x L x L booleans) and reused by every layer. Remove when torchtitan ships a document-masked SDPA
    backend for language models."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        pass

    _last_mask: tuple = (None, None)  # (VarlenMetadata, mask) of the latest forward

    def __init__(self, config: Config) -> None:
        super(VarlenAttention, self).__init__()  # skip the CUDA flash-attention set-up

    @staticmethod
    def document_causal_mask(meta: VarlenMetadata, batch: int, seq_len: int, device) -> torch.Tensor:
        total = batch * seq_len
        starts = torch.zeros(total + 1, dtype=torch.int32, device=device)
        starts[meta.cu_seq_q.to(device=device, dtype=torch.long)] = 1
        doc = torch.cumsum(starts[:total], 0).view(batch, seq_len)
        same_doc = doc[:, :, None] == doc[:, None, :]
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
        return (same_doc & causal)[:, None]  # (B, 1, L, L), broadcast over heads

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None,
                enable_gqa: bool = False, out_transform=None, **kwargs) -> torch.Tensor:
        if out_transform is not None:
            raise NotImplementedError("SDPADocumentAttention does not support out_transform (attention sinks)")
        B, L = q_BLNH.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        if attention_masks is None:  # a bare forward (no positions): plain causal attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
        else:
            # One VarlenMetadata object is shared by all layers of a forward: build its mask once.
            meta, cache = SDPADocumentAttention._last_mask
            if meta is not attention_masks or cache.shape[0] != B or cache.shape[-1] != L:
                cache = self.document_causal_mask(attention_masks, B, L, q.device)
                SDPADocumentAttention._last_mask = (attention_masks, cache)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=cache, scale=scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)


def use_attention_backend(model_config, backend: str) -> list[str]:
    """Point every attention of a torchtitan model config at `backend`; returns the changed FQNs.
    `sdpa` runs everywhere (CPU, Trainium, CUDA); `flex` is torchtitan's default, CUDA only."""
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}")
    if backend == "flex":
        return []
    changed = []
    for fqn, _cfg, parent, attr in list(model_config.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = SDPADocumentAttention.Config()
        else:
            setattr(parent, attr, SDPADocumentAttention.Config())
        changed.append(fqn)
    return changed


def force_sum_reduction_on_gloo(model_spec) -> None:
    """Workaround: torchtitan disables FSDP's gradient division (factor 1.0), which FSDP turns
    into ReduceOp.PREMUL_SUM; gloo has no PREMUL_SUM. A plain SUM is the same arithmetic when
    the factor is 1. Wraps the spec's parallelize_fn so it applies after FSDP is set up.
    Remove when gloo gains PREMUL_SUM or FSDP maps factor 1.0 to SUM."""
    inner = model_spec.parallelize_fn
    if getattr(inner, "_sum_reduction_wrapped", False):
        return

    def parallelize(model, **kwargs):
        model = inner(model, **kwargs)
        if torch.distributed.get_backend() == "gloo":
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
        return model

    parallelize._sum_reduction_wrapped = True
    model_spec.parallelize_fn = parallelize


def apply_trainer_settings(cfg: Trainer.Config, dev: DeviceInfo, *, seed: int) -> list[str]:
    """The device settings that do not depend on the model family (torchtitan's own models or the
    Transformers backend): CUDA graphs, gloo reductions, seed, determinism, one log line a step."""
    notes = []
    if dev.device_type != "cuda" and "disable_cuda_graphs" in {f.name for f in fields(cfg.training)}:
        # CUDA graphs are on by default in torchtitan 0.3.0 and exist only on CUDA. A torchtitan without the
        # field (it came in 2026-08; the preflight reports it) has no CUDA graphs to turn off.
        cfg.training.disable_cuda_graphs = True
        notes.append("cuda graphs off")
    force_sum_reduction_on_gloo(cfg.model_spec)
    cfg.debug.seed = seed
    cfg.debug.deterministic = dev.device_type == "cpu"  # reproducible losses on CPU
    cfg.metrics.log_freq = 1  # one line and one recorded loss per step
    return notes


# Lines every run printed that ask nothing of the user, each with why (docs/torchtitan-workarounds.md). torchtitan's
# logger messages (a substring of each):
KNOWN_NOISE_LOGS = (
    "has no effect without an initial_load_path",  # CheckpointManager.Config's check at construction: the recipe
    # sets the load path (or none, for random init) after torchtitan's registry builds the config
    "Skipping init_distributed",  # common.device.setup creates the process group first, on purpose (Neuron's order)
    "Error running lspci",  # the device-name probe on a host without pciutils; the name comes from the device
    "Peak flops undefined for",  # torchtitan's A100 fallback on CPU: the pilot's peak is the run's own
    "may not be JSON serializable",  # torchtitan's config dump meeting a torch.dtype (written as its repr)
    "model.safetensors.index.json not found at hf_assets_path",  # a one-file checkpoint's (or random init's) staged
    # assets: torchtitan writes the HF export as one file, which the export check re-reads like any other
    "operations will be performed. This is suboptimal",  # DTensor on torchtitan's 2-D (FSDP x tensor parallel)
    # mesh, gathering a gradient norm or a weight for the checks: the mesh is torchtitan's to flatten
)
# and torch's warnings (a regular expression at the start of each):
KNOWN_NOISE_WARNINGS = (
    r"DTensor random operators may not have complete support on cpu",  # FSDP's init on a CPU mesh: not a result
    r"DTensor manual_seed\(\) may not have complete support on cpu",
    r"'set_vital' is deprecated",  # torchdata's stateful loader calling a deprecated torch hook
    r"In CPU autocast, but the target dtype is not supported",  # torchtitan's MoE router in float32 on CPU
    r"`torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",  # torch's own FutureWarning
    # for the collectives its DTensor calls under tensor parallel
)


class _KnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in KNOWN_NOISE_LOGS)


def quiet_known_noise() -> None:
    """Workaround: leave out of a run's output the torchtitan and torch lines above, which every run printed (11 to
    13 lines a run) and none of which a user can act on; every other warning is printed as before. Remove an entry
    when the torchtitan or torch that printed it no longer does."""
    # torchtitan logs on the root logger, its configs on theirs; DTensor on its own
    for name in ("", "torchtitan.config.configurable", "torch.distributed.tensor._redistribute"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _KnownNoise) for f in logger.filters):
            logger.addFilter(_KnownNoise())
    for message in KNOWN_NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


@contextlib.contextmanager
def full_logits(model):
    """Workaround: the model's forward returns logits inside this block. torchtitan 0.3.0's Trainer sets the
    decoder's `_skip_lm_head` (an attribute, not a forward argument: pipeline parallelism's backward cannot take a bool
    input) so that its chunked loss applies the output projection itself; the forward then returns hidden states. The
    load and export checks compare logits, so the attribute is off for their one forward and set back after. Remove
    when torchtitan's decoder takes the choice as a forward argument."""
    skip = model._skip_lm_head
    model._skip_lm_head = False
    try:
        yield model
    finally:
        model._skip_lm_head = skip


def sdpa_document_attention(cfg: FlexAttention.Config) -> SDPADocumentAttention.Config:
    """Override factory (torchtitan's override registry): FlexAttention -> SDPADocumentAttention.
    Activate with `override.imports = ["common.torchtitan_fixes.sdpa_document_attention"]`; the same change as
    `use_attention_backend(model_config, "sdpa")`, logged per layer by torchtitan."""
    del cfg  # FlexAttention's options (block sizes, mask kinds) have no SDPA counterpart
    return SDPADocumentAttention.Config()


override(target=FlexAttention.Config, exact=True,
         description="causal + packed-document attention through SDPA (CPU, Trainium, CUDA)")(sdpa_document_attention)


