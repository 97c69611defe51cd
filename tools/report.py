"""Runs side by side: one picture and one table from several training runs' results.json.

    python -m tools.report RUN_DIR [RUN_DIR ...] --out FILE.png [--label NAME ...]

The AWS guide's own experiment, SmolLM2 from its public weights against random initialisation (3 steps each,
about 30 s each on a 2-core CPU), then both in one picture:

    python examples/train_hf_backend.py --preset smollm2 --init pretrained --steps 3 --no-export --out_dir runs/smol_pre
    python examples/train_hf_backend.py --preset smollm2 --init random --steps 3 --no-export --out_dir runs/smol_rand
    python -m tools.report runs/smol_pre runs/smol_rand --out runs/smol_report.png

FILE.png holds four panels, each run in its own colour: (1) training loss per step, the held-out loss
(`eval_losses`) dashed in the same colour; (2) the first step's time against the steady step's; (3) steady
tokens/s and MFU (%); (4) peak memory (the largest rank) against the plan, with their ratio (a --profile run's:
"not comparable"); and below them a row per run (script, preset, device, world size, steps, versions). The same
figures as a table are printed and written beside the picture as FILE.md (both replaced atomically), with a
--profile run's trace files (linked from FILE.md). A figure the results.json does not hold (an
older run, or one on a device that cannot measure it) is shown as "-", never guessed; so is a value of the wrong
type, not finite, or out of its range (an MFU above 1, a step time outside 1e-6 to 1e7 s; the ranges:
docs/pilot-report.md), which is not drawn either and is named in a note below the table and above its panel. Each
run is labelled by its folder name, or by `--label`, given once per RUN_DIR in the same order. What each field
means: docs/pilot-report.md.

The tool never writes over a file it did not write: an existing FILE.png or FILE.md that is not one of its own
reports (one of the inputs, a loss.png) is refused. Bad input (a RUN_DIR without a readable results.json, one
that is not a JSON object, such an --out) is one `error:` line and exit code 2. Set-up tooling: no example
imports it, nothing copies it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import stat
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # `python tools/report.py` as well as `python -m tools.report`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.errors import ArgumentParser, UserError, one_line  # noqa: E402
from common.results import atomic_path, atomic_write_text  # noqa: E402

# What marks a report as this tool's: a tEXt chunk of the PNG and the first line of the .md.
PNG_KEY = "Generator"
PNG_VALUE = "qwen3-trainium-recipes tools.report"
MD_MARKER = "<!-- generator: qwen3-trainium-recipes tools.report (python -m tools.report); replaced on the next run -->"
DPI = 100
MISSING = "-"
LABEL_CHARS = 28  # a run's label in the picture (the table keeps it whole)


# ---------------------------------------------------------------------------------------------------------------
# Reading: every field optional, every value checked for its type and range (an older or foreign results.json
# shows "-").

def _num(x) -> float | None:
    """A JSON number as a float (NaN and infinities too: Fields checks the range), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        return float(x)
    except OverflowError:  # an integer past float's range
        return None


def _text(x) -> str | None:
    """A string (or number) from results.json as one printable line; None when absent or of another type."""
    if isinstance(x, str):
        return one_line(x)
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return one_line(str(x))
    return None


# What a figure may be. A value outside its range is no measurement (a hand-edited or corrupt results.json, an
# overflow in the script that wrote it, a unit slip): it is shown as "-" with a note naming the field and the
# value, never printed as a figure nor drawn. So is a value of the wrong type (text where a number belongs). Each
# bound is far beyond any real run, and keeps the picture's arithmetic finite (an axis's headroom, a log axis's
# decades).

@dataclass(frozen=True)
class Range:
    lo: float
    hi: float
    what: str  # the range in words, for the note
    zero: bool = False  # 0 as well (a count or a counter that can read 0), though below lo
    whole: bool = False  # a whole number (a step, a rank count)

    def why_not(self, v: float) -> str | None:
        """Why `v` is not a value of this range (None: it is)."""
        if not math.isfinite(v):
            return "not finite"
        if not (self.lo <= v <= self.hi or (self.zero and v == 0)):
            return f"outside {self.what}"
        if self.whole and v != int(v):
            return "not a whole number"
        return None

    def holds(self, v: float) -> bool:
        return self.why_not(v) is None


LOSS = Range(-1e6, 1e6, "-1e6 to 1e6")
STEP = Range(0, 1e9, "0 to 1e9", whole=True)
COUNT = Range(0, 1e9, "0 to 1e9", whole=True)
WORLD_SIZE = Range(1, 1e7, "1 to 1e7 ranks", whole=True)
SECONDS = Range(1e-6, 1e7, "1e-6 to 1e7 s (about 116 days)")
# a phase of the time to step 1 the run did not go through is 0 (a one-process run's `launch`: common/harness/phases.py)
PHASE_SECONDS = Range(1e-6, 1e7, "0, or 1e-6 to 1e7 s (about 116 days)", zero=True)
SIGNED_SECONDS = Range(-1e7, 1e7, "-1e7 to 1e7 s")  # first step minus steady: below 0 when step 1 was the faster
TOKENS_PER_S = Range(1e-6, 1e12, "0, or 1e-6 to 1e12 tokens/s", zero=True)
MFU = Range(1e-9, 1.0, "1e-9 to 1 (a fraction of the peak)")  # 1e-9: an axis in % spans 11 decades at most
FLOPS_PER_TOKEN = Range(1.0, 1e18, "1 to 1e18 FLOPs")
PEAK_FLOPS = Range(1e6, 1e19, "1e6 to 1e19 FLOP/s")
GIB = Range(1e-6, 1e6, "0, or 1e-6 to 1e6 GiB (1 KiB to 1 PiB)", zero=True)
RATIO = Range(0.0, 1e6, "0 to 1e6")
BYTES = Range(0, 1e15, "0 to 1e15 bytes", whole=True)

