"""Stopping a training run without losing it.

Stop signals (SIGTERM: a spot reclaim, `kill`, Kubernetes, SLURM; SIGINT: Ctrl-C; SIGUSR1: SLURM's --signal;
SIGHUP) and `--time_limit` end a run at the next step boundary: every rank finishes the step it is in, the ranks
agree to stop (one all-reduce per step, so a signal that reached one rank stops them all at the same step),
torchtitan saves that step's whole training state in OUT_DIR/checkpoint/step-N (what --checkpoint_every saves),
results.json says `stopped`, and the process exits with EXIT_STOPPED. A held-out evaluation (--eval_every) is a
step boundary too: a stop agreed at a step skips that step's evaluation, and one that comes during an evaluation
ends it at the next batch (the ranks agree at each batch) and saves the step it evaluated. A second signal ends
the run at once; the previous checkpoint stays usable (a save cut short has no .metadata and is never loaded).
The same command resumes it (common/harness/resume.py).

--time_limit foresees what continuing costs: at a step boundary, the evaluation due there (the longest measured),
one more step (the longest measured) and the stop save (the longest measured save, or --stop_margin_s); during an
evaluation, its remaining batches at the pace measured so far, a step and the save.

torchrun kills its workers a while after passing them a signal it got itself (its --shutdown-timeout, 30 s unless
told): the scripts' own launch gives it STOP_GRACE_S; under a torchrun of the user's, `torchrun_grace_s` reads what
it was given and, when it is less, rank 0 says so once where it matters: when the longest step and save measured
outlast it, or with a stop signal that comes before any save was measured (`_say_torchrun_grace`).
"""
from __future__ import annotations

import math
import os
import signal
import time
from datetime import datetime
from pathlib import Path

from common.errors import UserError
from common.results import atomic_write_text

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)  # one tuple for the run and its checks

EXIT_STOPPED = 75  # sysexits' EX_TEMPFAIL: stopped at a step boundary with a checkpoint; run the same command again
SELF_LAUNCHED = "QWEN3_RECIPES_SELF_LAUNCHED"  # set by the launcher for its workers: where a stop is reported
DEADLINE = "QWEN3_RECIPES_DEADLINE"  # --time_limit as an absolute time, set once by the launcher for every worker
TIME_LIMIT = 1000  # the stop flag's value for --time_limit (a signal's is its number)
# How long torchrun waits, after passing on a signal it got itself, before it SIGKILLs the workers: the rest of a
# step and a stop save of a large model (a 64-rank qwen3_4b with its AdamW state writes tens of GB) must fit. A
# second signal still ends the run at once.
STOP_GRACE_S = 1800
TORCHRUN_DEFAULT_GRACE_S = 30  # torch.distributed.run without --shutdown-timeout or TORCH_ELASTIC_SHUTDOWN_TIMEOUT
class StopNow(Exception):
    """Raised on every rank at the same held-out batch when the ranks agreed to stop during an evaluation."""


def parse_time_limit(text: str | None, now: float | None = None) -> float | None:
    """--time_limit as an absolute time.time(): minutes from now ("90", "0.5"), or an end time in ISO 8601 with a
    time zone ("2026-12-02T18:00:00+00:00", "...Z"), such as a capacity block's end. None: no limit; any text,
    the empty one included, must be one of the two."""
    if text is None:
        return None
    now = time.time() if now is None else now
    try:
        minutes = float(text)
    except ValueError:
        try:
            end = datetime.fromisoformat(text.replace("Z", "+00:00")) if text.strip() else None
        except ValueError:
            end = None
        if end is None:
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
    """The run's end time: in a worker of the scripts' own launch, the launcher's (every worker the same);
    anywhere else this process's own --time_limit. A DEADLINE left in the environment of any other process (a
    shell that exported it, a plain torchrun) is not this run's and is ignored."""
    text = os.environ.get(DEADLINE) if os.environ.get(SELF_LAUNCHED) else None
    if not text:
        return parse_time_limit(time_limit)
    try:
        end = float(text)
    except ValueError:
        end = math.nan
    if not (math.isfinite(end) and end > 0):
        raise UserError(f"{DEADLINE}={text!r} from the launcher is not a time in seconds since the epoch: start the "
                        f"run without {DEADLINE} and {SELF_LAUNCHED} in its environment")
    return end


