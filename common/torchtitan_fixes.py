"""The torchtitan 0.3.0 workarounds off CUDA that the training examples share: device settings on a
Trainer.Config, the attention every non-CUDA device can run, gloo-safe FSDP reductions.

Import only after `common.device.setup()` (torchtitan binds its device at import time).
Each workaround is a named function that says why it exists and when it can go.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from dataclasses import dataclass, fields
from typing import Literal

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from torchtitan.config import override
from torchtitan.models.common.attention import FlexAttention, VarlenAttention, VarlenMetadata
from torchtitan.trainer import Trainer

from common.device import DeviceInfo

ATTN_BACKENDS = ("sdpa", "flex")


DOCUMENT_MASK_CHOICES = ("auto", "on", "off")


def document_masking(choice: str, device_type: str) -> bool:
    """Whether the SDPA attention keeps packed documents apart (`choice`: on, off, or auto: on every device but
    Neuron). Why not on Neuron by default: TorchNeuron runs its fused NKI flash-attention kernel only without a mask
    (TorchNeuron's pre-release source, github.com/parmoham-aws/test-repo-parmoham@98154b8
    torch_neuronx/python_ops/scaled_dot_product_fused_attention.py:44-57: sequence a multiple of 512, head_dim at most
    128, no dropout, `attn_bias is None`); with one it falls back to an unfused attention that materialises float32
    Q @ K^T scores with K and V repeated for grouped-query attention (torch_neuronx/python_ops/torch_mlir/ops/
    scaled_dot_product_attention.py:50-80, 148-151). AWS's TorchTitan recipes run plain causal attention: a token
    then also attends to the earlier documents packed into its sequence."""
    if choice not in DOCUMENT_MASK_CHOICES:
        raise ValueError(f"unknown document mask choice {choice!r} (one of {', '.join(DOCUMENT_MASK_CHOICES)})")
    return choice == "on" or (choice == "auto" and device_type != "neuron")


class SDPADocumentAttention(VarlenAttention):
    """Causal attention through `scaled_dot_product_attention`, with packed-document masking or without
    (`document_mask`: document_masking above).

    Why: torchtitan 0.3.0 language models accept only FlexAttention (no CPU backward, needs Triton/inductor) or varlen
    attention (a CUDA kernel), and its plain SDPA class cannot mask documents. Subclassing the varlen config makes the
    trainer ask the model for masks from `positions` before the forward; `masks_before_the_blocks` has the model answer
    with the (B, 1, L, L) boolean mask itself, built once a forward outside the layers (so a layer compiled on its own
    by `--compile` sees a tensor of one shape, never a cache to guard on), or with None where documents are not
    masked: SDPA then runs `is_causal=True`, the form TorchNeuron's fused kernel takes. Remove when torchtitan ships a
    document-masked SDPA backend for language models."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        document_mask: Literal["auto", "on", "off"] = "auto"  # auto: off on Neuron, on elsewhere (document_masking)

    def __init__(self, config: Config) -> None:
        super(VarlenAttention, self).__init__()  # skip the CUDA flash-attention set-up
        document_masking(config.document_mask, "cpu")  # a wrong choice fails at the build, not at the first step
        self.document_mask = config.document_mask

    @staticmethod
    def document_causal_mask(meta: VarlenMetadata, batch: int, seq_len: int, device) -> torch.Tensor:
        """The mask from torchtitan's varlen metadata (a forward whose model was not set up by
        masks_before_the_blocks)."""
        total = batch * seq_len
        starts = torch.zeros(total + 1, dtype=torch.int32, device=device)
        starts[meta.cu_seq_q.to(device=device, dtype=torch.long)] = 1
        doc = torch.cumsum(starts[:total], 0).view(batch, seq_len)
        return _same_document_causal(doc)

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None,
                enable_gqa: bool = False, out_transform=None, **kwargs) -> torch.Tensor:
        if out_transform is not None:
            raise NotImplementedError("SDPADocumentAttention does not support out_transform (attention sinks)")
        B, L = q_BLNH.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        # No boundaries (a bare forward, no positions) or no document masking: plain causal attention
        if attention_masks is None or not document_masking(self.document_mask, q.device.type):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
        else:
            mask = attention_masks if isinstance(attention_masks, torch.Tensor) else \
                self.document_causal_mask(attention_masks, B, L, q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)