# Which panel of the picture shows a note on a field (a list's items like the list); other fields: the tables only.
PANEL_OF = {"history": 1, "history.losses": 1, "losses": 1, "eval_losses": 1, "timing": 2, "timing.first_step_s": 2,
            "timing.steady_step_s": 2, "timing.steady_tokens_per_s": 3, "tokens_per_s": 3, "mfu": 3, "memory": 4,
            "memory.peak_gib": 4, "memory.planned_gib": 4, "memory.ratio": 4}


def _panel(note: str) -> int | None:
    """The panel of a note (`field = value: why`, `field: ...`)."""
    return PANEL_OF.get(note.split(" ", 1)[0].rstrip(":").split("[", 1)[0])


def _shown(x) -> str:
    """A results.json value in a note: a number as the table writes it, anything else by its type or as short text."""
    if isinstance(x, bool) or x is None:
        return json.dumps(x)
    if isinstance(x, int) and _num(x) is None:
        return f"an integer of {len(str(abs(x)))} digits" if abs(x) > 10 ** 30 else str(x)
    if isinstance(x, (int, float)):
        return _fmt(float(x))
    if isinstance(x, str):
        text = one_line(x)
        return json.dumps(text[:30] + ("\N{HORIZONTAL ELLIPSIS}" if len(text) > 30 else ""), ensure_ascii=False)
    return {"dict": "an object", "list": "a list"}.get(type(x).__name__, type(x).__name__)


class Fields:
    """Reads results.json's fields, each checked for its type and its range; what does not pass is None, and a note
    says which field held what."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, name: str, value, why: str) -> None:
        self.notes.append(f"{name} = {_shown(value)}: {why}")

    def obj(self, d: dict, key: str) -> dict:
        x = d.get(key)
        if x is None or isinstance(x, dict):
            return x or {}
        self.note(key, x, "not an object")
        return {}

    def number(self, x, name: str, rng: Range) -> float | None:
        if x is None:  # absent, or JSON null: the script had no figure
            return None
        v = _num(x)
        if v is None:
            self.note(name, x, f"outside {rng.what}" if isinstance(x, int) and not isinstance(x, bool)
                      else "not a number")
            return None
        why = rng.why_not(v)
        if why:
            self.note(name, x, why)
            return None
        return v

    def text(self, x, name: str) -> str | None:
        if x is None:
            return None
        t = _text(x)
        if t is None:
            self.note(name, x, "not text")
        return t


@dataclass
class Run:
    label: str
    path: Path
    script: str | None = None
    preset: str | None = None
    device: str | None = None
    world_size: int | None = None
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    first_step_s: float | None = None
    steady_step_s: float | None = None
    warmup_steps_excluded: int | None = None
    compile_or_warmup_s: float | None = None
    to_first_step_s: float | None = None  # the command to the end of step 1 (time_to_first_step)
    first_step_phases: dict = field(default_factory=dict)
    steady_tokens_per_s: float | None = None
    steady_tokens_per_s_per_rank: float | None = None
    run_tokens_per_s: float | None = None  # the whole run's figure (first step included), from older scripts too
    flops_per_token: float | None = None
    mfu: float | None = None
    peak_flops: float | None = None
    peak_flops_source: str | None = None
    peak_gib: float | None = None  # the largest rank's
    planned_gib: float | None = None
    memory_ratio: float | None = None
    memory_comparable: bool = True  # false: a profiled run (the profiler's buffers) or a CPU run (the whole process)
    memory_unlike: str = "profiled"  # what made it not comparable: "profiled" or "CPU"
    measured_by: str | None = None
    mfu_note: str | None = None  # why the run wrote no MFU (an impossible one: above 1, or no positive peak)
    mfu_indicative: bool = False  # a CPU run's: its steps' wall time moves with the machine's load
    traces: list[tuple[str, float | None]] = field(default_factory=list)  # (path, bytes) of --profile's traces
    stopped: str | None = None
    size_changes: list[tuple[int, int, int]] = field(default_factory=list)  # (first step, ranks before, after)
    cost: str | None = None
    versions: dict[str, str | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # values left out: `field = value: why`

    @property
    def tokens_per_s(self) -> tuple[float | None, bool]:
        """(tokens/s, steady): the steady figure when the run measured one, else the whole run's."""
        if self.steady_tokens_per_s is not None:
            return self.steady_tokens_per_s, True
        return self.run_tokens_per_s, False


def _is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def results_path(run_dir: str) -> Path:
    """The results.json of a RUN_DIR (a run's folder, or the results.json itself)."""
    p = Path(run_dir)
    return p if p.name == "results.json" and not p.is_dir() else p / "results.json"


def read_results(run_dir: str) -> dict:
    path = results_path(run_dir)
    shown = one_line(str(path))
    if not os.path.lexists(path):
        raise UserError(f"{one_line(run_dir)}: no results.json there (a training run writes it when it ends; "
                        "name the run's --out_dir)")
    if not _is_regular_file(path):  # a folder, a FIFO (which would block), a dangling link
        raise UserError(f"{shown} is not a regular file: name a run's --out_dir")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UserError(f"{shown} is not a readable JSON results file ({one_line(type(e).__name__)}: "
                        f"{one_line(str(e))[:200]})") from None
    if not isinstance(data, dict):
        kind = ("null" if data is None else "true or false" if isinstance(data, bool)
                else {"int": "a number", "float": "a number", "str": "a string", "list": "a list"}[type(data).__name__])
        raise UserError(f"{shown} holds JSON {kind}, not a results object: name a training run's --out_dir")
    return data


