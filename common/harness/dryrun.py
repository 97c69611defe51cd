"""--dry_run: will this trn2 configuration fit, decided on a CPU machine before renting hardware.

The full-size model is built on the meta device (no memory) from the very Trainer.Config the run
would use (model spec, overrides, parallelism), and torchtitan's own parallelize function applies
the parallel plan at the intended world size in one process: collectives go to PyTorch's "fake"
process-group backend, so FSDP shards exactly as it would on `world_size` ranks. What each rank
holds is then read from the sharded parameters and from FSDP's units.

Per-rank memory is the sum of six terms (parameters, gradients, optimizer state, gathered blocks, gradient
buffers, activations), each at its own peak; the formulas and their measured errors are in docs/memory-model.md.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from common.device import GIB
from common.errors import UserError
from common.results import versions, write_results

REDUCE_BYTES = 4  # FSDP reduces gradients in float32 (training.mixed_precision_reduce)


def _bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def attention_bytes(path: str, *, batch: int, seq_len: int, heads: int, compute_bytes: int, tp: int = 1) -> dict:
    """What the attention of the layer in its backward adds per rank, by path (common/torchtitan_fixes.py
    ATTENTION_PATHS): `mask`, the packed-document mask; `scores`, heads x seq x seq tensors (the heads a rank holds
    under tensor parallel). Causal SDPA and FlexAttention hold neither (fused, tiled kernels). With the document
    mask: the boolean mask built once a forward (1 byte) and SDPA's copy of it in the query's dtype for each call
    (torch's attention.cpp converts a boolean mask for the fused backends: `convert_boolean_attn_mask`). On Neuron,
    where the mask sends TorchNeuron to its unfused fallback (github.com/parmoham-aws/test-repo-parmoham@98154b8
    torch_neuronx/python_ops/scaled_dot_product_fused_attention.py:56-57, then torch_mlir/ops/
    scaled_dot_product_attention.py): a float32 copy of the mask in its backward (:219) and float32 scores, which
    its forward computes and drops (logits, exponentials, probabilities: :54-72; only the log-sum-exp is kept) and
    its backward recomputes: probabilities, their gradient and the scores' gradient in float32 together, and that
    gradient again in the compute dtype as the mask's gradient (:232-255): 3 x 4 + c bytes a score. An upper bound
    from the source as written: Neuron's compiler may fuse some of them (to be measured on the device). "other"
    (an attention these scripts do not swap, the Transformers backend's): a float32 mask, as measured on CPU."""
    tokens2 = batch * seq_len * seq_len
    scores = batch * (heads // tp) * seq_len * seq_len
    c = compute_bytes
    return {"sdpa_causal": {"mask": 0, "scores": 0},
            "flex": {"mask": 0, "scores": 0},
            "sdpa_document_mask": {"mask": tokens2 * (1 + c), "scores": 0},
            "sdpa_document_mask_neuron": {"mask": tokens2 * (1 + c + 4), "scores": scores * (3 * 4 + c)},
            "other": {"mask": tokens2 * 4, "scores": 0}}[path]


def activation_estimate(shape: dict, *, batch: int, seq_len: int, compute_bytes: int, ac: str = "full",
                        loss_chunks: int = 1, tp: int = 1, attention: str = "sdpa_document_mask") -> dict:
    """Activation bytes per rank for one micro-batch (docs/memory-model.md) of the model an HF config.json dict
    describes. `ac`: torchtitan's activation checkpointing, none, selective or full. `loss_chunks`: the chunks of
    torchtitan's ChunkedLossWrapper (1: the whole logits at once). `tp`: the tensor-parallel degree, with sequence
    parallel on (torchtitan's default): the checkpointed activations and the logits are split over the `tp` ranks,
    the layer being recomputed in the backward is not (measured). `attention`: the layers' attention path
    (attention_bytes)."""
    c, tokens = compute_bytes, batch * seq_len
    d, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    heads = shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or d // heads
    d_q, d_kv = heads * head_dim, (shape.get("num_key_value_heads") or heads) * head_dim
    if shape.get("num_experts_per_tok"):  # the routed copies of every token
        mlp_saved = mlp_in_flight = shape["num_experts_per_tok"] * (3 * shape["moe_intermediate_size"] + d) // 2
        mlp_mm = shape["num_experts_per_tok"] * (2 * shape["moe_intermediate_size"] + d)  # gate, up, down outputs
    else:  # gate, up, activation, product saved; two gradients of that size in flight
        mlp_saved, mlp_in_flight = 4 * shape["intermediate_size"], 2 * shape["intermediate_size"]
        mlp_mm = 2 * shape["intermediate_size"] + d
    saved = tokens * (4 * d + 4 * d_q + 4 * d_kv + mlp_saved) * c // tp  # what one block keeps for its backward
    # selective (torchtitan's per-op policy): the block's input, the attention's output, and every second matmul's
    # output (q, k, v, o and the MLP's; the others are recomputed in the backward)
    selective = tokens * (d + d_q + (d_q + 2 * d_kv + d + mlp_mm) // 2) * c // tp
    in_flight = (tokens * mlp_in_flight * c + tokens * d * 4) // tp  # the MLP's gradients; dh
    att = attention_bytes(attention, batch=batch, seq_len=seq_len, heads=heads, compute_bytes=c, tp=tp)
    kept = {"full": layers * tokens * d * c // tp, "selective": layers * selective, "none": layers * saved}[ac]
    if ac == "none" and att["mask"]:  # each layer keeps SDPA's copy of the mask for its backward
        kept += layers * batch * seq_len * seq_len * c
    chunk = tokens // max(loss_chunks, 1) * vocab // tp
    loss_work = max(chunk * (c + 12), chunk * 8 + vocab * d * c // tp) + tokens * d * (c + 4) // tp
    if tp > 1:  # the vocabulary-parallel cross entropy holds one more float32 copy of a chunk's logit slice
        loss_work += chunk * 4  # (measured at TP 2: the loss phase 1.26 of the estimate without it)
    # The layer in its backward is held whole under tensor parallel: measured at TP 2, the decoder's backward took
    # 1.7 to 2.1 times its 1/tp share (0.9 to 1.1 of the whole layer's)
    decoder_work = ({"full": saved, "selective": saved - selective, "none": 0}[ac] + in_flight) * tp \
        + att["mask"] + att["scores"]
    return {"checkpointed_or_kept": kept, "loss_working_set": loss_work, "recomputed_layer": decoder_work,
            "attention": attention, "attention_mask": att["mask"], "attention_scores": att["scores"],
            "loss_phase": kept + loss_work, "decoder_backward_phase": kept + decoder_work,
            "total": kept + max(loss_work, decoder_work)}


def _units(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> tuple[list[int], list[int]]:
    """Parameter counts of FSDP's units (outside the blocks, blocks), each parameter at full size as gathered."""
    from torch.distributed.fsdp import FSDPModule

    block_ids = {id(b) for b in blocks}
    seen, other, block = set(), [], []
    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        group = mod._get_fsdp_state()._fsdp_param_group  # FSDP2 internals (torch 2.14), read only
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        numel = sum(fp.sharded_param.numel() for fp in group.fsdp_params)  # a DTensor's numel is global
        (block if id(mod) in block_ids else other).append(numel)
    return other, block


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: the children of the first `layers` container."""
    for name, mod in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(mod, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            return list(mod.children())
    raise RuntimeError("no `layers` container in the model")


def _loss_chunks(tc) -> int:
    from torchtitan.components.loss import ChunkedLossWrapper

    return tc.loss.num_chunks if isinstance(tc.loss, ChunkedLossWrapper.Config) else 1


def dry_run(tc, *, shape: dict, world_size: int, per_core_gib: float, published_params: float | None,
            label: str, device_type: str = "neuron") -> dict:
    """Build `tc`'s model on meta, shard it for `world_size` ranks with torchtitan's plan, and size one rank.
    `shape`: the model's config.json. `device_type`: the device planned for (trn2's Neuron by default), which
    decides the attention path of `tc`'s layers (common/torchtitan_fixes.py attention_path). Call without a
    process group (a fake one is made and destroyed), once per process: torchtitan 0.3.0's spmd_types path refuses
    a second plan in the same process."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.config import apply_overrides
    from torchtitan.distributed import ParallelDims
    from common.recipe import activation_checkpoint_mode
    from common.torchtitan_fixes import ATTENTION_PATHS, attention_path

    if world_size <= 0:
        raise UserError(f"--dry_run_ranks must be positive, got {world_size}")
    lbs = tc.training.local_batch_size  # the layout divides: checked before (common.recipe.check_layout)
    model_config = tc.model_spec.model
    model_config.update_from_config(config=tc)
    if tc.override.imports:
        apply_overrides(tc.override, tc)
    attention = attention_path(model_config, device_type)  # after the overrides: the MoE recipe swaps it there
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        parallel_dims = ParallelDims.from_config(tc.parallelism, world_size)
        with torch.device("meta"):
            model = model_config.build()
        n_params = sum(p.numel() for p in model.parameters())  # shared (tied) tensors count once
        blocks = _blocks(model)
        largest_block = max(sum(p.numel() for p in b.parameters()) for b in blocks)
        model = tc.model_spec.parallelize_fn(
            model, parallel_dims=parallel_dims, training=tc.training, parallelism=tc.parallelism,
            compile_config=tc.compile, ac_config=tc.activation_checkpoint, dump_folder=tc.dump_folder)
        # torchtitan unties a tied lm_head for FSDP and ties it again when it initialises the weights
        # (after this point): count the shared tensor once, as the rank will hold it.
        tied = shape.get("tie_word_embeddings", False)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                    for name, p in model.named_parameters() if not (tied and name.endswith("lm_head.weight")))
        other_units, _block_units = _units(model, _blocks(model))
    finally:
        dist.destroy_process_group()

    built = {"shape": shape, "local": local, "outside_blocks": max(other_units, default=0),
             "largest_block": largest_block, "world_size": world_size, "seq_len": tc.training.seq_len,
             "compute": _bytes(tc.training.mixed_precision_param), "loss_chunks": _loss_chunks(tc),
             "attention": attention}
    tp, ac = parallel_dims.tp, activation_checkpoint_mode(tc)
    per_rank, act = per_rank_terms(built, tp=tp, ac=ac, local_batch=lbs)
    total = sum(per_rank.values())
    limit = int(per_core_gib * GIB)
    layouts = what_fits(built, limit=limit, global_batch=tc.training.global_batch_size)
    return {
        "label": label, "world_size": world_size, "parameters": n_params,
        "published_parameters": published_params,
        "parameters_vs_published": (n_params / published_params - 1) if published_params else None,
        "local_parameters_per_rank": local, "data_parallel_shard": parallel_dims.dp_shard,
        "tensor_parallel": tp, "activation_checkpoint": activation_checkpoint_mode(tc), "local_batch_size": lbs,
        "attention": {"path": attention, "description": ATTENTION_PATHS[attention], "device_type": device_type,
                      "mask_bytes": act["attention_mask"],
                      "score_bytes": act["attention_scores"]},
        "fsdp_units": {"largest_outside_blocks": max(other_units, default=0), "largest_block": largest_block},
        "per_rank_bytes": per_rank, "activation_terms": act, "total_bytes": total,
        "per_core_limit_bytes": limit, "fits": total <= limit,
        "overflow": [] if total <= limit else _overflow(per_rank, limit),
        "layouts": layouts, "preferred_fitting_layout": next((row for row in layouts if row["fits"]), None),
    }


def per_rank_terms(built: dict, *, tp: int, ac: str, local_batch: int) -> tuple[dict, dict]:
    """One rank's six terms (bytes) and the activation terms for a layout, from a meta build's figures (`built`):
    the parameters it holds (every parameter is sharded over all the ranks, by FSDP and tensor parallel together,
    so their count per rank is the same at any degree), its FSDP units' sizes (each gathered over the
    data-parallel ranks, under tensor parallel a 1/tp slice of it)."""
    shape, world_size, local, compute = (built[k] for k in ("shape", "world_size", "local", "compute"))
    r = REDUCE_BYTES
    act = activation_estimate(shape, batch=local_batch, seq_len=built["seq_len"], compute_bytes=compute, ac=ac,
                              loss_chunks=built["loss_chunks"], tp=tp,
                              attention=built.get("attention", "sdpa_document_mask"))
    dp = world_size // tp  # FSDP's ranks: it gathers and reduces over these only
    k = 2 if dp > 1 else 1
    unit = (built["outside_blocks"] + built["largest_block"]) // tp
    cast = unit // dp * compute if compute != 4 else 0  # the local shard cast for the all-gather
    grad_unit = max(shape["vocab_size"] * shape["hidden_size"], built["largest_block"]) // tp
    per_element = compute + r + r / dp if dp > 1 else max(compute + r, 2 * r)
    return {"parameters": local * 4, "gradients": local * 4, "optimizer_state": local * 8,
            "gathered_blocks": k * unit * compute + cast, "gradient_buffers": int(grad_unit * per_element),
            "activations": act["total"]}, act


AC_MODES = ("none", "selective", "full")  # least recompute first
LOCAL_BATCHES = (4, 2, 1)  # most sequences a rank first


def what_fits(built: dict, *, limit: int, global_batch: int) -> list[dict]:
    """Every layout of the same ranks, in the order a run would prefer it: the fewest tensor-parallel ranks (each
    adds collectives inside every layer), then the least recompute, then the most sequences a rank (fewer
    micro-steps); each with its per-rank total and whether it fits `limit`. Tensor-parallel degrees: those dividing
    the ranks and the model's heads, key/value heads and MLP width; local batches: those the global batch splits
    into (any, for -1)."""
    shape, world = built["shape"], built["world_size"]
    widths = [shape.get(k) for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                                     "moe_intermediate_size")]
    rows = []
    for tp in (t for t in (1, 2, 4, 8, 16) if world % t == 0 and all(not w or w % t == 0 for w in widths)
               and built["seq_len"] % t == 0):
        dp = world // tp
        for ac in AC_MODES:
            for lb in LOCAL_BATCHES:
                if global_batch > 0 and global_batch % (lb * dp):
                    continue
                per_rank, _ = per_rank_terms(built, tp=tp, ac=ac, local_batch=lb)
                total = sum(per_rank.values())
                rows.append({"tensor_parallel": tp, "data_parallel": dp, "activation_checkpoint": ac,
                             "local_batch_size": lb, "total_bytes": total, "fits": total <= limit})
    return rows


def layout_flags(row: dict) -> str:
    return (f"--tensor_parallel_degree {row['tensor_parallel']} --activation_checkpoint "
            f"{row['activation_checkpoint']} --local_batch_size {row['local_batch_size']}")


def format_layouts(r: dict) -> str:
    """The what-fits table: per-rank GiB of each tensor-parallel degree x activation checkpointing (rows) at each
    local batch (columns), and the layout a run would pick."""
    rows = r["layouts"]
    if not rows:
        return ""
    batches = sorted({row["local_batch_size"] for row in rows})
    lines = [f"[dry run] what fits {r['per_core_limit_bytes'] / GIB:.1f} GiB per core at {r['world_size']} ranks "
             f"(GiB per rank; * fits):",
             "    TP  data-par  AC         " + "".join(f"  batch {b:<3d}" for b in batches)]
    for tp, ac in dict.fromkeys((row["tensor_parallel"], row["activation_checkpoint"]) for row in rows):
        cells = {row["local_batch_size"]: row for row in rows
                 if (row["tensor_parallel"], row["activation_checkpoint"]) == (tp, ac)}
        dp = r["world_size"] // tp
        lines.append(f"    {tp:<3d} {dp:<9d} {ac:<10s} " + "".join(
            f"  {cells[b]['total_bytes'] / GIB:8.2f}{'*' if cells[b]['fits'] else ' '}" if b in cells else
            f"  {'-':>9s}" for b in batches))
    pick = r["preferred_fitting_layout"]
    lines.append(f"[dry run] the run's own layout: --tensor_parallel_degree {r['tensor_parallel']} "
                 f"--activation_checkpoint {r['activation_checkpoint']} --local_batch_size {r['local_batch_size']}: "
                 f"{r['total_bytes'] / GIB:.2f} GiB, {'fits' if r['fits'] else 'does not fit'}")
    lines.append(f"[dry run] first layout that fits, in the order above (the fewest tensor-parallel ranks, then the "
                 f"least recompute, then the most sequences a rank: the least communication and recompute, not the "
                 f"least memory): {layout_flags(pick)}, {pick['total_bytes'] / GIB:.2f} GiB" if pick else
                 "[dry run] no layout of these ranks fits: more ranks (--dry_run_ranks), a shorter --seq_len")
    return "\n".join(lines)


def _overflow(per_rank: dict, limit: int) -> list[str]:
    """Every term, largest first, marking those that alone exceed the limit."""
    return [f"{name} {b / GIB:.2f} GiB" + (" (alone over the limit)" if b > limit else "")
            for name, b in sorted(per_rank.items(), key=lambda kv: -kv[1])]


def format_table(r: dict) -> str:
    rows = [f"[dry run] {r['label']}: {r['parameters'] / 1e9:.3f} B parameters"
            + (f" (published {r['published_parameters'] / 1e9:.1f} B, {100 * r['parameters_vs_published']:+.2f}%)"
               if r["published_parameters"] else ""),
            f"[dry run] per rank at {r['world_size']} ranks (FSDP shard {r['data_parallel_shard']}, tensor parallel "
            f"{r['tensor_parallel']}, activation checkpointing {r['activation_checkpoint']}, local batch "
            f"{r['local_batch_size']}):"]
    for name, b in r["per_rank_bytes"].items():
        rows.append(f"    {name:16s} {b / GIB:9.3f} GiB")
    if r.get("attention"):
        a = r["attention"]
        rows.insert(2, f"[dry run] attention on {a['device_type']}: {a['description']} (in activations: "
                       f"mask {a['mask_bytes'] / GIB:.3f} GiB, scores {a['score_bytes'] / GIB:.3f} GiB)")
    rows.append(f"    {'total':16s} {r['total_bytes'] / GIB:9.3f} GiB of {r['per_core_limit_bytes'] / GIB:.1f} GiB"
                f" per core: {'fits' if r['fits'] else 'DOES NOT FIT'}")
    return "\n".join(rows + ([format_layouts(r)] if r.get("layouts") else []))


def finish(r: dict, *, out_dir, results: dict, per_core_gib: float) -> dict:
    """Print the table and write results.json, then fail (exit 2) when the size is off the published one or the
    plan does not fit, naming what overflows."""
    print(format_table(r))
    write_results(out_dir, {**results, "versions": versions(), "dry_run": r})
    check_published(r)
    if not r["fits"]:
        pick = r.get("preferred_fitting_layout")
        raise UserError(f"the plan does not fit {per_core_gib:g} GiB per core at {r['world_size']} ranks: "
                        f"{r['total_bytes'] / GIB:.2f} GiB needed: " + ", ".join(r["overflow"])
                        + (f"; a layout that fits: {layout_flags(pick)}" if pick else ""))
    return r


def check_published(r: dict, tolerance: float = 0.01) -> None:
    """The built model's size must match the published one (a wrong shape shows up here first)."""
    if r["published_parameters"] and abs(r["parameters_vs_published"]) > tolerance:
        raise UserError(f"{r['label']}: built model has {r['parameters'] / 1e9:.3f} B parameters, "
                        f"{100 * r['parameters_vs_published']:+.1f}% off the published "
                        f"{r['published_parameters'] / 1e9:.1f} B")


CHECKPOINT_BYTES_PER_PARAMETER = 12  # torchtitan saves the float32 weights (4) and AdamW's two moments (8)


def checkpoint_plan(parameters: int, cfg, have: int = 0, shape: dict | None = None) -> dict:
    """The disk a run's saves take at their peak in OUT_DIR: the resumable checkpoints it holds (--keep_checkpoints
    of its --checkpoint_every saves, or a stop's one save), one more while the newest is written and before
    torchtitan removes the oldest, and the HF export; less the `have` whole checkpoints already there. A tied
    embedding (`shape`'s tie_word_embeddings) is saved under both its names, its weights twice (measured: the tiny
    Qwen3's 9.8 M parameters, 157.0 MB a checkpoint; 12 bytes a parameter and the embedding again: 156.5 MB)."""
    tied = shape["vocab_size"] * shape["hidden_size"] if shape and shape.get("tie_word_embeddings") else 0
    per_checkpoint = parameters * CHECKPOINT_BYTES_PER_PARAMETER + tied * 4
    export = parameters * (4 if cfg.dtype == "float32" else 2) if cfg.export else 0  # checkpoint.export_dtype
    every = 1 if cfg.guards.checkpoint_every == "auto" else int(cfg.guards.checkpoint_every)  # auto: at most every step
    # The last step's save is never a resumable one: torchtitan 0.3.0 saves that step model-only as the export
    # (checkpointer/dcp.py:413-418, its `last_step` branch), or not at all with --no-export (GuardedCheckpointer).
    # The most a run holds: the periodic saves before the last step and a stop's (common/harness/trainer.py's
    # should_continue_training saves a stop that came during the last step's evaluation, beside the export).
    saves = (cfg.steps - 1) // every + 1 if every else 1  # no periodic saves: a stop's one
    # With --async_checkpoint torchtitan lists the step folders to purge (dcp.py:466, 825-841) right after it
    # starts the background write, before that write creates its own folder (DCP's FileSystemWriter makes it in
    # prepare_local_plan, in the writer's thread: torch/distributed/checkpoint/filesystem.py:656,
    # state_dict_saver.py:349): the purge keeps --keep_checkpoints older ones beside the new, one more at rest.
    keep = cfg.guards.keep_checkpoints + (1 if cfg.guards.keep_checkpoints and cfg.guards.async_checkpoint else 0)
    kept = min(saves, keep) if keep else saves
    peak = kept + (1 if keep and saves > kept else 0)  # the newest being written before the oldest goes
    return {"checkpoint_bytes": per_checkpoint, "checkpoints_kept": kept, "peak_checkpoints": peak,
            "export_bytes": export, "existing_checkpoints": have, "async_checkpoint": bool(cfg.guards.async_checkpoint),
            "needed_bytes": max(peak - have, 0) * per_checkpoint + export}


def free_bytes(folder: Path) -> tuple[int, Path]:
    """The free space of the filesystem that holds `folder` (its nearest existing parent), and that folder."""
    import shutil

    folder = Path(folder)
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return shutil.disk_usage(folder).free, folder


def format_disk(plan: dict, out_dir) -> str:
    free, where = free_bytes(out_dir)
    return (f"[dry run] disk: {plan['peak_checkpoints']} checkpoint(s) of {plan['checkpoint_bytes'] / GIB:.1f} GiB at "
            f"the peak (--keep_checkpoints, --checkpoint_every, --async_checkpoint) + the export {plan['export_bytes'] / GIB:.1f} GiB = "
            f"{plan['needed_bytes'] / GIB:.1f} GiB in OUT_DIR (free on this machine's {where}: {free / GIB:.1f} GiB; "
            "the run checks its own before the launch)")


def check_disk(out_dir, plan: dict) -> None:
    """One UserError when OUT_DIR's filesystem lacks the room `plan` (checkpoint_plan) needs."""
    free, where = free_bytes(out_dir)
    if plan["needed_bytes"] > free:
        raise UserError(
            f"not enough disk for this run's saves: {plan['needed_bytes'] / GIB:.1f} GiB needed in {out_dir} "
            f"({plan['peak_checkpoints']} checkpoint(s) of {plan['checkpoint_bytes'] / GIB:.2f} GiB at the peak, "
            f"{plan['existing_checkpoints']} already there, + the export {plan['export_bytes'] / GIB:.2f} GiB) and "
            f"{where} has {free / GIB:.1f} GiB free: free space, lower --keep_checkpoints (at least 2, 0 keeps all), "
            + ("drop --async_checkpoint (it holds one more), " if plan.get("async_checkpoint") else "")
            + "or choose another --out_dir")


def parameter_estimate(shape: dict) -> int:
    """Parameters of a (dense or MoE) Qwen3 config.json, from its numbers alone (no model built)."""
    d, layers, vocab, heads = (shape[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size",
                                                  "num_attention_heads"))
    head_dim = shape.get("head_dim") or d // heads
    d_q, d_kv = heads * head_dim, (shape.get("num_key_value_heads") or heads) * head_dim
    experts = shape.get("num_experts") or shape.get("num_local_experts")
    mlp = experts * (3 * d * shape["moe_intermediate_size"] + d) if experts else 3 * d * shape["intermediate_size"]
    block = 2 * d * d_q + 2 * d * d_kv + mlp + 2 * d + 2 * head_dim
    return vocab * d * (1 if shape.get("tie_word_embeddings") else 2) + layers * block + d


def check_fits(shape: dict, *, local_batch: int, seq_len: int, dtype: str, world_size: int, device_type: str,
               per_core_gib: float, tp: int = 1) -> None:
    """Before anything is launched: refuse a run whose per-rank memory cannot fit even at its lower bound
    (sharded float32 weights, gradients and AdamW state; activations with every block checkpointed) in what one
    rank has: its share of the CPU's available memory, a GPU's memory, or --per_core_gib on Trainium."""
    try:
        state = parameter_estimate(shape) * 16 // world_size
        acts = activation_estimate(shape, batch=local_batch, seq_len=seq_len, compute_bytes=_bytes(dtype),
                                   ac="full", tp=tp)["total"]
    except (KeyError, TypeError):  # a config.json without these numbers: the load refuses it later, by name
        return
    if device_type == "cpu":
        import psutil

        ranks_here = min(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        limit, where = psutil.virtual_memory().available // ranks_here, f"{ranks_here} rank(s)' share of free memory"
    elif device_type == "cuda":
        limit, where = torch.cuda.get_device_properties(0).total_memory, "one GPU"
    else:
        limit, where = int(per_core_gib * GIB), f"--per_core_gib {per_core_gib:g}"
    if state + acts > limit:
        raise UserError(f"this run needs at least {(state + acts) / GIB:.1f} GiB per rank (weights, gradients and "
                        f"optimizer state {state / GIB:.1f} GiB, activations {acts / GIB:.1f} GiB for --local_batch_size "
                        f"{local_batch} x --seq_len {seq_len}) and {where} is {limit / GIB:.1f} GiB: lower them, or "
                        "see --dry_run")


def project(cfg, tc, shape: dict, world_size: int) -> dict | None:
    """With --assumed_mfu: the full run's time (and with --price_per_hour its cost) from its FLOPs, at that MFU of
    the target's peak (--peak_tflops, or for --device neuron trn2's 79 TFLOPS per NeuronCore x --lnc); printed."""
    if not cfg.guards.assumed_mfu:
        return None
    from common.harness import pilot

    peak = (cfg.guards.peak_tflops * 1e12 if cfg.guards.peak_tflops
            else pilot.trn2_peak(cfg.lnc) if cfg.device == "neuron" else None)
    if peak is None:
        raise UserError(f"--assumed_mfu needs --peak_tflops for --device {cfg.device} (trn2's peak is known: "
                        "--device neuron)")
    batch = tc.training.global_batch_size
    batch = batch if batch > 0 else tc.training.local_batch_size * world_size
    p = pilot.project(steps=cfg.steps, tokens_per_step=batch * tc.training.seq_len,
                      flops=pilot.flops_per_token(shape, tc.training.seq_len), world_size=world_size, peak=peak,
                      mfu=cfg.guards.assumed_mfu, price_per_hour=cfg.guards.price_per_hour)
    print(f"[plan] {p['steps']} steps x {p['tokens_per_step']:,} tokens x {p['flops_per_token'] / 1e9:.2f} GFLOP/token "
          f"at MFU {p['assumed_mfu']:g} of {world_size} x {peak / 1e12:.0f} TFLOPS: {p['seconds'] / 60:.1f} min"
          + (f", {p['cost']:.2f} at {p['price_per_hour']:g}/h" if p["cost"] is not None else "")
          + " (the steps alone: the compile before step 1 comes on top, minutes on trn2; a pilot run measures it, "
          "timing.compile_or_warmup_s)", flush=True)
    return p
