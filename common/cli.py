"""Dataclass -> command line, presets, and the one-line `error:` exit.

The dataclass is the one place for defaults: the CLI is generated from its fields,
with the same names; a preset is a named function returning a changed copy of the defaults,
and flags given on the command line override the preset. Unknown flags, wrong types and
unknown presets are errors with a one-line message.
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
    parser = ArgumentParser(  # refuses shortened flags; a bad flag is one `error:` line
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # only flags actually given override the preset
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
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
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
    for name, value in dataclasses.asdict(cfg).items():  # argparse's float() takes "nan" and "inf"
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"--{name} must be a finite number, got {value}")
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
        print(f"error: {one_line(str(e))}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        _exit_interrupted()
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if isinstance(e, (SystemExit, GeneratorExit)):
            raise
        if _behind(e, lambda x: isinstance(x, KeyboardInterrupt)):  # Ctrl-C inside a checkpoint save
            _exit_interrupted()
        full = _behind(e, lambda x: isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT))
        if full is None:
            raise
        print(f"error: out of disk space writing {one_line(str(full.filename or 'a file'))}: free space or choose "
              "another --out_dir",
              file=sys.stderr)
        return 2
    return 0


def _exit_interrupted() -> typing.NoReturn:
    """Ctrl-C: one line and exit 130, at once. Interrupted during a checkpoint save, the process can still hold
    torch's C++ threads, and the interpreter's normal exit then aborts ('terminate called without an active
    exception', SIGABRT) after the line."""
    print("error: interrupted", file=sys.stderr, flush=True)
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


def require(cfg, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    """Range checks of numeric flags: one `error:` line naming the flag."""
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise UserError(f"--{name} must be positive, got {getattr(cfg, name)}")
    for name in non_negative:
        if getattr(cfg, name) < 0:
            raise UserError(f"--{name} must not be negative, got {getattr(cfg, name)}")


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


def format_config(cfg) -> str:
    return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items())
