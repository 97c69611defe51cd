"""Stopping a training run without losing it, and resuming only the same run.

Stop signals (SIGTERM: a spot reclaim, `kill`, Kubernetes, SLURM; SIGINT: Ctrl-C; SIGUSR1: SLURM's --signal;
SIGHUP) and `--time_limit` end a run at the next step boundary: every rank finishes the step it is in, the ranks
agree to stop (one all-reduce per step, so a signal that reached one rank stops them all at the same step),
torchtitan saves that step's whole training state in OUT_DIR/checkpoint/step-N (what --checkpoint_every saves),
results.json says `stopped`, and the process exits with EXIT_STOPPED. A second signal ends the run at once; the
previous checkpoint stays usable (a save cut short has no .metadata and is never loaded).

Each run records beside its checkpoints what they were written with (RECORD: script, model and initial weights,
world size, batch split, sequence length, data, dtype, schedule, seed...). A rerun resumes only when it matches,
and only with more --steps than the newest checkpoint; anything else is refused with one line naming each
difference, before anything is built or launched.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import time
from datetime import datetime
from pathlib import Path

from common.errors import UserError, one_line
from common.results import atomic_write_text

EXIT_STOPPED = 75  # sysexits' EX_TEMPFAIL: stopped at a step boundary with a checkpoint; run the same command again
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
SELF_LAUNCHED = "QWEN3_RECIPES_SELF_LAUNCHED"  # set by common.harness.launcher for its workers: where a stop is reported
DEADLINE = "QWEN3_RECIPES_DEADLINE"  # --time_limit as an absolute time, set once by the launcher for every worker
RECORD = "run.json"
TIME_LIMIT = 1000  # the stop flag's value for --time_limit (a signal's is its number)
# Flags a resume may change: they do not change what the next step computes.
MAY_CHANGE = {"preset", "steps", "checkpoint_every", "out_dir", "export", "export_tolerance", "compare_losses",
              "loss_tolerance", "load_check", "time_limit", "stop_margin_s", "nproc_per_node", "nnodes", "node_rank",
              "master_addr", "master_port", "oversubscribe",
              "device", "lnc", "dry_run", "dry_run_ranks", "per_core_gib", "eval_every", "eval_steps", "tensorboard",
              "peak_tflops", "price_per_hour", "assumed_mfu"}


def parse_time_limit(text: str | None, now: float | None = None) -> float | None:
    """--time_limit as an absolute time.time(): minutes from now ("90", "0.5"), or an end time in ISO 8601 with a
    time zone ("2026-12-02T18:00:00+00:00", "...Z"), such as a capacity block's end."""
    if text is None:
        return None
    now = time.time() if now is None else now
    try:
        minutes = float(text)
    except ValueError:
        try:
            end = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise UserError(f"--time_limit {text!r} is neither minutes (90) nor an end time with its time zone "
                            "(2026-12-02T18:00:00Z)") from None
        if end.tzinfo is None:
            raise UserError(f"--time_limit {text!r} has no time zone: add one (Z for UTC, or +HH:MM)")
        if end.timestamp() <= now:
            raise UserError(f"--time_limit {text} has already passed")
        return end.timestamp()
    if not (0 < minutes < 1e7):
        raise UserError(f"--time_limit must be a positive number of minutes, got {text}")
    return now + 60 * minutes


def deadline(time_limit: str | None) -> float | None:
    """The run's end time: the launcher's (every worker the same) or this process's own."""
    if os.environ.get(DEADLINE):
        return float(os.environ[DEADLINE])
    return parse_time_limit(time_limit)