def _listed(f: Fields, name: str, points: list[tuple[object, object]], what: str) -> tuple[list[int], list]:
    """(steps, losses) of (step, loss) pairs: a pair whose step is not a step is left out, a loss that is not a
    loss is None (a gap in the curve, "-" in the table); one note for each kind, with the first few values."""
    steps, losses, bad_steps, bad_losses = [], [], [], []
    for s, v in points:
        step = _num(s)
        if step is None or not STEP.holds(step):
            bad_steps.append(s)
            continue
        loss = _num(v)
        if loss is None or not LOSS.holds(loss):
            bad_losses.append((int(step), v))
            loss = None
        steps.append(int(step))
        losses.append(loss)
    if bad_steps:
        shown = ", ".join(_shown(x) for x in bad_steps[:3]) + (", ..." if len(bad_steps) > 3 else "")
        f.notes.append(f"{name}: {len(bad_steps)} step{'s' * (len(bad_steps) != 1)} not a whole number from "
                       f"{STEP.what}, {what} left out ({shown})")
    if bad_losses:
        shown = ", ".join(f"step {s}: {_shown(x)}" for s, x in bad_losses[:3]) + (", ..." if len(bad_losses) > 3
                                                                                  else "")
        f.notes.append(f"{name}: {len(bad_losses)} value{'s' * (len(bad_losses) != 1)} not a finite number from "
                       f"{LOSS.what}, not drawn ({shown})")
    return steps, losses


def _steps_and_losses(f: Fields, d: dict) -> tuple[list[int], list[float | None]]:
    """The whole loss curve: history {steps, losses} (every step, across resumes), else steps/losses."""
    for src, prefix in ((f.obj(d, "history"), "history."), (d, "")):
        losses, steps = src.get("losses"), src.get("steps")
        if losses is not None and not isinstance(losses, list):
            f.note(prefix + "losses", losses, "not a list")
        if isinstance(losses, list) and losses:
            if not (isinstance(steps, list) and len(steps) == len(losses)):
                steps = list(range(1, len(losses) + 1))
            return _listed(f, prefix + "losses", list(zip(steps, losses)), "its loss")
    return [], []


def _eval_losses(f: Fields, d: dict) -> tuple[list[int], list[float | None]]:
    items = d.get("eval_losses")
    if items is not None and not isinstance(items, list):
        f.note("eval_losses", items, "not a list of {step, loss}")
    points = []
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if isinstance(item, dict):
            points.append((item.get("step"), item.get("loss")))
        else:
            f.note(f"eval_losses[{i}]", item, "not a {step, loss} object")
    steps, losses = _listed(f, "eval_losses", points, "that held-out loss")
    pairs = sorted(zip(steps, losses), key=lambda p: p[0])
    return [s for s, _ in pairs], [v for _, v in pairs]


def _cost(f: Fields, x) -> str | None:
    """`cost` as `key value` pairs of its scalar fields (its schema is the writing script's)."""
    if isinstance(x, dict):
        parts = [f"{one_line(str(k))} {_fmt_any(v)}" for k, v in x.items()
                 if isinstance(v, (str, int, float)) and not isinstance(v, bool)]
        return ", ".join(parts) or None
    return f.text(x, "cost")


def _stopped(f: Fields, x) -> str | None:
    """`stopped` ({reason, step, checkpoint} when a signal or --time_limit stopped the run) in a few words."""
    if isinstance(x, dict):
        reason, step = f.text(x.get("reason"), "stopped.reason"), f.number(x.get("step"), "stopped.step", COUNT)
        return (reason or "stopped") + (f" after step {int(step)}" if step is not None else "")
    return f.text(x, "stopped") if x else None


def _traces(f: Fields, profile: dict, run_dir: Path) -> list[tuple[str, float | None]]:
    """--profile's trace files (`profile.traces`: [{path, bytes}], paths relative to the run's folder) as
    (path from the run's folder as this tool was given it, size)."""
    items = profile.get("traces")
    if items is None:
        return []
    if not isinstance(items, list):
        f.note("profile.traces", items, "not a list of {path, bytes}")
        return []
    out = []
    for i, item in enumerate(items):
        path = f.text(item.get("path"), f"profile.traces[{i}].path") if isinstance(item, dict) else None
        if path is None:
            if not isinstance(item, dict):
                f.note(f"profile.traces[{i}]", item, "not a {path, bytes} object")
            continue
        rel = Path(path)
        if rel.is_absolute() or ".." in rel.parts:  # a results.json is untrusted: link only inside its run
            f.note(f"profile.traces[{i}].path", path, "not a path inside the run's folder: not linked")
            continue
        if not (run_dir / rel).is_file():
            f.note(f"profile.traces[{i}].path", path, "no such file in the run's folder (moved or deleted)")
            continue
        size = f.number(item.get("bytes"), f"profile.traces[{i}].bytes", BYTES)
        out.append((str(run_dir / path), size))
    return out


def _size_changes(f: Fields, x) -> list[tuple[int, int, int]]:
    """Where the world size changed between the parts of a run resumed with --reshard (`segments`: [{steps: [first,
    last], world_size}, ...]): (the first step on the new size, the size before, the size after)."""
    if x is None:
        return []
    if not isinstance(x, list):
        f.note("segments", x, "not a list")
        return []
    sizes, last_step = [], None
    for i, seg in enumerate(x):
        steps = seg.get("steps") if isinstance(seg, dict) else None
        if not (isinstance(steps, list) and steps and seg.get("world_size") is not None):
            f.note(f"segments[{i}]", seg, "not a {steps: [first, last], world_size} object")
            continue
        first = f.number(steps[0], f"segments[{i}].steps[0]", STEP)
        ws = f.number(seg.get("world_size"), f"segments[{i}].world_size", WORLD_SIZE)
        if first is not None and last_step is not None and first != last_step + 1:
            f.note(f"segments[{i}].steps", steps, f"starts at step {int(first)} after a part that ended at step "
                   f"{int(last_step)}: the record of the steps between is missing")
        end = f.number(steps[-1], f"segments[{i}].steps[-1]", STEP) if len(steps) == 2 and steps[-1] is not None \
            else None
        last_step = end
        if first is not None and ws is not None:
            sizes.append((int(first), int(ws)))
    return [(first, before, ws) for (_, before), (first, ws) in zip(sizes, sizes[1:]) if ws != before]


