"""--dry_run: will this trn2 configuration fit, decided on a CPU machine before renting hardware.

The full-size model is built on the meta device (no memory) from the very Trainer.Config the run
would use (model spec, overrides, parallelism), and torchtitan's own parallelize function applies
the parallel plan at the intended world size in one process: collectives go to PyTorch's "fake"
process-group backend, so FSDP shards exactly as it would on `world_size` ranks. What each rank
holds is then read from the sharded parameters.

Per-rank memory, in bytes (every term is reported):
  parameters   local shard x 4          (torchtitan keeps float32 master weights, training.dtype)
  gradients    local shard x 4          (FSDP reduce-scatters into float32 sharded grads)
  optimizer    local shard x 8          (AdamW: exp_avg and exp_avg_sq, float32)
  gathered     2 x largest block x c    (FSDP all-gathers one transformer block in the compute dtype
                                         (c bytes a value), plus the prefetched next one)
  activations  an estimate, per rank:   with full activation checkpointing every layer keeps its
               input (b*s*d*c) and one layer at a time is recomputed; without it every layer keeps
               its working set, b*s*34*d*c/2 (Korthikanti et al. 2022, "Reducing Activation
               Recomputation", eq. 2, for 16-bit values, scaled by c/2; their 5*heads*s^2*b term,
               the stored attention scores, is left out: fused attention (SDPA's flash path, the
               Neuron attention kernels) keeps no s x s matrix), plus for MoE layers the routed
               copies b*s*top_k*(3*moe_hidden + d)*c; plus float32 logits b*s*vocab*4.
The per-core limit defaults to 24 GiB (one LNC=2 Trainium2 core: 96 GiB HBM per chip, 4 cores).
"""
from __future__ import annotations

import torch

from common.device import GIB
from common.errors import UserError
from common.results import versions, write_results

TRN2_LNC2_CORE_GIB = 24.0


def _bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def activation_estimate(shape: dict, *, batch: int, seq_len: int, compute_bytes: int, full_ac: bool) -> dict:
    """Activation bytes per rank for one micro-batch (formula in the module docstring). `shape` is
    an HF config.json dict (hidden_size, num_hidden_layers, num_attention_heads, vocab_size, and for
    MoE num_experts_per_tok, moe_intermediate_size)."""
    d, layers = shape["hidden_size"], shape["num_hidden_layers"]
    heads, vocab = shape["num_attention_heads"], shape["vocab_size"]
    del heads  # the attention-score term needs an unfused attention; see the module docstring
    per_layer = batch * seq_len * 34 * d * compute_bytes // 2
    if shape.get("num_experts_per_tok"):
        per_layer += batch * seq_len * shape["num_experts_per_tok"] * (3 * shape["moe_intermediate_size"] + d) * compute_bytes
    kept = layers * batch * seq_len * d * compute_bytes if full_ac else layers * per_layer
    working = per_layer if full_ac else 0
    logits = batch * seq_len * vocab * 4
    return {"checkpointed_or_kept": kept, "recomputed_layer": working, "logits": logits,
            "total": kept + working + logits}