def torchrun_grace_s(parent_cmdline: list[str], env: dict) -> int:
    """The seconds a torchrun (`parent_cmdline`: its argv) waits after passing on a signal before it SIGKILLs its
    workers: its --shutdown-timeout (or --shutdown_timeout, or PET_SHUTDOWN_TIMEOUT as for every torchrun flag),
    else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 (torch 2.14's torch/distributed/run.py and launcher/api.py)."""
    value = None
    for i, arg in enumerate(parent_cmdline):
        name, eq, rest = arg.partition("=")
        if name in ("--shutdown-timeout", "--shutdown_timeout"):
            value = rest if eq else (parent_cmdline[i + 1] if i + 1 < len(parent_cmdline) else None)
        elif not arg.startswith("-") and i > 0 and parent_cmdline[i - 1] not in ("-m", "-c") and arg.endswith(".py"):
            break  # the training script: what follows is its own
    for source in (value, env.get("PET_SHUTDOWN_TIMEOUT"), env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")):
        if source is not None:
            try:
                return int(source)
            except ValueError:
                return TORCHRUN_DEFAULT_GRACE_S  # torchrun itself would not have started
    return TORCHRUN_DEFAULT_GRACE_S


def under_a_users_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and not os.environ.get(SELF_LAUNCHED)


class StopControl:
    """Stop signals and the time limit, decided together at each step's end (`step_ended`) and before each held-out
    batch (`eval_batch`), in the run's GuardedTrainer (common/harness/trainer.py)."""

    DUPLICATE_S = 1.0  # a launcher forwarding the signal this process already got is the same signal

    def __init__(self, *, end: float | None, margin_s: float, is_main: bool, steps: int | None = None):
        self.end, self.margin_s, self.is_main = end, margin_s, is_main
        self.steps = steps  # the run's last step (--steps): after it nothing is left to stop
        self.reason: str | None = None
        self.first_at = 0.0
        self.stopped_at: int | None = None
        self.ended = False  # the last step (--steps) ended in this process
        self.saves: list[dict] = []  # each resumable save of this process: its step, the seconds training waited
        # for it and its whole write (None while an asynchronous one is being written)
        self.steps_s: list[float] = []  # each step of this process (an evaluation's and a save's time not included)
        self.step_s = 0.0  # the longest step measured
        self.eval_s = 0.0  # the longest evaluation measured
        self.batch_s = 0.0  # the pace of the last evaluation: seconds a held-out batch
        self._last = time.monotonic()  # when the last step's work (its save, its evaluation) ended
        self._eval_start = 0.0
        self.torchrun_grace_s: int | None = None  # rank 0 under a torchrun of the user's that gives a stop's save
        # less than STOP_GRACE_S: its grace, said once where it matters (_say_torchrun_grace)
        self._grace_said = False

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        if self.is_main and under_a_users_torchrun():
            try:
                import psutil

                cmdline = psutil.Process(os.getppid()).cmdline()
            except Exception:  # noqa: BLE001  no parent to read: nothing to say
                return
            grace = torchrun_grace_s(cmdline, dict(os.environ))
            self.torchrun_grace_s = grace if grace < STOP_GRACE_S else None

    def _say_torchrun_grace(self, *, signalled: bool = False) -> None:
        """Once, on rank 0 under a torchrun of the user's with a short --shutdown-timeout, and only where it matters
        (not at the start of every run, where a CPU run's tenth of a second save made it a line to ignore): when this
        run's own figures, the longest step and save measured, outlast torchrun's grace, or, before any save was
        measured, when a stop signal comes (its save is then the first)."""
        grace = self.torchrun_grace_s
        if grace is None or self._grace_said:
            return
        need = self.step_s + (max(self.save_s) if self.save_s else 0.0)
        fix = (f"start torchrun with --shutdown-timeout {STOP_GRACE_S} (or TORCH_ELASTIC_SHUTDOWN_TIMEOUT="
               f"{STOP_GRACE_S}), or use the scripts' own launch (--nproc_per_node)")
        if signalled:
            self._grace_said = True
            os.write(2, f"[stop] torchrun kills the workers {grace} s after it passes on a stop signal: a step and save "
                        f"that take longer are lost; to give them time, {fix}\n".encode())
        elif need > grace:
            self._grace_said = True
            print(f"[stop] a stop needs {need:.0f} s here (the longest step {self.step_s:.1f} s, then the save "
                  f"{max(self.save_s, default=0.0):.1f} s) and torchrun kills its workers {grace} s after it passes on "
                  f"a stop signal: such a stop would be lost; {fix}", flush=True)

    def _on_signal(self, signum, _frame) -> None:
        name, now = signal.Signals(signum).name, time.monotonic()
        if self.reason is None:
            self.reason, self.first_at = name, now
            if self.is_main:
                os.write(2, f"[stop] {name}: finishing this step (or held-out batch), then saving a checkpoint (a "
                            "second signal ends the run at once)\n".encode())
                if not self.save_s:  # no save measured yet: the stop's save is the first, of unknown length
                    self._say_torchrun_grace(signalled=True)
        elif now - self.first_at > self.DUPLICATE_S:
            os.write(2, f"error: {name} again: ended at once; the last complete checkpoint in the out_dir stays "
                        "usable\n".encode())
            os._exit(128 + signum)

    def _room_s(self) -> float:
        return max(self.save_s) if self.save_s else self.margin_s

    def _wants_stop(self, ahead_s: float = 0.0) -> bool:
        """A signal came, or the work `ahead_s` (an evaluation) plus one more step and the stop save would not end
        before the time limit."""
        if self.reason is not None:
            return True
        if self.end is None:
            return False
        if time.time() + ahead_s + self.step_s + self._room_s() >= self.end:
            self.reason = "time_limit"
            return True
        return False

    def agree(self, ahead_s: float = 0.0, have: bool = True) -> tuple[int, bool]:
        """Every rank's stop wish and `have` (a held-out batch) in one all-reduce: (the stop code, 0 to go on; whether
        every rank has a batch). The same answer on every rank."""
        from common.device import agree_max

        wants = self._wants_stop(ahead_s)  # a signal's number, or TIME_LIMIT: the same reason on every rank
        code = 0 if not wants else TIME_LIMIT if self.reason == "time_limit" else signal.Signals[self.reason]
        code, lacking = (int(x) for x in agree_max([code, 0.0 if have else 1.0]))
        if code:
            self.reason = "time_limit" if code == TIME_LIMIT else signal.Signals(code).name
        return code, not lacking

    def _last_step(self, step: int) -> bool:
        return self.steps is not None and step >= self.steps

    def step_ended(self, step: int, *, eval_due: bool = False) -> None:
        """At the end of each training step (before torchtitan's save and evaluation): the ranks agree on a stop,
        counting the evaluation due at this step. A stop makes this step the one saved and ends the loop
        (GuardedTrainer); after the last step nothing is left to stop: the run finishes."""
        now = time.monotonic()
        self.steps_s.append(now - self._last)
        self.step_s, self._last = max(self.step_s, now - self._last), now
        self._say_torchrun_grace()
        if self._last_step(step):
            self.ended = True
            return
        code, _ = self.agree(ahead_s=self.eval_s if eval_due else 0.0)
        if code:
            self.stopped_at = step

    def saved(self, step: int, blocking_s: float, written_s: float | None) -> None:
        """A resumable save of `step` held training for `blocking_s` and was written in `written_s`
        (GuardedCheckpointer; None: still being written, `written` later): the room a stop save needs is the whole
        write."""
        self.saves.append({"step": step, "wait_s": blocking_s, "write_s": written_s})
        self._last = time.monotonic()
        self._say_torchrun_grace()

    def written(self, seconds: float) -> None:
        """The last save's whole write, known once it ended (an asynchronous save's)."""
        self.saves[-1]["write_s"] = seconds
        self._say_torchrun_grace()

    @property
    def save_s(self) -> list[float]:
        """Each save's whole write, where known: the room a stop's save (always waited for) needs."""
        return [s["write_s"] for s in self.saves if s["write_s"] is not None]

    @property
    def blocking_s(self) -> list[float]:
        """What training waited for each save (less than the write with --async_checkpoint)."""
        return [s["wait_s"] for s in self.saves]

    def _eval_due(self, step: int) -> bool:
        validator = getattr(self.trainer, "validator", None)
        return bool(self.trainer.config.validator.enable and validator is not None
                    and validator.should_validate(step))

    # ---- the held-out evaluation (common/harness/evaluation.py) ------------------------------------------------

    def eval_started(self) -> None:
        self._eval_start = time.monotonic()

    def eval_batch(self, done: int, planned: int, have: bool) -> bool:
        """Before held-out batch `done` + 1 of `planned`: the ranks agree whether to stop (a signal, or the rest of
        the evaluation at its pace plus a step and the save past the time limit: raises StopNow) and whether every
        rank has this batch (False: the held-out data ended on some rank)."""
        if done:
            self.batch_s = (time.monotonic() - self._eval_start) / done
        code, every = self.agree(ahead_s=max(planned - done, 0) * self.batch_s, have=have)
        if code:
            raise StopNow(self.reason)
        return every

    def eval_ended(self, step: int, *, interrupted: bool, batches: int) -> None:
        """After an evaluation: its time is measured (the next step's is counted from here); one a stop ended saves
        its step and ends the loop (after the last step nothing is left to stop: the run finishes)."""
        now = time.monotonic()
        if batches:
            self.batch_s = (now - self._eval_start) / batches
        if not interrupted:
            self.eval_s = max(self.eval_s, now - self._eval_start)
        if interrupted and not self._last_step(step):  # GuardedTrainer saves it, then ends
            if self.is_main:
                print(f"[stop] {self.reason}: the evaluation of step {step} ended after {batches} held-out "
                      f"batches; saving step {step}", flush=True)
            self.stopped_at = step
        self._last = time.monotonic()

    def stopped(self, out_dir: Path) -> dict | None:
        if self.stopped_at is None:
            return None
        return {"reason": self.reason, "step": self.stopped_at,
                "checkpoint": str(Path(out_dir) / "checkpoint" / f"step-{self.stopped_at}")}


def resume_line(stopped: dict) -> str:
    return (f"[stopped] {stopped['reason']} after step {stopped['step']}: checkpoint {stopped['checkpoint']}; run the "
            f"same command again to resume from it (exit code {EXIT_STOPPED})")


FAILED_MARK = "failed"  # beside the stop mark (SELF_LAUNCHED): a check that failed after training, its one line


def exit_if_failed_after_training(error: UserError, stop: StopControl) -> None:
    """A check that failed once training ended (the export check, --compare_losses: rank 0 raises it after writing
    results.json, the other ranks having ended) in a worker of the scripts' own launch: its `error:` line goes to a
    mark beside the stop mark and the worker exits 0; the launcher prints the line and exits 2 (torchrun would print
    its failure table over a worker's non-zero exit, and exit 1). So does an error every rank raised at one agreed
    point (common.errors.AgreedError: the held-out data has no batch for every rank). Anywhere else, or before the
    last step or a stop ended training (the other ranks may still be in a collective, which torchrun ends when this
    rank fails), it returns and the caller raises the error."""
    from common.errors import AgreedError, one_line

    done = stop.ended or stop.stopped_at is not None or isinstance(error, AgreedError)
    if not os.environ.get(SELF_LAUNCHED) or not done:
        return
    atomic_write_text(Path(os.environ[SELF_LAUNCHED]).with_name(FAILED_MARK), f"error: {one_line(str(error))}\n")
    raise SystemExit(0)


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