def _fmt_any(v) -> str:
    n = _num(v)
    return _fmt(n, 4) if n is not None else one_line(str(v))


def load_run(run_dir: str, label: str) -> Run:
    d = read_results(run_dir)
    f = Fields()
    config, timing, memory = f.obj(d, "config"), f.obj(d, "timing"), f.obj(d, "memory")
    run = Run(label=label, path=results_path(run_dir))
    run.script = f.text(d.get("script"), "script")
    run.preset = f.text(config.get("preset"), "config.preset")
    run.device = f.text(d.get("device"), "device") or f.text(config.get("device"), "config.device")
    ws = f.number(d.get("world_size"), "world_size", WORLD_SIZE)
    run.world_size = int(ws) if ws is not None else None
    run.steps, run.losses = _steps_and_losses(f, d)
    run.eval_steps, run.eval_losses = _eval_losses(f, d)
    run.first_step_s = f.number(timing.get("first_step_s"), "timing.first_step_s", SECONDS)
    run.steady_step_s = f.number(timing.get("steady_step_s"), "timing.steady_step_s", SECONDS)
    w = f.number(timing.get("warmup_steps_excluded"), "timing.warmup_steps_excluded", COUNT)
    run.warmup_steps_excluded = int(w) if w is not None else None
    first = d.get("time_to_first_step") if isinstance(d.get("time_to_first_step"), dict) else {}
    run.to_first_step_s = f.number(first.get("total_s"), "time_to_first_step.total_s", SECONDS)
    phases = first.get("phases") if isinstance(first.get("phases"), dict) else {}
    run.first_step_phases = {str(k)[:40]: n for k, v in phases.items()  # a phase that did not happen is not listed
                             if (n := f.number(v, f"time_to_first_step.phases.{str(k)[:40]}", PHASE_SECONDS))}
    warm_up = f.number(timing.get("compile_or_warmup_s"), "timing.compile_or_warmup_s", SIGNED_SECONDS)
    run.compile_or_warmup_s = None if warm_up is None else max(warm_up, 0.0)  # an older file's step 1 that was faster
    run.steady_tokens_per_s = f.number(timing.get("steady_tokens_per_s"), "timing.steady_tokens_per_s",
                                       TOKENS_PER_S)
    run.steady_tokens_per_s_per_rank = f.number(timing.get("steady_tokens_per_s_per_rank"),
                                                "timing.steady_tokens_per_s_per_rank", TOKENS_PER_S)
    run.run_tokens_per_s = f.number(d.get("tokens_per_s"), "tokens_per_s", TOKENS_PER_S)
    run.flops_per_token = f.number(d.get("flops_per_token"), "flops_per_token", FLOPS_PER_TOKEN)
    run.mfu = f.number(d.get("mfu"), "mfu", MFU)
    pf = d.get("peak_flops_per_device")
    if isinstance(pf, dict):
        run.peak_flops = f.number(pf.get("value"), "peak_flops_per_device.value", PEAK_FLOPS)
        run.peak_flops_source = f.text(pf.get("source"), "peak_flops_per_device.source")
        run.mfu_indicative = pf.get("indicative") is True
    else:
        run.peak_flops = f.number(pf, "peak_flops_per_device", PEAK_FLOPS)
    peak = memory.get("peak_gib")
    if isinstance(peak, list):
        peaks = [f.number(v, f"memory.peak_gib[{i}]", GIB) for i, v in enumerate(peak)]
        kept = sum(v is not None for v in peaks)
        if 0 < kept < len(peaks):
            f.notes.append(f"memory.peak_gib: {len(peaks) - kept} of {len(peaks)} ranks left out, the largest of the "
                           f"other {kept} shown")
        peaks = [v for v in peaks if v is not None]
    else:
        peaks = [v for v in [f.number(peak, "memory.peak_gib", GIB)] if v is not None]
    run.peak_gib = max(peaks) if peaks else None
    run.planned_gib = f.number(memory.get("planned_gib"), "memory.planned_gib", GIB)
    run.memory_comparable = memory.get("comparable") is not False
    if not run.memory_comparable and str(memory.get("not_comparable", "")).startswith("CPU"):
        run.memory_unlike = "CPU"
    if run.memory_comparable:
        run.memory_ratio = f.number(memory.get("ratio"), "memory.ratio", RATIO)
        if memory.get("ratio") is None and run.peak_gib is not None and run.planned_gib:
            run.memory_ratio = f.number(run.peak_gib / run.planned_gib, "memory.peak_gib / memory.planned_gib",
                                        RATIO)
    if run.mfu is None:
        run.mfu_note = f.text(d.get("mfu_note"), "mfu_note")
    run.traces = _traces(f, f.obj(d, "profile"), run.path.parent)
    run.measured_by = f.text(memory.get("measured_by"), "memory.measured_by")
    run.stopped = _stopped(f, d.get("stopped"))
    run.size_changes = _size_changes(f, d.get("segments"))
    run.cost = _cost(f, d.get("cost"))
    versions = f.obj(d, "versions")
    run.versions = {k: f.text(versions.get(k), f"versions.{k}")
                    for k in ("torch", "torchtitan", "transformers", "torch_neuronx")}
    run.notes = f.notes
    return run


