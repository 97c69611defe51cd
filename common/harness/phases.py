"""Where the minutes before step 1 go, on each rank: from the command (the scripts' own launch: when the user's
command started; otherwise this process) to the end of step 1, in named phases, each ending at a mark:

    launch       the scripts' own launch: its checks and torchrun, up to this worker's start (0 otherwise)
    imports      this process's start to the run's first line (Python, torch, the script's modules)
    checks       the out_dir, the inputs, the preflight, the resume record (common/harness/lifecycle.py `check`; a
                 worker of the scripts' own launch takes the record and the host's checks from its launcher)
    plan         rank 0: the dry run's memory plan's child forked (it plans while the run goes on; cached per
                 configuration)
    device       the process group and the device (common/device.py `setup`)
    build        the Trainer.Config, the staged assets, the trainer and its model built
    load         the initial weights or the checkpoint loaded (torchtitan's train(), up to step 1)
    load check   step 1 of a run from HF weights: the built model's logits against transformers' load
    first step   this process's first training step (on an accelerator: its compile)

results.json `time_to_first_step` has them (rank 0's, and each phase's longest over the ranks), and rank 0 prints
them in a `[step 1]` line after the `[pilot]` line (a resumed part: `[first step]`, naming its first step).
"""
from __future__ import annotations

import os
import time

COMMAND_START = "QWEN3_RECIPES_COMMAND_START"  # set by the scripts' own launch for its workers: when it started


def process_start() -> float:
    import psutil

    return psutil.Process().create_time()


class Phases:
    def __init__(self):
        self.started = process_start()
        launched = os.environ.get(COMMAND_START)
        try:
            self.command = min(float(launched), self.started) if launched else self.started
        except ValueError:
            self.command = self.started
        self.marks: list[tuple[str, float]] = [("launch", self.started)]

    def mark(self, name: str) -> None:
        """Phase `name` ends now (once: a phase marked again keeps its first end)."""
        if all(n != name for n, _ in self.marks):
            self.marks.append((name, time.time()))

    def durations(self) -> dict[str, float]:
        out, before = {}, self.command
        for name, at in self.marks:
            out[name] = max(at - before, 0.0)
            before = at
        return out

    def result(self) -> dict:
        """This rank's phases, and each phase's longest over the ranks (one gather; every rank calls it)."""
        import torch.distributed as dist

        mine = self.durations()
        every = [mine]
        if dist.is_initialized():
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        longest = {k: max(d.get(k, 0.0) for d in every) for k in mine}
        return {"phases": mine, "total_s": sum(mine.values()), "longest_over_ranks": longest}


def format_line(r: dict, first_step: int = 1) -> str:
    """The `[step 1]` line; a resumed part's first step (`first_step`, the step after the resumed one) is named."""
    parts = ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items() if v >= 0.05)
    what = ("[step 1] the command to the end of step 1" if first_step == 1 else
            f"[first step] the command to the end of the first step (step {first_step}, after the resume)")
    return f"{what}: {r['total_s']:.1f} s ({parts})"
