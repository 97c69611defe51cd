"""What a model needs before it runs: weight bytes from the safetensors headers, the fewest cores that hold
them, the sharding plan (tensor parallel, expert parallel, or none), and what kind of model it is."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from common import device
from common.errors import UserError

_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def weight_bytes(ckpt_dir: str | os.PathLike, run_dtype_bytes: int | None = None) -> int:
    """Bytes of the weights, from the safetensors headers alone (nothing is loaded). With
    run_dtype_bytes, floating-point tensors count at the dtype the run casts them to."""
    from common.checkpoint import checkpoint_tensors

    total = 0
    for shape, dtype in checkpoint_tensors(ckpt_dir).values():
        if dtype not in _DTYPE_BYTES:
            raise UserError(f"{ckpt_dir}: safetensors dtype {dtype} is not known to the sizing code")
        per = run_dtype_bytes if (run_dtype_bytes and dtype in _FLOAT_DTYPES) else _DTYPE_BYTES[dtype]
        total += math.prod(shape) * per
    return total


def min_cores(n_bytes: int, core_memory_gib: float) -> int:
    """The fewest cores whose memory holds the weights."""
    return max(1, math.ceil(n_bytes / (core_memory_gib * device.GIB)))


@dataclass(frozen=True)
class Plan:
    runner: str | None  # "single", "tp", "ep", or None when the model is excluded
    cores: int
    exclusion: str | None = None
    # The exclusion comes from --cores/--sharding, not the model: no core count the flags allow divides its
    # heads or experts, where the default choice would have run it. Never a verdict (the check refuses the flags).
    by_flags: bool = False


def num_experts(config) -> int:
    """Experts per MoE layer (0 for a dense model), under the names transformers' configs use."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        n = getattr(config, name, None)
        if isinstance(n, int) and n > 1:
            return n
    return 0


def _text_config(config):
    """A vision-language config keeps its language model's sizes in `text_config`."""
    return getattr(config, "text_config", None) or config


def choose_plan(config, need: int, max_cores: int, sharding: str = "auto", forced_cores: int = 0) -> Plan:
    """The protocol: the fewest cores that hold the weights; tensor parallel when the model has a TP
    plan, expert parallel alone for an MoE model without one, else no sharding plan.

    A TP degree must divide the attention and key/value head counts (transformers splits q/k/v
    projections by heads; SmolLM2's 9 heads fail on 2 ranks), and an EP degree the expert count,
    so the core count is the smallest valid degree at or above what memory needs."""
    if forced_cores:
        need = forced_cores
    if need > max_cores:
        return Plan(None, need, f"needs {need} cores for its weights, more than --max_cores {max_cores}")
    if need == 1:  # `sharding` chooses how to shard, never whether: one core is never sharded
        return Plan("single", 1)
    text = _text_config(config)
    tp_plan = bool(getattr(config, "base_model_tp_plan", None) or getattr(text, "base_model_tp_plan", None))
    ep_plan = bool(getattr(config, "base_model_ep_plan", None) or getattr(text, "base_model_ep_plan", None))
    experts = num_experts(text)
    if sharding == "tp" or (sharding == "auto" and tp_plan):
        if not tp_plan:
            return Plan(None, need, f"no tensor-parallel plan ({type(config).__name__}.base_model_tp_plan is empty)")
        heads = getattr(text, "num_attention_heads", None) or 1
        kv = getattr(text, "num_key_value_heads", None) or heads
        divides = lambda n: heads % n == 0 and kv % n == 0  # noqa: E731
        what = f"{heads} attention and {kv} key/value heads"
        runner = "tp"
    elif sharding == "ep" or (sharding == "auto" and experts and ep_plan):
        if not (experts and ep_plan):
            return Plan(None, need, f"no expert-parallel plan (experts: {experts}, "
                                    f"{type(config).__name__}.base_model_ep_plan: {ep_plan})")
        divides = lambda n: experts % n == 0  # noqa: E731
        what = f"{experts} experts"
        runner = "ep"
    else:
        return Plan(None, need, f"no sharding plan: {type(config).__name__} has no tensor-parallel plan"
                                + (" and no expert-parallel plan" if experts else " and is not a mixture of experts"))
    candidates = [need] if forced_cores else range(need, max_cores + 1)
    for n in candidates:
        if divides(n):
            return Plan(runner, n)
    # The flags' doing where they forced the count, or forced a sharding kind that the default choice would have
    # made work.
    by_flags = bool(forced_cores) or (sharding != "auto" and choose_plan(config, need, max_cores).runner is not None)
    return Plan(None, need, f"no core count in {list(candidates)} divides its {what}", by_flags=by_flags)


def machine_cores(device_type: str, lnc: int = 2) -> int | None:
    """The most cores a run can have on this machine, or None where there is no such bound (CPU: a core is a
    gloo process). CUDA: the visible GPUs. Trainium: NEURON_RT_VISIBLE_CORES where set, else the Neuron
    devices (/dev/neuron*) times a Trainium2 device's cores at this LNC (8 physical; an upper bound elsewhere)."""
    if device_type == "cuda":
        import torch

        return torch.cuda.device_count()
    if device_type == "neuron":
        visible = os.environ.get("NEURON_RT_VISIBLE_CORES", "").strip()
        if visible:
            count = 0
            for part in visible.split(","):
                lo, _, hi = part.strip().partition("-")
                try:
                    count += int(hi) - int(lo) + 1 if hi else 1
                except ValueError:
                    return None  # not a list the runtime takes either: it says so itself
            return count
        devices = [p for p in Path("/dev").glob("neuron*") if p.name[len("neuron"):].isdigit()]
        return len(devices) * (8 // lnc) if devices else None
    return None


def model_type(ckpt_dir: Path) -> str | None:
    """config.json's model_type, read as data (no model code is imported)."""
    try:
        value = json.loads((Path(ckpt_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def is_vision_language(ckpt_dir: Path) -> bool:
    """True when transformers maps the checkpoint's model_type to an image-text-to-text model
    (Qwen3-VL, Qwen2.5-VL, Gemma 3, ...)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return model_type(ckpt_dir) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def needs_remote_code(ckpt_dir: Path) -> bool:
    """A config.json with an auto_map asks transformers to import code shipped with the checkpoint."""
    try:
        return "auto_map" in json.loads((Path(ckpt_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