def _same_document_causal(doc: torch.Tensor) -> torch.Tensor:
    """(B, 1, L, L) booleans from each token's document number (B, L): a token sees the earlier tokens of its own
    document, broadcast over heads."""
    seq_len = doc.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def document_causal_mask_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """The packed-document mask from torchtitan's `positions` (B, L), which restart at 0 at each document, as its
    varlen metadata reads them (create_varlen_metadata_for_document)."""
    return _same_document_causal(torch.cumsum(positions == 0, dim=1))


def masks_before_the_blocks(model_spec) -> None:
    """The model's attention masks, as the trainer asks for them before each forward (`get_attention_masks`), for a
    model whose attention is SDPADocumentAttention: the dense mask where its documents are masked on this device,
    else None (causal SDPA). One tensor a forward, made outside the layers, shared by all of them. Wraps the spec's
    parallelize_fn (the model exists there). Remove with SDPADocumentAttention."""
    inner = model_spec.parallelize_fn
    if getattr(inner, "_masks_wrapped", False):
        return

    def parallelize(model, **kwargs):
        model = inner(model, **kwargs)
        from torchtitan.tools.utils import device_type  # the device torchtitan trains on, routed by now

        attentions = [m for m in model.modules() if isinstance(m, SDPADocumentAttention)]
        if attentions:
            masked = document_masking(attentions[0].document_mask, device_type)
            model.get_attention_masks = document_causal_mask_from_positions if masked else _no_masks
        return model

    parallelize._masks_wrapped = True
    model_spec.parallelize_fn = parallelize


def _no_masks(positions: torch.Tensor) -> None:
    return None


def use_attention_backend(model_config, backend: str, document_mask: str = "auto") -> list[str]:
    """Point every attention of a torchtitan model config at `backend`; returns the changed FQNs.
    `sdpa` runs everywhere (CPU, Trainium, CUDA), with packed-document masking as `document_mask` says (auto: off
    on Neuron, on elsewhere; document_masking); `flex` is torchtitan's default, CUDA only, always document-masked."""
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}")
    document_masking(document_mask, "cpu")  # the choice checked before anything changes
    if backend == "flex":
        return []
    changed = []
    for fqn, _cfg, parent, attr in list(model_config.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = SDPADocumentAttention.Config(document_mask=document_mask)
        else:
            setattr(parent, attr, SDPADocumentAttention.Config(document_mask=document_mask))
        changed.append(fqn)
    return changed


# The attention a run's layers take, by path (attention_path); the dry run plans its memory by the same names
# (common/harness/dryrun.py attention_bytes).
ATTENTION_PATHS = {
    "sdpa_causal": "causal SDPA, documents not masked (Neuron: TorchNeuron's fused NKI flash attention)",
    "sdpa_document_mask": "SDPA with the packed-document mask (the device's own masked SDPA kernel)",
    "sdpa_document_mask_neuron": "SDPA with the packed-document mask on Neuron: TorchNeuron's unfused fallback, "
                                 "float32 heads x seq x seq scores",
    "flex": "torchtitan's FlexAttention with its document mask (CUDA)",
    "other": "the model's own attention (not swapped by these scripts)",
}


def attention_path(model_config, device_type: str) -> str:
    """The attention path (a key of ATTENTION_PATHS) the layers of `model_config` take on `device_type`: for a
    run's record (results.json) and the dry run's memory plan."""
    ours = [node for _fqn, node, _p, _a in model_config.traverse(SDPADocumentAttention.Config)]
    if ours:
        if not document_masking(ours[0].document_mask, device_type):
            return "sdpa_causal"
        return "sdpa_document_mask_neuron" if device_type == "neuron" else "sdpa_document_mask"
    if any(True for _ in model_config.traverse(FlexAttention.Config)):
        return "flex"
    return "other"


def set_mfu_inputs(metrics, *, flops_per_token: int, peak_flops: float, quantized: bool) -> None:
    """Workaround: torchtitan 0.3.0's MetricsProcessor takes its FLOPs per token from the trainer and its peak from
    its own (CUDA) table, never from its Config, and leaves MFU out of a step's line and TensorBoard only for a
    quantized model (`has_quantization`). Before each `log`, the run's own count (the model's config.json, as
    results.json counts it; > 0) and peak (>= 0; 0: none known) are set, and MFU is left out, as torchtitan leaves a
    quantized run's out, for any step without a positive peak or whose MFU would be above 1: no measurement.
    Remove when MetricsProcessor.Config takes the FLOPs count and the peak."""
    if flops_per_token > 0:
        metrics.num_flops_per_token = flops_per_token
    if peak_flops >= 0:
        metrics.gpu_peak_flops = peak_flops
    elapsed = (time.perf_counter() - metrics.time_last_log) * metrics.parallel_dims.non_data_parallel_size
    tps = metrics.ntokens_since_last_log / elapsed if elapsed > 0 else math.inf
    peak = metrics.gpu_peak_flops
    possible = isinstance(peak, (int, float)) and math.isfinite(peak) and peak > 0
    metrics.has_quantization = quantized or not possible or metrics.num_flops_per_token * tps > peak


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
    masks_before_the_blocks(cfg.model_spec)
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
    "Converted HF modules to Module protocol",  # the Transformers backend, once per module converted (396 lines a
    # SmolLM2 run): a step of its build, nothing to act on
    # and torchtitan's lines that contradict the project's:
    "Peak FLOPS used for computing MFU",  # its device table's peak at build (the A100 fallback on CPU), which the
    # step lines do not use: their MFU and the [pilot] line are against the run's own peak (--peak_tflops)
    "Un-tied embedding/lm_head weights for FSDP",  # the Transformers backend ties them again at init; the [hf] line
    # and the export's tied_lm_head say so, checked (examples/hf_backend/fixes.py: check_embeddings_tied)
    "Preparing c4_test dataset from",  # the loader every dataset of the project's goes through, named c4_test for
    # the corpus and the user's own folder or file too; [config] names the dataset
    "Training completed",  # after its loop, a stop's as a finished run's: [stopped] or [done] says which
    "Detected that context_fn is passed to torch.utils.checkpoint under torch.compile",  # torch's reminder, with
    # --compile and torchtitan's selective activation checkpointing, that its blocks hold no in-place op: torchtitan's
    # blocks, not the user's
)
# and torch's warnings (a regular expression at the start of each):
KNOWN_NOISE_WARNINGS = (
    r"DTensor random operators may not have complete support on cpu",  # FSDP's init on a CPU mesh: not a result
    r"DTensor manual_seed\(\) may not have complete support on cpu",
    r"'set_vital' is deprecated",  # torchdata's stateful loader calling a deprecated torch hook
    r"In CPU autocast, but the target dtype is not supported",  # torchtitan's MoE router in float32 on CPU
    r"`torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",  # torch's own FutureWarning
    # for the collectives its DTensor calls under tensor parallel
    r"To get the last learning rate computed by the scheduler, please use `get_last_lr\(\)`",  # every resume:
    # torchtitan's scheduler load recomputes the rate with get_lr(), which torch means for its own step() only; the
    # rate it recomputes is the schedule's
)