class StopControl:
    """Stop signals and the time limit, decided together at each step boundary (`attach`)."""

    DUPLICATE_S = 1.0  # a launcher forwarding the signal this process already got is the same signal

    def __init__(self, *, end: float | None, margin_s: float, is_main: bool):
        self.end, self.margin_s, self.is_main = end, margin_s, is_main
        self.reason: str | None = None
        self.first_at = 0.0
        self.stopped_at: int | None = None
        self.save_s: list[float] = []
        self.step_s = 0.0

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        name, now = signal.Signals(signum).name, time.monotonic()
        if self.reason is None:
            self.reason, self.first_at = name, now
            if self.is_main:
                os.write(2, f"[stop] {name}: finishing this step, then saving a checkpoint (a second signal ends the "
                            "run at once)\n".encode())
        elif now - self.first_at > self.DUPLICATE_S:
            os.write(2, f"error: {name} again: ended at once; the last complete checkpoint in the out_dir stays "
                        "usable\n".encode())
            os._exit(128 + signum)

    def _wants_stop(self) -> bool:
        if self.reason is not None:
            return True
        if self.end is None:
            return False
        room = max(self.save_s) if self.save_s else self.margin_s
        if time.time() + self.step_s + room >= self.end:  # room for one more step and its save?
            self.reason = "time_limit"
            return True
        return False

    def attach(self, trainer, device, *, export: bool) -> None:
        """Wrap the trainer's checkpoint save, which torchtitan calls after every step: there the ranks agree on a
        stop, and a stop saves this step through torchtitan's own save and ends the loop."""
        import torch
        import torch.distributed as dist

        ckpt, save = trainer.checkpointer, trainer.checkpointer.save
        last = [time.monotonic()]

        def save_or_stop(curr_step: int, last_step: bool = False) -> bool:
            now = time.monotonic()
            self.step_s, last[0] = max(self.step_s, now - last[0]), now
            if last_step:  # the run ends here anyway: its last save is the HF export (none without --export)
                return save(curr_step, last_step=True) if export else False
            wants = self._wants_stop()  # a signal's number, or TIME_LIMIT: the same reason on every rank
            code = 0 if not wants else TIME_LIMIT if self.reason == "time_limit" else signal.Signals[self.reason]
            flag = torch.tensor([float(code)], device=device)
            if dist.is_initialized():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = int(flag.item())
            if not code:
                saved = save(curr_step, last_step=False)
                if saved:
                    self.save_s.append(time.monotonic() - now)
                last[0] = time.monotonic()
                return saved
            self.reason = "time_limit" if code == TIME_LIMIT else signal.Signals(code).name
            interval, ckpt.interval = ckpt.interval, curr_step  # this step is a save step: torchtitan's own save
            try:
                save(curr_step, last_step=False)
            finally:
                ckpt.interval = interval
            self.stopped_at = curr_step
            trainer.should_continue_training = lambda: False
            return True

        ckpt.save = save_or_stop

    def stopped(self, out_dir: Path) -> dict | None:
        if self.stopped_at is None:
            return None
        return {"reason": self.reason, "step": self.stopped_at,
                "checkpoint": str(Path(out_dir) / "checkpoint" / f"step-{self.stopped_at}")}


def resume_line(stopped: dict) -> str:
    return (f"[stopped] {stopped['reason']} after step {stopped['step']}: checkpoint {stopped['checkpoint']}; run the "
            f"same command again to resume from it (exit code {EXIT_STOPPED})")


# ---- the run record --------------------------------------------------------------------------------------------


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


def check_resume(out_dir: Path, record: dict, steps: int) -> int | None:
    """Before anything is built: the step this run resumes from (None: it starts anew), or one UserError naming
    why the checkpoints in OUT_DIR cannot be continued by this command."""
    have = whole_checkpoints(out_dir)
    if not have:
        return None
    folder = Path(out_dir) / "checkpoint"
    try:
        old = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        raise UserError(f"{folder} holds checkpoints without a readable {RECORD} (the record of the run that wrote "
                        "them): they are not loaded; choose another --out_dir, or move that folder away") from None
    way = (f"resume with the checkpoint's settings, start anew with another --out_dir, or continue from its "
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


def exit_if_stopped(results: dict) -> None:
    """A stopped run exits EXIT_STOPPED; a worker of the scripts' own launch leaves a mark in its launcher's folder
    and exits 0, and the launcher (on each node) exits EXIT_STOPPED (torchrun would print a failure report for a
    worker's non-zero exit)."""
    if not results.get("stopped"):
        return
    if os.environ.get(SELF_LAUNCHED):
        atomic_write_text(Path(os.environ[SELF_LAUNCHED]), resume_line(results["stopped"]) + "\n")
        return
    raise SystemExit(EXIT_STOPPED)
