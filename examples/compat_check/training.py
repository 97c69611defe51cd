"""`--task train`: training compatibility, a few steps of examples/train_hf_backend.py per model."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

from common.results import atomic_write_text
from compat_check import processes

TRAIN_SCRIPT = Path(__file__).resolve().parent.parent / "train_hf_backend.py"
# One short document, repeated: every batch holds the same text, so a model that trains correctly
# lowers its loss step after step (on fresh text the batch-to-batch spread of a pretrained model's
# loss, about +-0.3 on SmolLM2, hides a few steps of learning).
TRAIN_TEXT = ("The harbour was quiet in the early morning, and the fishermen mended their nets while "
              "the gulls waited on the old stone wall.")


def train_model(row: dict, folder: Path, out_dir: Path, *, steps: int, lr: float, device: str,
                timeout_s: int) -> dict:
    """A few steps of train_hf_backend.py (torchtitan's Transformers backend) from the checkpoint's own
    weights on TRAIN_TEXT, as a subprocess with the per-model time limit (past it, the subprocess and
    everything it started are killed), then its HF export re-read by transformers.
    PASS: every loss finite, the last below the first, the export check passed."""
    row = dict(row, task="train", runner="train_hf_backend", tp=1)
    run_dir = out_dir / "train_runs" / re.sub(r"[^A-Za-z0-9._-]", "_", row["model_id"])
    data = out_dir / "train_runs" / "fixed_text"
    atomic_write_text(data / "train.jsonl", (json.dumps({"text": TRAIN_TEXT}) + "\n") * 256)
    cmd = [sys.executable, str(TRAIN_SCRIPT), "--hf_checkpoint", str(folder), "--steps", str(steps),
           "--dataset", str(data), "--lr", str(lr), "--warmup_steps", "1", "--seq_len", "64",
           "--local_batch_size", "2", "--device", device, "--out_dir", str(run_dir)]
    start = time.perf_counter()
    try:
        proc = processes.run_limited(cmd, timeout_s)
    except subprocess.TimeoutExpired:
        return dict(row, result="FAIL", error=f"timed out after {timeout_s} s (training and export)")
    row["wall_s"] = time.perf_counter() - start
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        return dict(row, result="FAIL",  # the training script's own line, without its `error: ` (the row says it)
                    error=errors[-1].removeprefix("error:").strip() if errors else proc.stderr[-3000:])
    res = json.loads((run_dir / "results.json").read_text())
    losses, check = res["losses"], res["export_check"] or {}
    finite = all(math.isfinite(x) for x in losses)
    falling = finite and len(losses) > 1 and losses[-1] < losses[0]
    reasons = [text for ok, text in ((finite, "a loss is not finite"), (falling, "loss did not fall"),
                                     (check.get("passed"), "export check failed")) if not ok]
    row.update(train_losses=json.dumps(losses), train_tokens_per_s=res["tokens_per_s"],
               export_max_abs_logit_diff=check.get("max_abs_logit_diff"),
               notes=f"{len(losses)} steps of train_hf_backend.py on one repeated text, loss {losses[0]:.3f} -> "
                     f"{losses[-1]:.3f}; export: missing {check.get('missing_keys')}, unexpected "
                     f"{check.get('unexpected_keys')}" + ("; " + "; ".join(reasons) if reasons else ""))
    return dict(row, result="FAIL" if reasons else "PASS")
