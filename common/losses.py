"""A training run's loss curve and its closing results: the losses torchtitan's MetricsProcessor logs
(`LossRecorder`, never scraped from log lines), loss.png and `finish_run` (results.json, the error line of a
failed check). loss.png also shows results.json's `eval_losses` (the held-out loss of `--eval_every`), dashed.
"""
from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import UserError
from common.results import atomic_path, write_results


def plot_losses(path: str | os.PathLike, losses: list[float], title: str,
                steps: list[int] | None = None, held_out: list[dict] | None = None) -> Path | None:
    """A PNG of loss per step (`steps`: their numbers, default 1..N), written atomically; `held_out`
    ([{"step", "loss"}], common.harness.evaluation.EvalRecorder.rows()) adds the held-out loss as a dashed line.
    Returns None when there is nothing to plot."""
    if not losses:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps or range(1, len(losses) + 1), losses, marker="o", label="training")
    if held_out:
        ax.plot([r["step"] for r in held_out], [r["loss"] for r in held_out], linestyle="--", marker="s",
                label="held-out")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path


def finish_run(results: dict, history: dict, *, out_dir: Path, title: str, is_main: bool) -> Path | None:
    """A training run's last steps on rank 0: loss.png and results.json (atomic); then one UserError naming every
    check that failed (the export's, and a `loss_comparison` the harness added). Returns the results.json path on
    rank 0."""
    if not is_main:
        return None
    plot_losses(Path(out_dir) / "loss.png", history["losses"], title, steps=history["steps"],
                held_out=results.get("eval_losses"))
    path = write_results(out_dir, results)
    failed = []
    if results.get("export_check") and not results["export_check"].get("passed"):
        failed.append(f"export check failed ({_export_failure(results['export_check'])}): hf_export was left as it "
                      f"was, the rejected export is in {Path(out_dir) / 'hf_export.rejected'}")
    comparison = results.get("loss_comparison")
    if comparison and not comparison["passed"]:
        failed.append(f"losses differ from {comparison['reference']} from step {comparison['first_differing_step']} "
                      f"(max abs diff {comparison['max_abs_diff']:.3g}, tolerance {comparison['tolerance']:g})")
    if failed:
        raise UserError("; and ".join(failed) + f" (details in {path})")
    return path


def _export_failure(check: dict) -> str:
    """What failed in an export check, in a few words."""
    if check.get("error"):
        return check["error"]
    parts = [f"{k.replace('_', ' ')} {check[k]}" for k in ("missing_keys", "unexpected_keys", "mismatched_keys")
             if check.get(k)]
    if check.get("tied_lm_head") != check.get("tied_expected"):
        parts.append(f"lm_head tied: {check.get('tied_lm_head')}, expected {check.get('tied_expected')}")
    if not check.get("max_abs_logit_diff", 0.0) <= check.get("tolerance", math.inf):
        parts.append(f"max abs logit diff {check['max_abs_logit_diff']:.3g} > tolerance {check['tolerance']:g}")
    return "; ".join(parts) or "see export_check.json"


NOT_FINITE = re.compile(r"Loss is not finite \(global_avg_loss=([^)]*)\) at step (\d+)")


def not_finite(e: RuntimeError) -> UserError | None:
    """torchtitan checks the loss before it logs ("Loss is not finite (global_avg_loss=nan) at step N", a RuntimeError
    and a traceback on every rank): the one line to raise instead (every rank sees the same loss); None for any other
    error."""
    found = NOT_FINITE.search(str(e))
    if found is None:
        return None
    return UserError(f"the loss at step {found[2]} is {found[1]}: training diverged or its weights or data are "
                     "broken; nothing after this step is trained")


@dataclass
class LossRecorder:
    """What torchtitan's MetricsProcessor logs each step (loss, grad norm, tokens seen, wall time; common/trainer.py's
    RecordingMetrics adds them), so results.json holds numbers, never scraped log lines."""

    steps: list[int] = field(default_factory=list)  # starts after the resumed step when resuming
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens_seen: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def start(self) -> None:
        """Training starts now (`times[0]`)."""
        self.times[:] = [time.perf_counter()]

    def add(self, step: int, loss: float, grad_norm: float, tokens_seen: int) -> None:
        """One logged step: its numbers, and when it ended."""
        self.steps.append(step)
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        self.tokens_seen.append(tokens_seen)
        self.times.append(time.perf_counter())

    def history(self) -> dict:
        """Steps and losses of this process's run (the harness adds the steps before a resume)."""
        return {"steps": list(self.steps), "losses": list(self.losses)}

    def tokens_per_s(self) -> float:
        """Global tokens per second, leaving out step 1 (warm-up, compilation) when there are more."""
        if len(self.losses) >= 2:
            dt = self.times[-1] - self.times[1]
            dn = self.tokens_seen[-1] - self.tokens_seen[0]
        elif self.losses:
            dt, dn = self.times[1] - self.times[0], self.tokens_seen[0]
        else:
            return math.nan
        return dn / dt if dt > 0 else math.nan
