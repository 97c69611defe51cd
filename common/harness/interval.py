"""What a run's saves cost in paid minutes: `--checkpoint_every auto`, the interval that loses the least expected
work, and the stop-safety verdict, whether a stop notice covers the stop.

- The interval. A save costs C seconds of training time; an interruption without notice (a host failure, a spot
  reclaim whose notice was missed) loses the work since the last save, half an interval on average. With a mean
  time between interruptions M, Young's first-order optimum (J. W. Young, "A first order approximation to the
  optimum checkpoint interval", CACM 1974) is T = sqrt(2 C M) seconds of training between saves; here in whole
  steps. C is the longest save measured in this run (with --async_checkpoint, the part of it training waits for:
  the copy of the state; the write goes on beside the steps), or before the first one the planned checkpoint's size
  over --storage_gb_per_s (without it, OUT_DIR's write bandwidth measured before step 1: `write_probe`); it is
  derived again after each measured save, and said again only when it moves by more than a fifth.
- M without --mean_hours_between_interruptions: DEFAULT_MTBI_H per host over the hosts (see there).
- The verdict. A stop (common/harness/stops.py) ends at the next step boundary and saves: after a signal it needs
  the rest of the step in progress (at most one step), or, during a held-out evaluation, the rest of one held-out
  batch (a stop agreed at a step skips that step's evaluation), then the save. It fits when that worst case is
  within the notice (EC2 spot's 120 s by default; SLURM's `--signal`: what the user set; a stop save is written
  whole before the run ends, so its time is a whole write, asynchronous periodic saves or not), and when every rank's
  wait in the save's collectives (the slowest shard's write) is within the process groups' timeout
  (--comm_timeout_s, torchtitan's comm.train_timeout_seconds after step 1).
"""
from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path

EC2_SPOT_NOTICE_S = 120.0  # EC2's interruption notice for a Spot Instance
# M per host when --mean_hours_between_interruptions is not given. Meta's Llama 3 report (Dubey et al., "The Llama 3
# Herd of Models", 2024, section 3.3.4) counts 419 unexpected interruptions in a 54-day snapshot of pre-training on
# up to 16,384 GPUs, 8 a host: 2,048 hosts x 1,296 h / 419 = about 6,300 host-hours between failures. Half that, for
# a conservative figure (hosts other than those, and a snapshot of one cluster): 3,000 h a host, over the run's hosts
# (a job is interrupted when any of them fails). Failures only: spot reclaims come far more often (give your own).
DEFAULT_MTBI_H = 3000.0
MAX_EVERY = 10**7  # the largest --checkpoint_every: an interval past it is "never" for any run
MATERIAL = 0.2  # an interval said again only when it moves by more than this share (or one step)
PROBE_BYTES = 32 << 20  # the write probe: enough to pass a page cache's first burst, under a second on a local SSD


def young_interval_steps(save_s: float, step_s: float, mtbi_s: float) -> int:
    """T = sqrt(2 x save x MTBI) seconds of training, in steps of `step_s`: at least 1, at most MAX_EVERY (a save
    planned over absurdly slow storage gives an interval longer than any run, not an overflow)."""
    steps = math.sqrt(2 * save_s) * math.sqrt(mtbi_s) / step_s  # two roots: no product of two huge numbers
    return max(1, min(MAX_EVERY, round(steps))) if math.isfinite(steps) else MAX_EVERY


def default_mtbi_h(hosts: int) -> float:
    """DEFAULT_MTBI_H for a job on `hosts` hosts: any host's failure interrupts it."""
    return DEFAULT_MTBI_H / max(1, hosts)


