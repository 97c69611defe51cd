"""Dataclass -> command line, presets, and the one-line `error:` exit.

The dataclass is the one place for defaults: the CLI is generated from its fields, with the same names; a preset is a
named function returning a changed copy of the defaults, and flags given on the command line override the preset.
Unknown flags, wrong types and unknown presets are errors with a one-line message.

Every int and float field declares the values it takes where it is declared, in its metadata (`field(default=10,
metadata={"help": ..., **cli.bounds(1, 10**7)})`): `build_parser` refuses a numeric field without bounds (a TypeError:
a flag cannot be added without them), and `parse_config` checks every numeric value once the preset and the flags are
applied, one `error:` line naming the flag, the value and what it takes.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import math
import os
import sys
import tempfile
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from common.errors import ArgumentParser, UserError, one_line


@dataclasses.dataclass(frozen=True)
class Bounds:
    """What a numeric flag takes: `low` <= value <= `high` (`above` < value instead of `low`: an exclusive
    lower bound), a multiple of `multiple_of` when set, or one of the values `also` (a sentinel such as -1).
    `why`: the reason, shown with every refusal. Made by `bounds()`; None is always taken by an optional field."""
    low: int | float | None
    high: int | float
    above: int | float | None = None
    also: tuple = ()
    multiple_of: int | None = None
    why: str = ""

    def describe(self) -> str:
        """What the flag takes, in words: "1 to 10000000", "-1 or 1 to 16777216", "above 0 and at most 10"."""
        rng = (f"above {_num(self.above)} and at most {_num(self.high)}" if self.above is not None
               else f"{_num(self.low)} to {_num(self.high)}")
        text = " or ".join([*(_num(v) for v in self.also), rng])
        if self.multiple_of:
            text += f", a multiple of {self.multiple_of}"
        return text + (f" ({self.why})" if self.why else "")

    def problem(self, value) -> str | None:
        """None when `value` is taken; else what is wrong with it, to follow the flag's name."""
        if value in self.also:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        either = "".join(f"{_num(v)} or " for v in self.also)
        if self.above is not None and not value > self.above:
            return f"must be {either}{'positive' if self.above == 0 else f'above {_num(self.above)}'}, got {value}"
        if self.low is not None and value < self.low:
            if self.low == 0 and not either:
                return f"must not be negative, got {value}"
            need = "positive" if self.low == 1 and isinstance(value, int) else f"at least {_num(self.low)}"
            return f"must be {either}{need}, got {value}"
        if value > self.high:
            return f"{value} is more than {_num(self.high)}"
        if self.multiple_of and value % self.multiple_of:
            return f"must be a multiple of {self.multiple_of}, got {value}"
        return None

    def refusal(self, name: str, value) -> str | None:
        """The one-line error for flag `name` set to `value`, or None when the value is taken."""
        problem = self.problem(value)
        return None if problem is None else f"--{name} {problem}; it takes {self.describe()}"


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def bounds(low: int | float | None = None, high: int | float | None = None, *, above: int | float | None = None,
           also: tuple = (), multiple_of: int | None = None, why: str = "") -> dict:
    """Field metadata for a numeric flag: `field(default=2, metadata={"help": ..., **cli.bounds(1, 4096)})`.
    low..high inclusive; `above=0` instead of `low` for "a number above 0" (an exclusive lower bound); `also`:
    other values taken (`also=(-1,)`: -1 means automatic); `multiple_of`: the value must divide by it; `why`: the
    reason, shown in the refusal. Choose them generous but sane: what a trn2 cluster could need, nothing that
    allocates absurd memory or overflows."""
    if (low is None) == (above is None):
        raise TypeError("cli.bounds takes a lower bound: low (inclusive) or above= (exclusive), not both")
    if high is None or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                               for x in (low if low is not None else above, high, *also)):
        raise TypeError("cli.bounds takes finite numbers: low or above, high, also")
    if (low if low is not None else above) > high:
        raise TypeError(f"cli.bounds: the lower bound {low if low is not None else above} is above high {high}")
    if multiple_of is not None and not (isinstance(multiple_of, int) and multiple_of > 0):
        raise TypeError(f"cli.bounds: multiple_of must be a positive int, got {multiple_of!r}")
    return {"bounds": Bounds(low, high, above, tuple(also), multiple_of, why)}


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