def default_labels(run_dirs: list[str]) -> list[str]:
    """Each run's folder name; the paths as given where two names are the same, and a number where still equal."""
    names = []
    for r in run_dirs:
        p = results_path(r).parent
        names.append(p.name or p.resolve().name or str(p))
    labels = [n if names.count(n) == 1 else str(Path(r)) for n, r in zip(names, run_dirs)]
    seen: dict[str, int] = {}
    out = []
    for lab in labels:
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if labels.count(lab) == 1 else f"{lab} #{seen[lab]}")
    return [one_line(x) for x in out]


# ---------------------------------------------------------------------------------------------------------------
# The table: the same rows printed (plain text) and written as FILE.md (Markdown).

def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return MISSING
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if x != 0 and (abs(x) >= 1e6 or abs(x) < 1e-3):
        return f"{x:.{digits - 1}e}"
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def _fmt_loss(x: float | None) -> str:
    if x is None:
        return MISSING
    return f"{x:.3f}" if math.isfinite(x) else _fmt(x)


def _fmt_mfu(x: float | None) -> str:
    if x is None:
        return MISSING
    pct = 100 * x
    return f"{pct:.1f}%" if abs(pct) >= 0.1 or pct == 0 else f"{pct:.2g}%"


def _fmt_memory(r: Run) -> str:
    if r.peak_gib is None and r.planned_gib is None:
        return MISSING
    text = f"{_fmt(r.peak_gib)} / {_fmt(r.planned_gib)}"
    if not r.memory_comparable:
        return text + f" (not comparable: {r.memory_unlike})"
    return text + (f" ({r.memory_ratio:.2f}x)" if r.memory_ratio is not None else "")


TRACES_SHOWN = 2  # a run's trace files named in its cell; the rest counted


def _fmt_size(n: float | None) -> str:
    return "" if n is None else f" ({n / 1e6:.2f} MB)" if n >= 1e5 else f" ({n / 1e3:.1f} kB)"


def _fmt_traces(r: Run) -> str:
    if not r.traces:
        return MISSING
    shown = [path + _fmt_size(size) for path, size in r.traces[:TRACES_SHOWN]]
    more = len(r.traces) - TRACES_SHOWN
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _fmt_tokens(r: Run) -> str:
    value, steady = r.tokens_per_s
    return _fmt(value) + ("" if steady or value is None else "*")


COLUMNS = ("run", "script", "preset", "device", "world size", "steps", "first loss", "last loss", "first step s",
           "steady step s", "tokens/s", "MFU", "peak / planned GiB", "torch", "torchtitan", "transformers")
DETAIL_COLUMNS = ("run", "last held-out loss", "command to step 1 s", "warm-up steps excluded", "compile/warm-up s",
                  "tokens/s per rank",
                  "FLOPs/token", "peak FLOP/s per device (source)", "memory measured by", "stopped", "cost",
                  "profile trace")


def _fmt_world_size(r: Run) -> str:
    """The world size; of a run resumed on other numbers of ranks, each in turn (2->1->2)."""
    if r.size_changes:
        return "->".join(str(n) for n in [r.size_changes[0][1], *(after for _, _, after in r.size_changes)])
    return str(r.world_size) if r.world_size is not None else MISSING


def table_rows(runs: list[Run]) -> list[list[str]]:
    rows = []
    for r in runs:
        rows.append([r.label, r.script or MISSING, r.preset or MISSING, r.device or MISSING, _fmt_world_size(r),
                     str(r.steps[-1]) if r.steps else MISSING,
                     _fmt_loss(r.losses[0] if r.losses else None), _fmt_loss(r.losses[-1] if r.losses else None),
                     _fmt(r.first_step_s), _fmt(r.steady_step_s), _fmt_tokens(r), _fmt_mfu(r.mfu), _fmt_memory(r),
                     *(r.versions.get(k) or MISSING for k in ("torch", "torchtitan", "transformers"))])
    return rows


def detail_rows(runs: list[Run]) -> list[list[str]]:
    rows = []
    for r in runs:
        peak = MISSING if r.peak_flops is None else _fmt(r.peak_flops) + (
            f" ({r.peak_flops_source})" if r.peak_flops_source else "")
        rows.append([r.label, _fmt_loss(r.eval_losses[-1] if r.eval_losses else None), _fmt(r.to_first_step_s),
                     str(r.warmup_steps_excluded) if r.warmup_steps_excluded is not None else MISSING,
                     _fmt(r.compile_or_warmup_s), _fmt(r.steady_tokens_per_s_per_rank), _fmt(r.flops_per_token),
                     peak, r.measured_by or MISSING, r.stopped or MISSING, r.cost or MISSING, _fmt_traces(r)])
    return rows


def _footnotes(runs: list[Run]) -> list[str]:
    notes = []
    if any(r.tokens_per_s[0] is not None and not r.tokens_per_s[1] for r in runs):
        notes.append("* tokens/s over the whole run, first step included: that results.json has no steady figure "
                     "(`timing`)")
    notes += [f"{r.label}: MFU left out by the run: {r.mfu_note}" for r in runs if r.mfu_note]
    notes += [f"{r.label}: MFU indicative: a CPU run, whose steps' wall time moves with whatever else the machine runs"
              for r in runs if r.mfu_indicative and r.mfu is not None]
    if any(not r.memory_comparable and r.memory_unlike == "profiled" for r in runs):
        notes.append("not comparable: a profiled run (--profile), whose peak memory holds the profiler's buffers")
    if any(not r.memory_comparable and r.memory_unlike == "CPU" for r in runs):
        notes.append("not comparable: a CPU run, whose peak is the process's resident set (Python, libraries, freed "
                     "memory glibc keeps) where the plan counts tensors")
    notes += [f"{r.label}: command to step 1: " + ", ".join(f"{k} {v:.1f} s" for k, v in r.first_step_phases.items())
              for r in runs if r.first_step_phases]
    for r in runs:
        if r.size_changes:
            notes.append(f"{r.label}: resumed on another world size (--reshard): " + ", ".join(
                f"{before} -> {after} ranks from step {first}" for first, before, after in r.size_changes)
                + " (dotted lines on the loss panel)")
    if any(r.notes for r in runs):
        notes.append('"-" = not in that run\'s results.json, or a value there left out (below)')
        notes.append("Left out: a value of the wrong type, or out of its range, is shown as \"-\" and not drawn:")
        notes += [f"{r.label}: {n}" for r in runs for n in r.notes]
    else:
        notes.append('"-" = not in that run\'s results.json')
    return notes


