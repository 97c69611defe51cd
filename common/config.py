"""Dataclass -> command line, presets, results.json, version stamps and the loss plot.

The dataclass is the one place for defaults (STYLE 2): the CLI is generated from its fields,
with the same names; a preset is a named function returning a changed copy of the defaults,
and flags given on the command line override the preset. Unknown flags, wrong types and
unknown presets are errors with a one-line message.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import types
import typing
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from common.errors import UserError


def _is_union(tp) -> bool:
    return get_origin(tp) in (typing.Union, types.UnionType)  # Optional[X] and X | None


def _field_type(tp) -> tuple[Callable | None, tuple | None]:
    """Map a field annotation to (argparse type, choices)."""
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        return type(choices[0]), choices
    if _is_union(tp):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return _field_type(inner[0])
    if tp in (int, float, str, bool):
        return tp, None
    raise TypeError(f"unsupported config field type {tp!r}")


def _optional(tp) -> bool:
    return _is_union(tp) and type(None) in get_args(tp)


def _parse_optional(conv: Callable) -> Callable:
    def parse(text: str):
        return None if text.lower() in ("none", "") else conv(text)
    parse.__name__ = conv.__name__
    return parse


def build_parser(cls: type, presets: dict[str, Callable[[], Any]], description: str,
                 default_preset: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # only flags actually given override the preset
        allow_abbrev=False,  # a mistyped or shortened flag is an error, not a guess
    )
    parser.add_argument("--preset", default=default_preset, choices=sorted(presets),
                        help=f"named preset the flags below start from (default: {default_preset}). "
                             + "; ".join(f"{k}: {(fn.__doc__ or '').strip().splitlines()[0]}"
                                         for k, fn in presets.items()))
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name == "preset":
            continue
        tp = hints[f.name]
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        conv, choices = _field_type(tp)
        flag = "--" + f.name
        if conv is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                help=f"{help_text} (default: {default})")
            continue
        if _optional(tp):
            conv = _parse_optional(conv)
        parser.add_argument(flag, type=conv, choices=choices, metavar=f.metadata.get("metavar"),
                            help=f"{help_text} (default: {default})")
    return parser


def parse_config(cls: type, presets: dict[str, Callable[[], Any]], argv: list[str] | None,
                 description: str, default_preset: str):
    """Preset first, then the flags given; returns the resolved dataclass instance."""
    parser = build_parser(cls, presets, description, default_preset)
    args = vars(parser.parse_args(argv))
    preset = args.pop("preset")
    cfg = presets[preset]()
    cfg = dataclasses.replace(cfg, preset=preset, **args)
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def run_cli(main: Callable[[Any], dict], cls: type, presets: dict, description: str,
            default_preset: str, argv: list[str] | None = None) -> int:
    """Parse, run `main(cfg)`, and turn a UserError into one line on stderr and exit code 2."""
    try:
        cfg = parse_config(cls, presets, argv, description, default_preset)
        main(cfg)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


def versions() -> dict[str, str | None]:
    """The version stack a result was produced with (STYLE 9)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "torchtitan", "transformers", "safetensors", "datasets",
                 "torch-neuronx", "neuronx-cc"):
        try:
            out[name.replace("-", "_")] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name in ("torch", "torchtitan", "transformers"):
                out[name] = None
    return out


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write via a temp file in the same folder and rename: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_results(out_dir: str | os.PathLike, results: dict) -> Path:
    path = Path(out_dir) / "results.json"
    atomic_write_text(path, json.dumps(results, indent=2, default=_json_default) + "\n")
    return path


def _json_default(o):
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, Path):
        return str(o)
    return repr(o)


def check_out_dir(out_dir: str) -> Path:
    """Create out_dir and prove it is writable before any long work starts."""
    path = Path(out_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-", delete=True)
        probe.close()
    except OSError as e:
        raise UserError(f"--out_dir {out_dir} cannot be written: {e.strerror or e}") from None
    return path


def plot_losses(path: str | os.PathLike, losses: list[float], title: str,
                steps: list[int] | None = None) -> Path | None:
    """A PNG of loss per step (`steps`: their numbers, default 1..N), written atomically.
    Returns None when there is nothing to plot."""
    if not losses:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps or range(1, len(losses) + 1), losses, marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def read_reference_losses(path: str | os.PathLike) -> list[float]:
    """Losses from a reference file: a results.json or a golden file (both hold `losses`)."""
    try:
        data = json.loads(Path(path).read_text())
        losses = [float(x) for x in data["losses"]]
    except FileNotFoundError:
        raise UserError(f"--compare_losses: no file {path}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--compare_losses: {path} is not a JSON file with a 'losses' list ({e})") from None
    if not losses:
        raise UserError(f"--compare_losses: {path} holds no losses")
    return losses


def compare_losses(losses: list[float], path: str | os.PathLike, tolerance: float,
                   steps: list[int] | None = None) -> dict:
    """Per-step differences between a run's losses and a reference file's first N losses, so a user
    on trn2 or CUDA sees at step N whether the hardware reproduces the reference. `steps` numbers
    the losses (from 1; a resumed run starts later); the reference's loss i is step i."""
    reference = read_reference_losses(path)
    numbered = list(zip(steps or range(1, len(losses) + 1), losses))
    pairs = [(s, loss) for s, loss in numbered if 1 <= s <= len(reference)]
    n = len(pairs)
    per_step = [{"step": s, "loss": loss, "reference": reference[s - 1], "abs_diff": abs(loss - reference[s - 1])}
                for s, loss in pairs]
    worst = max((r["abs_diff"] for r in per_step), default=float("nan"))
    first = next((r["step"] for r in per_step if r["abs_diff"] > tolerance), None)
    return {"reference": str(path), "steps_compared": n, "max_abs_diff": worst, "tolerance": tolerance,
            "first_differing_step": first, "passed": n > 0 and first is None, "per_step": per_step}


def format_loss_comparison(c: dict) -> str:
    rows = [f"[compare] {c['steps_compared']} steps against {c['reference']} (tolerance {c['tolerance']:g})"]
    rows += [f"    step {s['step']:3d}  loss {s['loss']:.6f}  reference {s['reference']:.6f}  diff {s['abs_diff']:.2e}"
             for s in c["per_step"]]
    rows.append(f"[compare] max abs diff {c['max_abs_diff']:.2e}: "
                + ("reproduces the reference" if c["passed"] else
                   f"DIFFERS from the reference from step {c['first_differing_step']}"))
    return "\n".join(rows)


def finish_run(results: dict, history: dict, *, compare_with: str | None, tolerance: float, out_dir: Path,
               title: str, is_main: bool) -> Path | None:
    """A training run's last steps: the loss comparison (`--compare_losses`) over the whole curve,
    then on rank 0 loss.png and results.json (atomic). Returns the results.json path on rank 0."""
    if compare_with:
        results["loss_comparison"] = compare_losses(history["losses"], compare_with, tolerance, steps=history["steps"])
        if is_main:
            print(format_loss_comparison(results["loss_comparison"]), flush=True)
    if not is_main:
        return None
    plot_losses(Path(out_dir) / "loss.png", history["losses"], title, steps=history["steps"])
    return write_results(out_dir, results)


def format_config(cfg) -> str:
    return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items())