class _KnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in KNOWN_NOISE_LOGS)


def quiet_known_noise() -> None:
    """Workaround: leave out of a run's output the torchtitan and torch lines above, which every run printed (11 to
    13 lines a run, and 396 more a SmolLM2 run) and none of which a user can act on or which contradict the project's
    own lines; every other warning is printed as before (tests/test_quiet.py). Remove an entry when the torchtitan or
    torch that printed it no longer does."""
    # torchtitan logs on the root logger, its configs on theirs; DTensor and torch's checkpoint wrapper on their own
    for name in ("", "torchtitan.config.configurable", "torch.distributed.tensor._redistribute",
                 "torch._higher_order_ops.wrap"):
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


def sdpa_document_attention(cfg: FlexAttention.Config, *, document_mask: str = "auto") -> SDPADocumentAttention.Config:
    """Override factory (torchtitan's override registry): FlexAttention -> SDPADocumentAttention.
    Activate with `override.imports = ["common.torchtitan_fixes.sdpa_document_attention"]`, or with the choice as
    `("common.torchtitan_fixes.sdpa_document_attention", {"document_mask": "on"})`; the same change as
    `use_attention_backend(model_config, "sdpa", document_mask)`, logged per layer by torchtitan."""
    del cfg  # FlexAttention's options (block sizes, mask kinds) have no SDPA counterpart
    document_masking(document_mask, "cpu")
    return SDPADocumentAttention.Config(document_mask=document_mask)


override(target=FlexAttention.Config, exact=True,
         description="causal attention through SDPA, packed documents masked apart but on Neuron (CPU, Trainium, "
                     "CUDA)")(sdpa_document_attention)