def write_probe(folder: Path, nbytes: int = PROBE_BYTES) -> float:
    """OUT_DIR's write bandwidth in GB/s, measured: `nbytes` written to a file in `folder`, fsync'd, timed and
    removed. One writer: a checkpoint written by every rank at once may go faster, so the planned save is longer
    than the real one, and the first interval shorter (more saves, not fewer)."""
    path = Path(folder) / f".write-probe-{os.getpid()}"
    block = os.urandom(1 << 20)  # incompressible: a compressing filesystem would flatter zeros
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(max(1, nbytes >> 20)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - t0
    finally:
        path.unlink(missing_ok=True)
    return max(1, nbytes >> 20) * len(block) / max(seconds, 1e-9) / 1e9


def interval_facts(every: int, *, save_s: float, step_s: float, mtbi_s: float, save_source: str,
                   price_per_hour: float | None = None) -> dict:
    """An interval of `every` steps and what it costs: the expected training lost per interruption (half an
    interval), the share of the run's time spent saving, and with a price both in money."""
    work_s = every * step_s
    lost_s, overhead = work_s / 2, save_s / (work_s + save_s)
    return {"every_steps": every, "interval_s": work_s, "save_s": save_s, "save_source": save_source,
            "step_s": step_s, "mean_time_between_interruptions_s": mtbi_s,
            "expected_lost_s_per_interruption": lost_s, "save_overhead": overhead,
            "cost_lost_per_interruption": lost_s / 3600 * price_per_hour if price_per_hour else None,
            "save_cost_per_hour": overhead * price_per_hour if price_per_hour else None}


def _figure(x: float, digits: int = 1) -> str:
    """A duration as the lines print it: fixed digits, or three significant ones past 100000 (a save planned over
    absurdly slow storage is not a number of 300 digits)."""
    return f"{x:.{digits}f}" if abs(x) < 1e5 else f"{x:.3g}"


def format_interval(f: dict, assumed: str = "") -> str:
    """The interval's line; `assumed`: where M comes from when it is not the user's (said with the flag to set it)."""
    cost = (f", {f['cost_lost_per_interruption']:.2f} at the price" if f["cost_lost_per_interruption"] is not None
            else "")
    return (f"[checkpoint] auto: every {f['every_steps']} steps ({_figure(f['interval_s'] / 60)} min of training; "
            f"save {_figure(f['save_s'])} s {f['save_source']}, step {f['step_s']:.2f} s, mean time between "
            f"interruptions {f['mean_time_between_interruptions_s'] / 3600:g} h{assumed}): "
            f"{_figure(f['expected_lost_s_per_interruption'] / 60)} min of training lost per interruption on "
            f"average{cost}, {100 * f['save_overhead']:.1f}% of the time saving")


def stop_verdict(*, step_s: float, batch_s: float, save_s: float, notice_s: float, comm_timeout_s: float,
                 save_source: str, evaluates: bool) -> dict:
    """Whether a stop fits the notice: the longest of a step and a held-out batch, then the save; and whether the
    save's collective wait fits the process groups' timeout. With what would make it fit, where it does not."""
    before_save = max(step_s, batch_s if evaluates else 0.0)
    worst = before_save + save_s
    fits_notice, fits_timeout = worst <= notice_s, save_s < comm_timeout_s
    advice = []
    if not fits_notice:
        advice.append(f"a notice of at least {math.ceil(worst)} s (--stop_notice_s; under SLURM an earlier "
                      "--signal)")
        if evaluates and batch_s > step_s:
            advice.append("shorter held-out batches (--local_batch_size) or fewer (--eval_steps)")
        advice.append("faster storage for OUT_DIR (the save is most of it)" if save_s >= before_save else
                      "shorter steps (a smaller --local_batch_size, more ranks)")
    if not fits_timeout:
        advice.append(f"--comm_timeout_s above the save's {math.ceil(save_s)} s (the slowest shard's write is "
                      "every rank's wait)")
    return {"fits": fits_notice and fits_timeout, "worst_s": worst, "notice_s": notice_s, "step_s": step_s,
            "eval_batch_s": batch_s if evaluates else None, "save_s": save_s, "save_source": save_source,
            "comm_timeout_s": comm_timeout_s, "fits_notice": fits_notice, "fits_comm_timeout": fits_timeout,
            "advice": advice}


def format_verdict(v: dict) -> str:
    parts = f"a step {v['step_s']:.1f} s" + (f" or a held-out batch {v['eval_batch_s']:.1f} s"
                                             if v["eval_batch_s"] is not None else "")
    head = (f"[stop notice] a stop needs {v['worst_s']:.1f} s ({parts}, then the save {v['save_s']:.1f} s "
            f"{v['save_source']}) of the {v['notice_s']:g} s notice")
    if v["fits"]:
        return f"{head}: it fits"
    why = [] if v["fits_notice"] else ["it does not fit"]
    if not v["fits_comm_timeout"]:
        why.append(f"the save outlasts the {v['comm_timeout_s']:g} s collective timeout")
    return f"{head}: WARNING {' and '.join(why)}; to make it fit: " + "; ".join(v["advice"])


class SaveWatch:
    """One run's saves: the auto interval (`due`), re-derived after each measured save, and the stop-safety verdict,
    reported as soon as a save is measured (`saved`). Durations come from the run's StopControl (its steps, held-out
    batches and saves)."""

    def __init__(self, stop, *, every: str, mtbi_h: float | None, planned_save_s: float | None, notice_s: float,
                 comm_timeout_s: float, price_per_hour: float | None, evaluates: bool, is_main: bool,
                 async_saves: bool = False):
        self.auto, self.async_saves = every == "auto", async_saves
        # without --mean_hours_between_interruptions: the published failure rate, over this job's hosts (torchrun's
        # WORLD_SIZE / LOCAL_WORLD_SIZE), said in the interval's line with the flag that sets the user's own
        hosts = int(os.environ.get("WORLD_SIZE", "1")) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        self.assumed = "" if mtbi_h else (f", assumed: {DEFAULT_MTBI_H:g} h a host from Llama 3's failure rate, "
                                          f"over {max(1, hosts)} host{'s' * (hosts > 1)}; "
                                          "--mean_hours_between_interruptions H for your own")
        self.mtbi_s = (mtbi_h or default_mtbi_h(hosts)) * 3600
        self.planned_save_s, self.notice_s, self.comm_timeout_s = planned_save_s, notice_s, comm_timeout_s
        self.price_per_hour, self.evaluates, self.is_main = price_per_hour, evaluates, is_main
        self.interval: dict | None = None
        self.said: int | None = None  # the interval last printed (in steps)
        self.verdict: dict | None = None
        self.stop = stop  # the run's StopControl: its measured steps, held-out batches and saves
        self.started_after = 0  # the step this process resumed from (0: a fresh run)

    def step_s(self) -> float | None:
        """A step's time: the median of the steps after this process's first (its compile), or that one alone."""
        steps = self.stop.steps_s
        if not steps:
            return None
        return statistics.median(steps[1:]) if len(steps) > 1 else steps[0]

    def save(self) -> tuple[float | None, str]:
        """The longest whole write measured (a stop save's), else the planned one."""
        if self.stop.save_s:
            return max(self.stop.save_s), "measured"
        return self.planned_save_s, "planned"

    def save_cost(self) -> tuple[float | None, str]:
        """What a periodic save costs training: the longest wait measured (the whole save unless asynchronous), else
        the planned whole write."""
        if self.stop.blocking_s:
            return max(self.stop.blocking_s), self._measured()
        return self.planned_save_s, "planned"

    def _measured(self) -> str:
        return "measured, the part training waits for" if self.async_saves else "measured"

    def due(self, step: int, last_saved: int | None) -> bool:
        """With --checkpoint_every auto: whether `step` is a save step (`last_saved`: the step of this process's last
        save; None: none yet, counted from the step it started after)."""
        every = self._derive()
        return every is not None and step - (self.started_after if last_saved is None else last_saved) >= every

    def _derive(self) -> int | None:
        step_s, (seconds, source) = self._agreed(self.step_s(), self.save_cost())
        if step_s is None or seconds is None or not self.mtbi_s:
            return None
        every = young_interval_steps(seconds, step_s, self.mtbi_s)
        if self.interval is None or self.interval["every_steps"] != every or self.interval["save_source"] != source:
            self.interval = interval_facts(every, save_s=seconds, step_s=step_s, mtbi_s=self.mtbi_s,
                                           save_source=source, price_per_hour=self.price_per_hour)
            # said when first known and when it moves materially: the median step moves the interval by a step
            # or two nearly every step, which is no news
            if self.said is None or abs(every - self.said) > max(1, MATERIAL * self.said):
                self.said = every
                if self.is_main:
                    print(format_interval(self.interval, self.assumed), flush=True)
        return every

    def _agreed(self, step_s: float | None, save: tuple[float | None, str]) -> tuple:
        """The longest step and save time over the ranks (one all-reduce): every rank derives the same interval,
        so all of them save at the same steps (a save is collective)."""
        from common.device import agree_max

        seconds, source = save
        a, b, measured = agree_max([-1.0 if step_s is None else step_s, -1.0 if seconds is None else seconds,
                                    1.0 if source == "measured" else 0.0])
        return (a if a >= 0 else None), ((b if b >= 0 else None), self._measured() if measured else source)

    def saved(self) -> None:
        """After a measured save: the verdict (said when it is first known and when it changes), and the auto
        interval derived again."""
        if self.auto:
            self._derive()
        self.written()

    def written(self) -> None:
        """After a save's whole write is known (at once for a synchronous save, later for an asynchronous one): the
        verdict, said when it is first known and when it changes. This rank's alone: no collective."""
        verdict = self.judge()
        if verdict is not None and (self.verdict is None or self.verdict["fits"] != verdict["fits"]) and self.is_main:
            print(format_verdict(verdict), flush=True)
        self.verdict = verdict or self.verdict

    def judge(self) -> dict | None:
        steps = self.stop.steps_s
        step_s = max(steps[1:] or steps, default=None)  # the longest step after the first: a stop's worst case
        seconds, source = self.save()
        if step_s is None or seconds is None:
            return None
        return stop_verdict(step_s=step_s, batch_s=self.stop.batch_s, save_s=seconds, notice_s=self.notice_s,
                            comm_timeout_s=self.comm_timeout_s, save_source=source, evaluates=self.evaluates)

    def results(self) -> dict:
        """results.json's `checkpoint_interval` (auto only), `stop_safety` (None: neither a save measured nor one
        planned with --storage_gb_per_s) and `saves` (each resumable save of this process: its step, the seconds
        training waited for it and its whole write)."""
        return {"checkpoint_interval": self.interval if self.auto else None, "stop_safety": self.judge(),
                "saves": {"asynchronous": self.async_saves, "each": self.stop.saves}}
