"""torchtitan's Transformers modeling backend off CUDA: the fixes it needs, each a named function
with the condition for removing it, and the checks that prove them.

The backend (torchtitan/experiments/transformers_modeling_backend) trains the model that
transformers' `AutoModelForCausalLM` builds from a config.json. In torchtitan 0.3.0 with
transformers 5.16 it needs three things outside CUDA, or outside its happy path:

1. attention: it routes every attention through FlexAttention with a BlockMask made by a compiled
   `create_block_mask` (no CPU backward); `route_attention_to_sdpa` hands HF's own SDPA attention
   a dense causal + packed-document mask instead;
2. RoPE: after meta-device init its rotary `inv_freq` buffers are uninitialised memory;
   `recompute_rotary_buffers` fixes them and `check_rotary_buffers` fails loudly if any is wrong;
3. tied embeddings: the backend unties them for FSDP and ties them again after init;
   `check_embeddings_tied` fails loudly if `lm_head` and `embed_tokens` are not one parameter
   when config.json says they are (before and after training).

This module imports no torchtitan.
"""
from __future__ import annotations

import torch
from torch import nn

# The architectures the recipe accepts: Qwen3 (the tiny and trn2 presets) and Llama (SmolLM2).
# Both run through the backend's "Llama-like" path; others are refused before anything is built.
ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")


# --------------------------------------------------------------------------- 1. attention
def document_causal_mask(positions: torch.Tensor, *, block_causal: bool = True) -> torch.Tensor:
    """(B, 1, L, L) booleans, True where a query may attend to a key: causal and, with
    `block_causal`, inside the same packed document. A document starts where its position is 0,
    the convention of torchtitan's `get_document_mask_mod` and of its data loader."""
    B, L = positions.shape
    causal = torch.ones(L, L, dtype=torch.bool, device=positions.device).tril()
    if not block_causal:
        return causal.expand(B, 1, L, L)
    doc = torch.cumsum((positions == 0).int(), dim=1)
    same_doc = doc[:, :, None] == doc[:, None, :]
    return (same_doc & causal)[:, None]


def _dense_attention_masks(model, positions: torch.Tensor) -> torch.Tensor:
    block_causal = getattr(model.model.config, "attn_mask_type", "causal") == "block_causal"
    return document_causal_mask(positions, block_causal=block_causal)


def attention_masks(model, document_mask: str, device_type: str):
    """The model's `get_attention_masks` (positions -> mask): the dense causal + packed-document mask where documents
    are masked on `device_type` (common.torchtitan_fixes.document_masking), else None (HF's SDPA runs causal)."""
    from common.torchtitan_fixes import document_masking

    if document_masking(document_mask, device_type):
        return lambda positions: _dense_attention_masks(model, positions)
    return lambda positions: None


def route_attention_to_sdpa(model_spec, document_mask: str = "auto") -> None:
    """Workaround: run the backend's attention through transformers' SDPA path with the same
    causal + packed-document mask the backend's FlexAttention would apply.

    Why: in torchtitan 0.3.0 `HFTransformerModel` forces its own flex attention
    (`_attn_implementation = "flex_torchtitan"`) and builds a BlockMask in every forward with a
    compiled `create_block_mask`; flex has no CPU backward and needs Triton/inductor. Here, before
    the model is parallelised, its HF config is switched to `sdpa` and its `get_attention_masks`
    returns a dense (B, 1, L, L) boolean mask built from `positions`, which HF passes unchanged
    to `scaled_dot_product_attention` (a 4D mask is used as is, see transformers'
    masking_utils._preprocess_mask_arguments). Honours the flavor's `attn_mask_type`
    ("block_causal": causal within each document; "causal": plain causal). Where the documents are not masked
    (`document_mask`: common.torchtitan_fixes.document_masking; auto: off on Neuron, whose fused flash attention takes
    no mask) no mask is passed: HF's SDPA path then runs causal SDPA (`is_causal`), as torchtitan's own models do.
    Remove when the backend accepts a non-flex attention implementation with document masks."""
    inner = model_spec.parallelize_fn
    if getattr(inner, "_sdpa_routed", False):
        return

    def parallelize(model, **kwargs):
        from torchtitan.tools.utils import device_type  # the device torchtitan trains on, routed by now

        model.model.config._attn_implementation = "sdpa"
        # An instance attribute: only this model's forward uses the dense mask.
        model.get_attention_masks = attention_masks(model, document_mask, device_type)
        return inner(model, **kwargs)

    parallelize._sdpa_routed = True
    model_spec.parallelize_fn = parallelize


# --------------------------------------------------------------------------- 2. RoPE buffers
def _rotary_modules(model: nn.Module):
    for name, module in model.named_modules():
        if hasattr(module, "inv_freq") and hasattr(module, "config") and hasattr(module, "rope_type"):
            yield name, module