def render_text(runs: list[Run]) -> str:
    """Plain columns for the terminal."""
    blocks = []
    for cols, rows in ((COLUMNS, table_rows(runs)), (DETAIL_COLUMNS, detail_rows(runs))):
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n\n" + "\n".join(_footnotes(runs)) + "\n"


_MD_SPECIAL = set("\\`*_[]<>|~&$")  # `$`: GitHub reads $...$ as math


def md_cell(text: str) -> str:
    """A value as literal Markdown text: every character Markdown or HTML could read escaped."""
    return "".join("\\" + ch if ch in _MD_SPECIAL else ch for ch in one_line(text))


def md_link(text: str, target: Path, md_dir: Path | None) -> str:
    """A Markdown link to a file, its target relative to the .md's folder (absolute without one), every character
    of it percent-encoded but the path's separators."""
    from urllib.parse import quote

    where = os.path.relpath(target, md_dir) if md_dir is not None else os.path.abspath(target)
    return f"[{md_cell(text)}](<{quote(where.replace(os.sep, '/'), safe='/')}>)"


def _md_traces(r: Run, md_dir: Path | None) -> str:
    if not r.traces:
        return md_cell(MISSING)
    shown = [md_link(path, Path(path), md_dir) + md_cell(_fmt_size(size)) for path, size in r.traces[:TRACES_SHOWN]]
    more = len(r.traces) - TRACES_SHOWN
    return ", ".join(shown) + (md_cell(f" and {more} more") if more > 0 else "")