def flag_fields(cls: type, sections: dict[str, type] | None = None) -> list[tuple[str | None, dataclasses.Field]]:
    """(section name or None, field) for every flag: `cls`'s own fields, then each section's in `sections` ({name:
    its dataclass}); a section `cls` declares that is not in `sections` has no flags (the core alone: no guards), nor
    has its dotted field (torchtitan's own settings by their names: split_dotted)."""
    own = [(None, f) for f in dataclasses.fields(cls) if "section" not in f.metadata and "dotted" not in f.metadata]
    inner = [(name, f) for name, section in (sections or {}).items() for f in dataclasses.fields(section)]
    names = [f.name for _, f in own + inner]
    if len(set(names)) != len(names):  # a programming error: one flag, two fields
        raise TypeError(f"{cls.__name__}: a flag named twice: {sorted(n for n in names if names.count(n) > 1)}")
    return own + inner


def build_parser(cls: type, presets: dict[str, Callable[[], Any]], description: str,
                 default_preset: str, sections: dict[str, type] | None = None) -> argparse.ArgumentParser:
    parser = ArgumentParser(  # refuses shortened flags; a bad flag is one `error:` line
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # only flags actually given override the preset
    )
    about = {k: " ".join((fn.__doc__ or "").split("\n\n")[0].split()) for k, fn in presets.items()}  # 1st paragraph
    parser.add_argument("--preset", default=default_preset, choices=sorted(presets),
                        help=f"named preset the flags below start from (default: {default_preset}). "
                             + "; ".join(f"{k}: {text}" for k, text in about.items()))
    parser.epilog = " ".join(f.metadata["help"] for f in dataclasses.fields(cls) if "dotted" in f.metadata) or None
    hints = {None: typing.get_type_hints(cls), **{n: typing.get_type_hints(c) for n, c in (sections or {}).items()}}
    for section, f in flag_fields(cls, sections):
        if f.name == "preset":
            continue
        tp = hints[section][f.name]
        owner = cls.__name__ if section is None else (sections or {})[section].__name__
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        conv, choices = _field_type(tp)
        flag = "--" + f.name
        b = f.metadata.get("bounds")
        if conv in (int, float) and choices is None:  # a programming error: every test that builds the parser fails
            if not isinstance(b, Bounds):
                raise TypeError(f"{owner}.{f.name} is a numeric flag without bounds: declare what it takes, "
                                f"field(..., metadata={{'help': ..., **cli.bounds(low, high)}})")
            if default is not None and b.problem(default) is not None:
                raise TypeError(f"{owner}.{f.name}: its default {default!r} is outside its own bounds "
                                f"({b.describe()})")
            help_text += f"; takes {b.describe()}".replace("%", "%%")
        elif b is not None:
            raise TypeError(f"{owner}.{f.name}: bounds on a flag that is not an int or a float")
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
                 description: str, default_preset: str, unknown_hint: str | None = None,
                 sections: dict[str, type] | None = None):
    """Preset first, then the flags given; returns the resolved dataclass instance, each of `sections` ({name: its
    dataclass}) filled in (the preset's, else the section's defaults, then its flags). `unknown_hint`: why a flag may
    be unknown here, added to argparse's `unrecognized arguments` line."""
    parser = build_parser(cls, presets, description, default_preset, sections)
    dotted = {f.name for f in dataclasses.fields(cls) if "dotted" in f.metadata}
    argv, settings = split_dotted(list(sys.argv[1:] if argv is None else argv)) if dotted else (argv, ())
    if unknown_hint is None:
        args = vars(parser.parse_args(argv))
    else:
        known, unknown = parser.parse_known_args(argv)
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)} ({unknown_hint})")
        args = vars(known)
    preset = args.pop("preset")
    cfg = presets[preset]()
    owner = {f.name: section for section, f in flag_fields(cls, sections)}
    given = {name: {k: v for k, v in args.items() if owner[k] == name} for name in (None, *(sections or {}))}
    filled = {name: dataclasses.replace(getattr(cfg, name) or section(), **given[name])
              for name, section in (sections or {}).items()}
    cfg = dataclasses.replace(cfg, preset=preset, **given[None], **filled,
                              **{name: (*getattr(cfg, name), *settings) for name in dotted})
    check_bounds(cfg)
    for part in (cfg, *filled.values()):
        if hasattr(part, "validate"):
            part.validate()
    return cfg


def split_dotted(argv: list[str]) -> tuple[list[str], tuple[tuple[str, str], ...]]:
    """The command line's dotted settings apart from its flags: `--SECTION.FIELD VALUE` (or `=VALUE`), torchtitan's
    own name of a Trainer.Config field (`--lr_scheduler.decay_ratio 0.5`); set on the recipe's Trainer.Config by
    `common.recipe.set_dotted`. A dotted flag without a value is one UserError."""
    rest, settings, i = [], [], 0
    while i < len(argv):
        word = argv[i]
        name = word[2:].split("=", 1)[0]
        if word == "--":
            rest += argv[i:]
            break
        if not (word.startswith("--") and "." in name and name[0].isalpha()):
            rest.append(word)
            i += 1
            continue
        if "=" in word:
            settings.append((name, word.split("=", 1)[1]))
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            settings.append((name, argv[i + 1]))
            i += 2
        else:
            raise UserError(f"--{name} takes a value: --{name} VALUE (torchtitan's setting {name})")
    return rest, tuple(settings)