def _blocks(model: torch.nn.Module) -> list[int]:
    """Parameter counts of the transformer blocks: the children of the first `layers` container."""
    for name, mod in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(mod, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            return [sum(p.numel() for p in block.parameters()) for block in mod.children()]
    raise RuntimeError("no `layers` container in the model")


def dry_run(tc, *, shape: dict, world_size: int, per_core_gib: float, published_params: float | None,
            label: str) -> dict:
    """Build `tc`'s model on meta, shard it for `world_size` ranks with torchtitan's plan, and size
    one rank. `shape` is the model's config.json (for the activation estimate and weight tying).
    Call in a process without a process group (it creates and destroys a fake one)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.config import apply_overrides
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC

    if world_size <= 0:
        raise UserError(f"--dry_run_ranks must be positive, got {world_size}")
    from common.device import check_batch_split

    lbs = tc.training.local_batch_size
    check_batch_split(tc.training.global_batch_size, lbs, world_size)
    model_config = tc.model_spec.model
    model_config.update_from_config(config=tc)
    if tc.override.imports:
        apply_overrides(tc.override, tc)
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        parallel_dims = ParallelDims.from_config(tc.parallelism, world_size)
        with torch.device("meta"):
            model = model_config.build()
        n_params = sum(p.numel() for p in model.parameters())  # shared (tied) tensors count once
        blocks = _blocks(model)
        model = tc.model_spec.parallelize_fn(
            model, parallel_dims=parallel_dims, training=tc.training, parallelism=tc.parallelism,
            compile_config=tc.compile, ac_config=tc.activation_checkpoint, dump_folder=tc.dump_folder)
        # torchtitan unties a tied lm_head for FSDP and ties it again when it initialises the weights
        # (after this point): count the shared tensor once, as the rank will hold it.
        tied = shape.get("tie_word_embeddings", False)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                    for name, p in model.named_parameters() if not (tied and name.endswith("lm_head.weight")))
    finally:
        dist.destroy_process_group()

    compute = _bytes(tc.training.mixed_precision_param)
    act = activation_estimate(shape, batch=lbs, seq_len=tc.training.seq_len, compute_bytes=compute,
                              full_ac=isinstance(tc.activation_checkpoint, FullAC.Config))
    per_rank = {"parameters": local * 4, "gradients": local * 4, "optimizer_state": local * 8,
                "gathered_blocks": 2 * max(blocks) * compute, "activations": act["total"]}
    total = sum(per_rank.values())
    limit = int(per_core_gib * GIB)
    result = {
        "label": label, "world_size": world_size, "parameters": n_params,
        "published_parameters": published_params,
        "parameters_vs_published": (n_params / published_params - 1) if published_params else None,
        "local_parameters_per_rank": local, "data_parallel_shard": parallel_dims.dp_shard,
        "per_rank_bytes": per_rank, "activation_terms": act, "total_bytes": total,
        "per_core_limit_bytes": limit, "fits": total <= limit,
        "overflow": [] if total <= limit else _overflow(per_rank, limit),
    }
    return result


def _overflow(per_rank: dict, limit: int) -> list[str]:
    """Every term, largest first, marking those that alone exceed the limit."""
    return [f"{name} {b / GIB:.2f} GiB" + (" (alone over the limit)" if b > limit else "")
            for name, b in sorted(per_rank.items(), key=lambda kv: -kv[1])]


def format_table(r: dict) -> str:
    rows = [f"[dry run] {r['label']}: {r['parameters'] / 1e9:.3f} B parameters"
            + (f" (published {r['published_parameters'] / 1e9:.1f} B, {100 * r['parameters_vs_published']:+.2f}%)"
               if r["published_parameters"] else ""),
            f"[dry run] per rank at {r['world_size']} ranks (FSDP shard {r['data_parallel_shard']}):"]
    for name, b in r["per_rank_bytes"].items():
        rows.append(f"    {name:16s} {b / GIB:9.3f} GiB")
    rows.append(f"    {'total':16s} {r['total_bytes'] / GIB:9.3f} GiB of {r['per_core_limit_bytes'] / GIB:.1f} GiB"
                f" per core: {'fits' if r['fits'] else 'DOES NOT FIT'}")
    return "\n".join(rows)


def finish(r: dict, *, out_dir, results: dict, per_core_gib: float) -> dict:
    """Print the table, write results.json with the `dry_run` section, then fail (exit 2) when the
    size is off the published one or the plan does not fit, naming what overflows."""
    from common import cli

    print(format_table(r))
    write_results(out_dir, {**results, "versions": versions(), "dry_run": r})
    check_published(r)
    if not r["fits"]:
        raise UserError(f"the plan does not fit {per_core_gib:g} GiB per core at {r['world_size']} ranks: "
                        f"{r['total_bytes'] / GIB:.2f} GiB needed: " + ", ".join(r["overflow"]))
    return r


def check_published(r: dict, tolerance: float = 0.01) -> None:
    """The built model's size must match the published one (a wrong shape shows up here first)."""
    if r["published_parameters"] and abs(r["parameters_vs_published"]) > tolerance:
        raise UserError(f"{r['label']}: built model has {r['parameters'] / 1e9:.3f} B parameters, "
                        f"{100 * r['parameters_vs_published']:+.1f}% off the published "
                        f"{r['published_parameters'] / 1e9:.1f} B")