def _expected_inv_freq(module) -> tuple[torch.Tensor, float]:
    """What `module.config` implies for the buffer: transformers' own rule (its
    PreTrainedModel._init_weights, RotaryEmbedding branch)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = module.rope_type
    fn = module.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
    inv_freq, scaling = fn(module.config)
    return inv_freq, scaling


def _rotary_buffer_errors(model: nn.Module) -> tuple[int, list[str]]:
    """(buffers checked, one line per buffer or scaling that differs from what the config implies)."""
    checked, wrong = 0, []
    for name, module in _rotary_modules(model):
        expected, scaling = _expected_inv_freq(module)
        for buf in ("inv_freq", "original_inv_freq"):
            if not hasattr(module, buf):
                continue
            value = getattr(module, buf).detach().float().cpu()
            checked += 1
            if value.shape != expected.shape:
                wrong.append(f"{name}.{buf}: shape {tuple(value.shape)}, config implies {tuple(expected.shape)}")
            elif not torch.equal(value, expected.float()):
                wrong.append(f"{name}.{buf}: max abs diff {(value - expected).abs().max().item():.3g}")
        if module.attention_scaling != scaling:
            wrong.append(f"{name}.attention_scaling: {module.attention_scaling}, config implies {scaling}")
    return checked, wrong


@torch.no_grad()
def recompute_rotary_buffers(model: nn.Module) -> list[str]:
    """Workaround: recompute every rotary `inv_freq` and `original_inv_freq` from the config.

    Why: the trainer builds the model on the meta device and `to_empty()` leaves non-persistent
    buffers as uninitialised memory (values like 2.3e36 were seen); checkpoints do not carry them.
    torchtitan 0.3.0 replaces `PreTrainedModel._init_weights` globally with a version without
    transformers' RotaryEmbedding branch, and its `init_states` recomputes only modules with a
    `rope_init_fn` attribute, which transformers 5 rotary modules no longer keep (a local variable
    of their __init__). The loss then changes silently.
    Returns what was wrong before the recomputation (empty: the fix was not needed).
    Remove when this returns [] on a model straight out of `Trainer.__init__`."""
    _, wrong = _rotary_buffer_errors(model)
    for _name, module in _rotary_modules(model):
        inv_freq, scaling = _expected_inv_freq(module)
        for buf in ("inv_freq", "original_inv_freq"):
            if hasattr(module, buf):
                getattr(module, buf).copy_(inv_freq.to(getattr(module, buf).dtype))
        module.attention_scaling = scaling
    return wrong


class RotaryBufferError(RuntimeError):
    """A rotary buffer is not what the model's config implies: training would silently be wrong."""


def check_rotary_buffers(model: nn.Module) -> int:
    """Fail loudly unless every rotary buffer equals what the config implies (bit for bit: the
    same float32 computation). Returns the number of buffers checked; finding none is an error."""
    checked, wrong = _rotary_buffer_errors(model)
    if checked == 0:
        raise RotaryBufferError(f"no rotary buffer found in {type(model).__name__}: not the layout this check knows")
    if wrong:
        raise RotaryBufferError("rotary buffers differ from what config.json implies: " + "; ".join(wrong))
    return checked


# --------------------------------------------------------------------------- 3. tied embeddings
def embeddings_tied(model) -> bool:
    """True when lm_head and embed_tokens share one parameter (under FSDP: the same DTensor)."""
    return model.lm_head.weight is model.tok_embeddings.weight


def check_embeddings_tied(model, expected: bool) -> None:
    """Guard: fail loudly unless lm_head and embed_tokens are tied exactly when config.json says so.

    Why: `parallelize_hf_transformers` (step 0) unties them so that FSDP can shard them in
    separate groups, and `init_states` ties them again with transformers' `tie_weights()`. The
    tie then holds through training because FSDP2 re-reads each module's parameter before the
    first forward (`FSDPParam.reset_sharded_param`): both groups hold the one sharded parameter,
    both gradients accumulate into it, the optimizer sees it once. Measured on CPU at 1 and 2
    ranks (the export check's logits confirm it after training). Should either step change,
    embedding and lm_head would silently train apart and the export (which stores only
    embed_tokens for a tied model) would not be the trained model.
    Remove when the backend stops untying tied embeddings (FSDP then groups them as one unit)."""
    tied = embeddings_tied(model)
    if tied != expected:
        raise RuntimeError(f"lm_head and embed_tokens are {'tied' if tied else 'not tied'}, but config.json "
                           f"says tie_word_embeddings={expected}")


# --------------------------------------------------------------------------- LR schedule
def fit_decay_to_steps(lr_scheduler, steps: int) -> None:
    """Workaround: the decay share of the schedule, cut to the steps a short run has after its warm-up.

    Why: the AWS guide's builder (`transformers_modeling_backend_full`) sets `decay_ratio=0.8`, so a run of 2 or 3
    steps asks torchtitan for warm-up + decay steps beyond its length; torchtitan then shortens the decay to what is
    left and logs a WARNING ("Warmup (2) + decay (2) steps exceed total steps (3)") about the length the user chose.
    Setting the ratio to that very share here gives torchtitan the schedule it would have adjusted to (the same
    learning rates, step by step) without the warning; runs long enough for 0.8 keep 0.8. Remove when the builder's
    ratio fits short runs or torchtitan's adjustment is silent."""
    ratio = getattr(lr_scheduler, "decay_ratio", None)
    if ratio is None or steps <= 0:
        return
    room = max(steps - int(lr_scheduler.warmup_steps), 0)
    if round(steps * ratio) > room:
        lr_scheduler.decay_ratio = room / steps  # round(steps * room / steps) == room


# --------------------------------------------------------------------------- export
def export_config(hf_config: dict, *, dtype: str) -> dict:
    """The config.json of the export: the input checkpoint's, with the dtype the weights were saved in."""
    cfg = {k: v for k, v in hf_config.items() if k not in ("transformers_version", "_name_or_path")}
    cfg["dtype"] = dtype
    cfg["use_cache"] = True  # the backend turns the cache off for training; inference wants it on
    return cfg