def check_bounds(cfg) -> None:
    """Every numeric field against the bounds it declares (argparse's float() also takes "nan" and "inf"; the
    preset's values are checked too): one UserError naming the flag, the value and what it takes. None, an
    optional field's "not given", is taken."""
    for f in dataclasses.fields(cfg):
        b = f.metadata.get("bounds")
        value = getattr(cfg, f.name)
        if "section" in f.metadata and value is not None:
            check_bounds(value)
        elif b is not None and value is not None and (message := b.refusal(f.name, value)):
            raise UserError(message)


def run_cli(main: Callable[[Any], dict], cls: type, presets: dict, description: str,
            default_preset: str, argv: list[str] | None = None, explain: Callable | None = None,
            unknown_hint: str | None = None, sections: dict[str, type] | None = None) -> int:
    """Parse, run `main(cfg)`, and turn a UserError into one line on stderr and exit code 2 (a full disk too:
    `explain(exception, cfg)` may name what else a failure means, as one line, or None)."""
    cfg = None
    try:
        cfg = parse_config(cls, presets, argv, description, default_preset, unknown_hint, sections)
        main(cfg)
    except UserError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C; or a check cut short by a stop (common.harness.verifier.CheckInterrupted)
        _exit_interrupted(str(e))
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if isinstance(e, (SystemExit, GeneratorExit)):
            raise
        if (stopped := _behind(e, lambda x: isinstance(x, KeyboardInterrupt))) is not None:  # inside a save
            _exit_interrupted(str(stopped))
        line = explain(e, cfg) if explain is not None else None
        if line is None and (full := _behind(e, lambda x: isinstance(x, OSError) and x.errno in (errno.ENOSPC,
                                                                                                errno.EDQUOT))):
            line = f"out of disk space writing {one_line(str(full.filename or 'a file'))}: free space or choose " \
                   "another --out_dir"
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
        return 2
    return 0


def _exit_interrupted(detail: str = "") -> typing.NoReturn:
    """Ctrl-C: one line (with `detail`, what was cut short) and exit 130 (128 + SIGINT, docs/errors.md), at once.
    Interrupted during a checkpoint save, the process can still hold torch's C++ threads, and the interpreter's
    normal exit then aborts ('terminate called without an active exception', SIGABRT) after the line."""
    print(f"error: interrupted{': ' + one_line(detail) if detail else ' by SIGINT'}", file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(130)


def _behind(e: BaseException, match) -> BaseException | None:
    """The exception behind `e` that `match`es: `e` itself, one it chains, or one inside the per-rank
    failures of torch.distributed.checkpoint's CheckpointException (torchtitan's saves)."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if match(x):
            return x
        todo += [c for c in (x.__cause__, x.__context__) if c is not None]
        for failure in (getattr(x, "failures", None) or {}).values():
            todo += [f for f in (failure if isinstance(failure, tuple) else (failure,)) if isinstance(f, BaseException)]
    return None


def check_out_dir(out_dir: str, inputs: dict[str, str | None] | None = None) -> Path:
    """Create out_dir and prove it is writable before any long work starts. `inputs` ({flag: path}):
    files and folders the run reads, which out_dir must neither be, lie inside, nor contain; the prepared
    assets' cache (and the environment beside it) always counts as one."""
    from common.paths import CACHE_DIR

    if not out_dir.strip():
        raise UserError("--out_dir is empty (an unset shell variable?): name the folder for this run's files")
    path = Path(out_dir)
    for flag, value in {"the prepared assets' cache": str(CACHE_DIR.parent), **(inputs or {})}.items():
        if value:
            src, out = Path(value).resolve(), path.resolve()
            if src == out or src in out.parents or out in src.parents:
                raise UserError(f"--out_dir {out_dir} overlaps {flag} {value}: the run would write into its input")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-", delete=True)
        probe.close()
    except OSError as e:
        raise UserError(f"--out_dir {out_dir} cannot be written: {e.strerror or e}") from None
    return path


def flags(cfg) -> dict:
    """The config as its command line names it, {flag: value}: its own fields, then each section's (a section left
    None, the core alone's guards, has none). results.json's `config` and the `[config]` line."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if "dotted" in f.metadata:
            out.update(dict(value))
        elif "section" not in f.metadata:
            out[f.name] = value
        elif value is not None:
            out.update(dataclasses.asdict(value))
    return out


def format_config(cfg) -> str:
    return " ".join(f"{k}={v}" for k, v in flags(cfg).items())