def render_markdown(runs: list[Run], sources: list[Path], md_dir: Path | None = None) -> str:
    """The tables as Markdown; a run's profile traces as links, relative to `md_dir` (the .md's folder)."""
    out = [MD_MARKER, "", f"# {len(runs)} run{'s' * (len(runs) != 1)} side by side", ""]
    trace_col = DETAIL_COLUMNS.index("profile trace")
    for cols, rows in ((COLUMNS, table_rows(runs)), (DETAIL_COLUMNS, detail_rows(runs))):
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "---|" * len(cols))
        for r, row in zip(runs, rows):
            cells = [md_cell(v) for v in row]
            if cols is DETAIL_COLUMNS:
                cells[trace_col] = _md_traces(r, md_dir)
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out += [md_cell(n) + "  " for n in _footnotes(runs)]
    out += ["", "Read from: " + ", ".join(md_cell(str(p)) for p in sources), ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------------
# The picture.

def figure_size(n_runs: int) -> tuple[float, float]:
    """Inches (width, height) of the picture for `n_runs` runs; at DPI pixels per inch."""
    return 16.0, 10.0 + 0.5 + 0.3 * (n_runs + 1)


def pixel_size(n_runs: int) -> tuple[int, int]:
    w, h = figure_size(n_runs)
    return round(w * DPI), round(h * DPI)


def _plot_text(text: str, limit: int | None = LABEL_CHARS) -> str:
    """Text for matplotlib shown as it is: never mathtext (`$` escaped), never hidden from a legend (a leading `_`)."""
    text = one_line(text)
    if limit and len(text) > limit:
        text = text[:limit - 1] + "\N{HORIZONTAL ELLIPSIS}"
    text = text.replace("$", r"\$")  # outside mathtext a backslash is literal, and `\$` shows as `$`
    return " " + text if text.startswith("_") else text


def _grouped(ax, runs: list[Run], colors, groups: list[tuple[list[float | None], list[str], dict]],
             axes=None) -> None:
    """Two bars per run, side by side (each group: values, their texts, bar style; `axes`: the axes of each
    group), a grey '-' on the baseline where a run has no value."""
    axes = axes or [ax] * len(groups)
    width = 0.38
    for k, ((values, texts, style), a) in enumerate(zip(groups, axes)):
        for i, (v, text) in enumerate(zip(values, texts)):
            x = i + (k - 0.5) * width
            if v is None:
                a.annotate(MISSING, (x, 0), xycoords=("data", "axes fraction"), ha="center", va="bottom",
                           fontsize=11, color="0.4", xytext=(0, 3), textcoords="offset points")
                continue
            a.bar([x], [v], width, color=colors[i], edgecolor=colors[i], **style)
            a.annotate(text, (x, v), ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xlim(-0.6, len(runs) - 0.4)
    ax.set_xticks(range(len(runs)), [_plot_text(r.label, 18) for r in runs], rotation=20 if len(runs) > 3 else 0,
                  ha="right" if len(runs) > 3 else "center", fontsize=8)


def _empty(ax, text: str) -> None:
    """A panel with nothing to draw: its axis hidden, one line saying why."""
    ax.set_yticks([])
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=10, color="0.4")


def _scale(ax, values: list[float | None], headroom: float = 1.18) -> None:
    """A log axis when the bars span more than 30x (a compile step beside a steady one, a trn2 run beside a CPU
    one), so the small ones stay visible; room above the tallest bar for its figure."""
    present = [v for v in values if v is not None and v > 0]
    if not present:
        return
    if max(present) / min(present) > 30:
        ax.set_yscale("log")
        ax.set_ylim(min(present) / 2, max(present) * 4 * headroom)
    else:
        ax.set_ylim(0, max(present) * headroom)


NOTE_LINE_PT = 10  # a line of a panel's notes (7 pt text)


def _note_lines(runs: list[Run], panel: int, path: Path, most: int = 2) -> list[str]:
    """The notes on the values a panel leaves out, as its lines: the first few, then how many more FILE.md has."""
    lines = [f"{r.label}: {n}" for r in runs for n in r.notes if _panel(n) == panel]
    shown = [_plot_text("left out, " + line, 120) for line in lines[:most]]
    if len(lines) > most:
        shown.append(_plot_text(f"and {len(lines) - most} more: {path.with_suffix('.md').name}", 120))
    return shown


def _notes(ax, runs: list[Run], panel: int, path: Path) -> None:
    """A panel's notes in dark red between its title and its axes."""
    lines = _note_lines(runs, panel, path)
    if lines:
        ax.annotate("\n".join(lines), (0, 1), xycoords="axes fraction", xytext=(0, 3), textcoords="offset points",
                    ha="left", va="bottom", fontsize=7, color="darkred", linespacing=1.2)
        ax.set_title(ax.get_title(), fontsize=10, pad=6 + NOTE_LINE_PT * len(lines))


SOLID = {"alpha": 0.9}
HATCHED = {"alpha": 0.35, "hatch": "//"}


def draw(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    n = len(runs)
    cmap = plt.get_cmap("tab10")
    colors = [cmap(i % 10) for i in range(n)]
    w, h = figure_size(n)
    fig = plt.figure(figsize=(w, h), dpi=DPI)
    top_notes = max(len(_note_lines(runs, 1, path)), len(_note_lines(runs, 2, path)))  # room for them below the title
    grid = fig.add_gridspec(3, 2, height_ratios=[5, 5, 0.3 * (n + 1) + 0.3], hspace=0.4, wspace=0.25,
                            left=0.06, right=0.95, top=0.94 - top_notes * NOTE_LINE_PT / 72 / h, bottom=0.02)
    fig.suptitle(f"{n} run{'s' * (n != 1)} side by side (python -m tools.report)", fontsize=12)
    solid, hatched = Patch(facecolor="0.3", label=""), Patch(facecolor="0.6", alpha=0.35, hatch="//", label="")

    def where(panel: int) -> str:  # why a panel is empty
        return "to draw (left out: above)" if _note_lines(runs, panel, path) else "in these results.json"

    # (1) loss curves
    ax = fig.add_subplot(grid[0, 0])
    drawn = False
    for r, c in zip(runs, colors):
        if any(v is not None for v in r.losses):
            ax.plot(r.steps, [math.nan if v is None else v for v in r.losses], color=c, marker="o",
                    markersize=3, label=_plot_text(r.label))
            drawn = True
        if any(v is not None for v in r.eval_losses):
            ax.plot(r.eval_steps, [math.nan if v is None else v for v in r.eval_losses], color=c,
                    linestyle="--", marker="s", markersize=3, label=_plot_text(r.label, 20) + " (held-out)")
            drawn = True
        for first, before, after in r.size_changes:  # where a resume changed the world size
            ax.axvline(first - 0.5, color=c, linestyle=":", linewidth=1.2)
            ax.annotate(f"{before}->{after} ranks", (first - 0.5, 1), xycoords=("data", "axes fraction"),
                        xytext=(2, -10), textcoords="offset points", fontsize=7, color=c, rotation=90, va="top")
    ax.set_title("(1) loss per step: training solid, held-out dashed", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    else:
        _empty(ax, "no losses " + where(1))
    _notes(ax, runs, 1, path)

    # (2) first step vs steady step
    ax = fig.add_subplot(grid[0, 1])
    firsts, steadies = [r.first_step_s for r in runs], [r.steady_step_s for r in runs]
    _grouped(ax, runs, colors, [(firsts, [f"{_fmt(v)} s" for v in firsts], HATCHED),
                                (steadies, [f"{_fmt(v)} s" for v in steadies], SOLID)])
    ax.set_title("(2) step time: first step (compile, warm-up) vs steady step", fontsize=10)
    present = [v for v in firsts + steadies if v is not None and v > 0]
    if present:
        _scale(ax, firsts + steadies)
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3, axis="y")
        solid.set_label("steady step")
        hatched.set_label("first step")
        ax.legend(handles=[hatched, solid], fontsize=8)
    else:
        _empty(ax, "no step times (`timing`) " + where(2))
    _notes(ax, runs, 2, path)

    # (3) tokens/s and MFU
    ax = fig.add_subplot(grid[1, 0])
    ax2 = ax.twinx()
    tokens = [r.tokens_per_s[0] for r in runs]
    mfus = [100 * r.mfu if r.mfu is not None else None for r in runs]
    _grouped(ax, runs, colors, [(tokens, [_fmt_tokens(r) for r in runs], SOLID),
                                (mfus, [_fmt_mfu(r.mfu) for r in runs], HATCHED)], axes=[ax, ax2])
    ax.set_title("(3) tokens/s, steady (solid; * whole run) and MFU (hatched)", fontsize=10)
    for a, values, name in ((ax, tokens, "tokens/s (all ranks)"), (ax2, mfus, "MFU %")):
        if any(v is not None for v in values):
            _scale(a, values)
            a.set_ylabel(name)
        else:
            a.set_yticks([])
    ax.grid(alpha=0.3, axis="y")
    if all(v is None for v in tokens + mfus):
        _empty(ax, "no throughput " + where(3))
    _notes(ax, runs, 3, path)

    # (4) memory against the plan
    ax = fig.add_subplot(grid[1, 1])
    peaks, planned = [r.peak_gib for r in runs], [r.planned_gib for r in runs]
    _grouped(ax, runs, colors, [(peaks, [_fmt(v) for v in peaks], SOLID), (planned, [_fmt(v) for v in planned],
                                                                            HATCHED)])
    for i, r in enumerate(runs):
        if r.memory_ratio is not None or not r.memory_comparable:
            top = max(v for v in (r.peak_gib, r.planned_gib, 0.0) if v is not None)
            ax.annotate(f"{r.memory_ratio:.2f}x the plan" if r.memory_comparable else
                        f"{r.memory_unlike}: not comparable",
                        (i, top), ha="center", va="bottom", fontsize=8, xytext=(0, 14), textcoords="offset points",
                        fontweight="bold")
    ax.set_title("(4) memory per rank: peak of the largest rank (solid) vs planned (hatched)", fontsize=10)
    if all(v is None for v in peaks + planned):
        _empty(ax, "no memory figures " + where(4))
    else:
        _scale(ax, peaks + planned, 1.3)
        ax.set_ylabel("GiB")
        ax.grid(alpha=0.3, axis="y")
    _notes(ax, runs, 4, path)

    # a row per run
    ax = fig.add_subplot(grid[2, :])
    ax.axis("off")
    cols = ("run", "script", "preset", "device", "world size", "steps", "loss first -> last", "torch", "torchtitan",
            "transformers")
    cells = [[_plot_text(row[0]), _plot_text(row[1]), _plot_text(row[2]), _plot_text(row[3]), row[4], row[5],
              f"{row[6]} -> {row[7]}", *(_plot_text(v, 24) for v in row[13:16])] for row in table_rows(runs)]
    table = ax.table(cellText=cells, colLabels=cols, loc="upper center", cellLoc="left", colLoc="left")
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    table.auto_set_column_width(list(range(len(cols))))
    table.scale(1, 1.2)
    for i, c in enumerate(colors):
        table[i + 1, 0].set_facecolor((*c[:3], 0.35))

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI, metadata={PNG_KEY: PNG_VALUE})
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# Where the report goes: never over a file this tool did not write.

def _png_text(path: Path, limit: int = 1 << 20) -> dict[str, str]:
    """The tEXt chunks before the image data of a PNG (empty for anything else)."""
    out = {}
    with open(path, "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            return out
        while f.tell() < limit:
            head = f.read(8)
            if len(head) < 8:
                break
            length, kind = struct.unpack(">I4s", head)
            if kind in (b"IDAT", b"IEND") or length > limit:
                break
            data = f.read(length)
            f.read(4)  # CRC
            if kind == b"tEXt" and b"\0" in data:
                key, value = data.split(b"\0", 1)
                out[key.decode("latin-1")] = value.decode("latin-1")
    return out


def is_own_report(path: Path) -> bool:
    """Whether `path` (a regular file) is a PNG or .md this tool wrote."""
    try:
        if path.suffix.lower() == ".png":
            return _png_text(path).get(PNG_KEY) == PNG_VALUE
        with open(path, "rb") as f:
            return f.read(len(MD_MARKER.encode()) + 1).decode("utf-8", errors="replace").startswith(MD_MARKER)
    except OSError:
        return False


def check_out(out: Path, inputs: list[Path]) -> Path:
    """The .md beside --out; UserError when either would replace something that is not this tool's report."""
    if out.suffix.lower() != ".png":
        raise UserError(f"--out {one_line(str(out))}: the report is a PNG: name a .png file (the table goes beside "
                        "it as .md)")
    md = out.with_suffix(".md")
    for target in (out, md):
        shown = one_line(str(target))
        if not os.path.lexists(target):
            continue
        if not _is_regular_file(target):
            raise UserError(f"--out: {shown} is there and is not a regular file: it is left alone; "
                            "name a new file for the report")
        if any(os.path.exists(f) and os.path.samefile(target, f) for f in inputs):
            raise UserError(f"--out: {shown} is one of the inputs: name a new file for the report")
        if not is_own_report(target):
            raise UserError(f"--out: {shown} exists and is not a report this tool wrote: name a new file for the "
                            "report, or remove that one first")
    return md


# ---------------------------------------------------------------------------------------------------------------

def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m tools.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Fields and how they are measured: docs/pilot-report.md.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a training run's --out_dir (its results.json), or the results.json itself")
    parser.add_argument("--out", required=True, metavar="FILE.png",
                        help="the picture; the table is written beside it as FILE.md. An existing file is "
                             "replaced only if this tool wrote it")
    parser.add_argument("--label", action="append", metavar="NAME", default=None,
                        help="a run's name in the picture and table, once per RUN_DIR in the same order "
                             "(default: each run's folder name)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.label is not None and len(args.label) != len(args.run_dirs):
            raise UserError(f"{len(args.run_dirs)} RUN_DIRs and {len(args.label)} --label: give one --label per "
                            "RUN_DIR, in the same order, or none")
        out = Path(args.out)
        md = check_out(out, [results_path(r) for r in args.run_dirs])
        labels = [one_line(x) for x in args.label] if args.label else default_labels(args.run_dirs)
        runs = [load_run(r, lab) for r, lab in zip(args.run_dirs, labels)]
        try:
            draw(runs, out)
            atomic_write_text(md, render_markdown(runs, [r.path for r in runs], md.parent))
        except OSError as e:
            raise UserError(f"cannot write the report: {one_line(str(e))}") from None
    except UserError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    print(render_text(runs), end="")
    print(f"\nwrote {one_line(str(out))} and {one_line(str(md))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
