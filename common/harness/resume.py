"""Resuming only the same run.

Each run records beside its checkpoints what they were written with (RECORD: script, model and initial weights,
world size, batch split, sequence length, data, dtype, schedule, seed...). A rerun resumes only when it matches,
and only with more --steps than the newest checkpoint; anything else is refused with one line naming each
difference, before anything is built or launched. Stopping: common/harness/stops.py.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from common.errors import UserError, one_line
from common.harness.reshard import compared
from common.results import atomic_write_text

RECORD = "run.json"
# Flags a resume may change: they do not change what the next step computes.
MAY_CHANGE = {"preset", "steps", "checkpoint_every", "out_dir", "export", "export_tolerance", "compare_losses",
              "loss_tolerance", "load_check", "time_limit", "stop_margin_s", "nproc_per_node", "nnodes", "node_rank",
              "master_addr", "master_port", "oversubscribe", "reshard",
              "device", "lnc", "dry_run", "dry_run_ranks", "per_core_gib", "eval_every", "eval_steps", "tensorboard",
              "peak_tflops", "price_per_hour", "assumed_mfu"}


def _weights_identity(folder: str | None) -> dict | None:
    """An HF folder's identity without reading its weights: config.json's sha256 and each safetensors file's
    name, size and modification time."""
    if not folder:
        return None
    root = Path(folder).resolve()
    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(root.glob("*.safetensors"))}
    config = root / "config.json"
    return {"path": str(root), "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest()
            if config.is_file() else None, "safetensors": files}


def run_record(script: str, cfg, *, world_size: int, dataset: tuple[str, str] | None) -> dict:
    """What this run's checkpoints are written with: every setting except MAY_CHANGE (the model's shape among them:
    its flavor or flags, and --hf_checkpoint's config and files), with paths resolved, the data and the world size."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in MAY_CHANGE}
    for key in ("hf_assets", "dataset_path"):
        if settings.get(key):
            settings[key] = str(Path(settings[key]).resolve())
    settings["hf_checkpoint"] = _weights_identity(cfg.hf_checkpoint)
    return {"script": script, "world_size": world_size, "settings": settings,
            "dataset": list(dataset) if dataset else None}


def _differences(old: dict, new: dict) -> list[str]:
    if old.get("script") != new["script"]:
        return [f"written by {old.get('script')}, this is {new['script']}"]
    out = []
    if old.get("world_size") != new["world_size"]:
        out.append(f"world size {new['world_size']} (checkpoint: {old.get('world_size')}; the data loader and "
                   "optimizer are sharded per rank)")
    for key in sorted(set(old.get("settings", {})) | set(new["settings"])):
        a, b = old.get("settings", {}).get(key), new["settings"].get(key)
        if a == b:
            continue
        if key == "hf_checkpoint" and (a or {}).get("path") == (b or {}).get("path"):
            out.append(f"--hf_checkpoint {b['path']}: its files changed since the checkpoint's run started from them")
        elif key == "hf_checkpoint":
            out.append(f"--hf_checkpoint {(b or {}).get('path')} (checkpoint: {(a or {}).get('path')})")
        else:
            out.append(f"--{key} {json.dumps(b)} (checkpoint: {json.dumps(a)})")
    if old.get("dataset") != new["dataset"]:
        out.append(f"data {new['dataset']} (checkpoint: {old.get('dataset')})")
    return out


def whole_checkpoints(out_dir: Path) -> list[int]:
    """Steps of the whole distributed checkpoints in OUT_DIR/checkpoint (their .metadata is written last)."""
    folder = Path(out_dir) / "checkpoint"
    steps = []
    for step_dir in folder.glob("step-*") if folder.is_dir() else []:
        if step_dir.name[5:].isdigit() and (step_dir / ".metadata").is_file():
            steps.append(int(step_dir.name[5:]))
    return sorted(steps)


def check_resume(out_dir: Path, record: dict, steps: int, reshard: bool = False) -> int | None:
    """Before anything is built: the step this run resumes from (None: it starts anew), or one UserError naming
    why the checkpoints in OUT_DIR cannot be continued by this command. `reshard` (--reshard): another world size
    may continue them, with the same global batch (common/harness/reshard.py)."""
    have = whole_checkpoints(out_dir)
    if not have:
        return None
    folder = Path(out_dir) / "checkpoint"
    try:
        old = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        raise UserError(f"{folder} holds checkpoints without a readable {RECORD} (the record of the run that wrote "
                        "them): they are not loaded; choose another --out_dir, or move that folder away") from None
    old, record, hint = compared(old, record, reshard)  # --reshard: the world size may change (harness/reshard.py)
    way = (f"resume with the checkpoint's settings{hint}, start anew with another --out_dir, or continue from its "
           f"exported weights with --hf_checkpoint {Path(out_dir) / 'hf_export'} in a new --out_dir")
    diffs = _differences(old, record)
    if diffs:
        raise UserError(f"{folder} was written by another run, so this one cannot resume it: "
                        + "; ".join(one_line(d) for d in diffs) + f". To go on: {way}")
    if steps <= have[-1]:
        raise UserError(f"nothing to train: {folder / f'step-{have[-1]}'} is at step {have[-1]} and --steps is "
                        f"{steps}; pass a larger --steps to train on from it (the checkpoint is left as it is)")
    return have[-1]


def write_record(out_dir: Path, record: dict) -> None:
    atomic_write_text(Path(out_dir) / "checkpoint" / RECORD, json.dumps(record, indent=1, sort_keys=True) + "\n")
