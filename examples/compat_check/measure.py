"""What a run measures besides its tokens: time spent compiling, where the compiled graphs were cached,
and whether the weights or the logits hold NaN or Inf (a model that computes garbage never passes,
even when the device and the CPU reference emit the same garbage token)."""
from __future__ import annotations

import os


def compile_seconds() -> float | None:
    """Seconds this process spent in torch.compile (Dynamo tracing plus the backend compiler).

    Reads torch._dynamo.utils.compilation_time_metrics (private in torch 2.14; "_compile.compile_inner"
    times each frame compilation, backend included). Returns None when a torch release drops it."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return None
    times = compilation_time_metrics.get("_compile.compile_inner")
    return float(sum(times)) if times is not None else None


def compile_cache(device_type: str) -> str:
    """Where this process's compiled graphs are cached, to reuse them with the same compiler version.
    Trainium: the NEFF cache (TORCH_NEURONX_NEFF_CACHE_DIR); elsewhere inductor's cache
    (TORCHINDUCTOR_CACHE_DIR, by default a folder under the temp dir)."""
    if device_type == "neuron":
        where = os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR")
        return f"TORCH_NEURONX_NEFF_CACHE_DIR={where}" if where else \
            "TORCH_NEURONX_NEFF_CACHE_DIR unset: torch-neuronx's default NEFF cache"
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir  # private in torch 2.14
    except ImportError:
        return "TORCHINDUCTOR_CACHE_DIR (torch's default)"
    return f"TORCHINDUCTOR_CACHE_DIR={cache_dir()}"


def nonfinite_weights(model) -> str | None:
    """The first parameter or buffer holding NaN or Inf, as a sentence, or None (a sharded parameter
    is checked on this rank's shard)."""
    import torch

    for kind, named in (("weight", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.is_floating_point() and not bool(torch.isfinite(local).all()):
                return f"non-finite {kind} {name} (NaN or Inf)"
    return None


def nonfinite_logits(logits) -> str | None:
    """The first generation step whose raw logits hold NaN or Inf, as a sentence, or None."""
    import torch

    for step, x in enumerate(logits):
        if not bool(torch.isfinite(x).all()):
            return f"non-finite logits (NaN or Inf) at new token {step}"
    return None


def synchronize(device_type: str) -> None:
    """Wait for queued device work, so that a wall time covers it."""
    import torch

    if device_type == "cuda":
        torch.cuda.synchronize()
    elif device_type == "neuron":  # only reached after setup(): the environment and process group come first
        from common import device

        device.neuron_runtime().synchronize()
