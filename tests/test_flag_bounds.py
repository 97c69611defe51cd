"""Every numeric flag of every script declares the values it takes where it is declared (`cli.bounds` in its
field's metadata; `cli.build_parser` refuses a numeric field without them), and one table of hostile values goes
through every such flag of every script: each value is either inside the declared bounds and accepted, or refused
with one UserError naming the flag; never accepted outside them, never another exception. In-process: parsing
takes milliseconds; the command-line rows at the end fail at parsing too."""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from common import cli
from common.errors import UserError
from common.losses import not_finite
from conftest import ROOT

SANE = 1e10  # no bound reaches this: steps, ranks, seeds, batch sizes and memory all stay far below


def _scripts() -> list[str]:
    """Every script whose command line is generated from a Config dataclass (it calls cli.run_cli, or declares a
    training Recipe that the harness runs through it): a new script is in the table without being listed here."""
    return [f"{folder}/{path.name}" for folder in ("examples", "bench")
            for path in sorted((ROOT / folder).glob("*.py"))
            if "cli.run_cli(" in path.read_text() or "RECIPE = Recipe(" in path.read_text()]


SCRIPTS = _scripts()


def _module(script: str):
    """The script's Config, PRESETS and sections as its command line has them (a training recipe's with the guards'
    section)."""
    from types import SimpleNamespace

    from common.harness import lifecycle

    folder, name = script.split("/")
    mod = importlib.import_module(name.removesuffix(".py") if folder == "examples" else f"bench.{name[:-3]}")
    if hasattr(mod, "RECIPE"):
        return SimpleNamespace(Config=mod.RECIPE.config, PRESETS=mod.RECIPE.presets, SECTIONS=lifecycle.SECTIONS)
    return SimpleNamespace(Config=mod.Config, PRESETS=mod.PRESETS, SECTIONS=None)


def _numeric(mod) -> list[tuple[str | None, dataclasses.Field, type, cli.Bounds]]:
    """(section or None, field, int or float, its bounds) for every numeric flag of a script."""
    out = []
    for section, f in cli.flag_fields(mod.Config, mod.SECTIONS):
        owner = mod.Config if section is None else mod.SECTIONS[section]
        conv, choices = cli._field_type(typing.get_type_hints(owner)[f.name])
        if conv in (int, float) and choices is None:
            out.append((section, f, conv, f.metadata.get("bounds")))
    return out


def _value(cfg, section: str | None, name: str):
    return getattr(cfg if section is None else getattr(cfg, section), name)


def _parse(mod, argv: list[str]):
    return cli.parse_config(mod.Config, mod.PRESETS, argv, "", mod.Config().preset, sections=mod.SECTIONS)


def _inside(b: cli.Bounds, v) -> bool:
    """The declared bounds, read on their own (not through cli's check): is `v` a value the flag takes?"""
    if v in b.also:
        return True
    if isinstance(v, float) and not math.isfinite(v):
        return False
    above_low = v > b.above if b.above is not None else v >= b.low
    return above_low and v <= b.high and not (b.multiple_of and v % b.multiple_of)


def _hostile(conv: type, b: cli.Bounds) -> list[str]:
    """Zero, negative, huge, NaN, infinite, both edges and one past each, and a value that is not a multiple of
    what it must divide by."""
    lo = b.low if b.low is not None else b.above
    values = ["0", "-5", "-1", "1", str(10**30), "99999999999999999999999", "1e30", "nan", "inf", "-inf", "0.5",
              repr(lo), repr(b.high)]
    if conv is int:
        values += [str(lo - 1), str(b.high + 1), str(2**63), str(2**64 + 1)]
    else:
        values += [repr(b.high * 1.001), repr(lo - 1e-9), "1e-300", "-0.0"]
    if b.multiple_of and b.multiple_of > 1:
        values.append(str(next(v for v in range(max(int(lo), 1), int(lo) + 2 * b.multiple_of) if v % b.multiple_of)))
        values.append(str(b.high - 1))
    return list(dict.fromkeys(values))


def _as(conv: type, text: str):
    """The value argparse makes of `text` for this flag, or None where it refuses the text itself."""
    try:
        return conv(text)
    except ValueError:
        return None


def test_every_script_is_in_the_table():
    assert {"examples/train_native_qwen3.py", "examples/train_hf_backend.py", "examples/train_moe_nki.py",
            "examples/rope_parity.py", "examples/generate_compat_check.py", "bench/bench_moe.py",
            "bench/bench_rope.py", "bench/bench_scaling.py", "bench/bench_memory_model.py"} <= set(SCRIPTS), SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_numeric_flag_declares_sane_bounds(script):
    """Bounds on every int and float flag, none so wide that a huge, negative or non-finite value gets through."""
    mod = _module(script)
    fields = _numeric(mod)
    assert fields, f"{script} has no numeric flag?"
    for _, f, conv, b in fields:
        assert isinstance(b, cli.Bounds), f"{script} --{f.name} has no cli.bounds"
        assert b.high < SANE and (b.low if b.low is not None else b.above) > -5, (f.name, b)
        for v in (10**30, 1e30, -5, math.nan, math.inf, -math.inf):
            assert not _inside(b, v), (f.name, v, b)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_preset_parses(script):
    """Each preset's own values are inside its flags' bounds (parse_config checks them as it checks flags)."""
    mod = _module(script)
    for preset in mod.PRESETS:
        cfg = _parse(mod, ["--preset", preset])
        for section, f, _, b in _numeric(mod):
            value = _value(cfg, section, f.name)
            assert value is None or _inside(b, value), (preset, f.name, value)


@pytest.mark.parametrize("script", SCRIPTS)
def test_hostile_values_are_taken_inside_the_bounds_and_refused_in_one_line_outside(script, capsys):
    mod = _module(script)
    wrong = []
    for section, f, conv, b in _numeric(mod):
        flag = f"--{f.name}"
        # `--flag=TEXT` and `--flag TEXT` are the same argparse path unless TEXT starts with '-' (then the second
        # reads as a flag): both spellings for those, one for the rest (each parse builds the parser: 0.07 s)
        for text, argv in ((t, a) for t in _hostile(conv, b)
                           for a in ([flag, t], [f"{flag}={t}"])[: 2 if t.startswith("-") else 1]):
            value = _as(conv, text)
            try:
                cfg = _parse(mod, argv)
            except UserError as e:
                message = str(e)
                if value is not None and not _inside(b, value):  # refused by the bounds: flag, value, bounds named
                    if not (message.startswith(f"{flag} ") and str(value) in message and b.describe() in message):
                        wrong.append(f"{argv}: {message}")
                elif flag not in message:  # inside the bounds, refused by a check across flags: still named
                    wrong.append(f"{flag} {text} (inside the bounds) refused without naming the flag: {message}")
            except SystemExit as e:  # argparse's own refusal, one line naming the flag: text that is not an int, or
                # `--lr -inf` (a word starting with '-' that is not a plain negative number reads as a flag)
                err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
                if (value is not None and not (len(argv) == 2 and text.startswith("-"))) or e.code != 2 \
                        or len(err) != 1 or flag not in err[0]:
                    wrong.append(f"{argv}: exit {e.code}, {err}")
            except Exception as e:  # noqa: BLE001  the point: never another exception
                wrong.append(f"{argv}: {type(e).__name__}: {e}")
            else:
                if value is None or not _inside(b, value) or _value(cfg, section, f.name) != value:
                    wrong.append(f"{argv}: accepted as {_value(cfg, section, f.name)!r}, bounds {b.describe()}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("script", SCRIPTS)
def test_bounds_hold_for_values_argparse_would_never_make(script):
    """NaN, infinities and 10**30 set on any numeric field (int ones included, as a preset could) are refused."""
    mod = _module(script)
    base = _parse(mod, [])
    for section, f, _, _ in _numeric(mod):
        for v in (math.nan, math.inf, -math.inf, 10**30, -(10**30)):
            changed = dataclasses.replace(base, **{f.name: v}) if section is None else dataclasses.replace(
                base, **{section: dataclasses.replace(getattr(base, section), **{f.name: v})})
            with pytest.raises(UserError, match=f"^--{f.name} "):
                cli.check_bounds(changed)


def test_chunked_loss_scripts_declare_torchtitans_chunk_count():
    """torchtitan's ChunkedLossWrapper (the loss of the qwen3_32b and qwen3_30b_a3b builders) splits each sequence
    into num_chunks equal parts: --seq_len must be a multiple of it, read from the installed torchtitan."""
    tt = Path(importlib.util.find_spec("torchtitan").origin).parent
    chunks = int(re.search(r"class ChunkedLossWrapper\b.*?num_chunks: int = (\d+)",
                           (tt / "components" / "loss.py").read_text(), re.S)[1])
    registry = (tt / "models" / "qwen3" / "config_registry.py").read_text()
    for builder in ("qwen3_32b", "qwen3_30b_a3b"):
        body = re.search(rf"def {builder}\(\).*?\n(?=def )", registry, re.S)[0]
        assert "ChunkedLossWrapper.Config(" in body and "num_chunks" not in body, builder
    for script in ("examples/train_native_qwen3.py", "examples/train_moe_nki.py", "bench/bench_memory_model.py",
                   "bench/bench_scaling.py"):
        b = next(b for _, f, _, b in _numeric(_module(script)) if f.name == "seq_len")
        assert b.multiple_of == chunks and b.low >= chunks, (script, b)


def test_help_shows_what_each_numeric_flag_takes():
    mod = _module("examples/train_native_qwen3.py")
    text = " ".join(cli.build_parser(mod.Config, mod.PRESETS, "", "tiny", mod.SECTIONS).format_help().split())
    assert "takes 8 to 262144, a multiple of 8" in text and "takes -1 or 1 to 16777216" in text


@dataclass
class _Unbounded:
    preset: str = "a"
    steps: int = field(default=3, metadata={"help": "steps"})


@dataclass
class _UnboundedOptionalFloat:
    preset: str = "a"
    rate: float | None = None


@dataclass
class _DefaultOutside:
    preset: str = "a"
    steps: int = field(default=0, metadata={"help": "steps", **cli.bounds(1, 10)})


@dataclass
class _BoundedText:
    preset: str = "a"
    name: str = field(default="x", metadata={"help": "a name", **cli.bounds(1, 10)})


@pytest.mark.parametrize("cls, needle", [(_Unbounded, "_Unbounded.steps is a numeric flag without bounds"),
                                         (_UnboundedOptionalFloat, "_UnboundedOptionalFloat.rate is a numeric flag"),
                                         (_DefaultOutside, "its default 0 is outside its own bounds"),
                                         (_BoundedText, "bounds on a flag that is not an int or a float")])
def test_a_numeric_flag_cannot_be_declared_without_bounds(cls, needle):
    """A programming error, at parser build: every test (and every run) of a script with such a field fails."""
    with pytest.raises(TypeError, match=re.escape(needle)):
        cli.build_parser(cls, {"a": cls}, "", "a")


@pytest.mark.parametrize("kwargs", [{}, {"low": 1}, {"low": 1, "above": 0, "high": 2}, {"low": 5, "high": 2},
                                    {"low": 0, "high": math.inf}, {"low": 0, "high": 8, "multiple_of": 0}])
def test_bounds_refuses_a_malformed_declaration(kwargs):
    with pytest.raises(TypeError):
        cli.bounds(**kwargs)


def test_bounds_messages():
    b = cli.bounds(1, 2**24, also=(-1,))["bounds"]
    assert b.refusal("global_batch_size", -1) is None and b.refusal("global_batch_size", 64) is None
    assert b.refusal("global_batch_size", 0) == ("--global_batch_size must be -1 or positive, got 0; "
                                                 "it takes -1 or 1 to 16777216")
    b = cli.bounds(above=0.0, high=10.0)["bounds"]
    assert b.refusal("lr", 0.0) == "--lr must be positive, got 0.0; it takes above 0 and at most 10"
    assert b.refusal("lr", math.nan) == "--lr must be a finite number, got nan; it takes above 0 and at most 10"
    b = cli.bounds(8, 64, multiple_of=8, why="eight chunks")["bounds"]
    assert b.refusal("seq_len", 100) == ("--seq_len 100 is more than 64; "
                                         "it takes 8 to 64, a multiple of 8 (eight chunks)")
    assert b.refusal("seq_len", 12).startswith("--seq_len must be a multiple of 8, got 12; ")


# --- a loss torchtitan finds non-finite: the documented one line, not its RuntimeError and traceback

def test_torchtitans_non_finite_loss_becomes_the_documented_line():
    """The core's run of the trainer (common/recipe.py's `train`) raises `not_finite`'s line instead of
    torchtitan's RuntimeError, whose text is read here from the installed torchtitan."""
    tt = Path(importlib.util.find_spec("torchtitan").origin).parent
    source = (tt / "trainer.py").read_text()  # the text the trainer reads, as the installed torchtitan raises it
    template = re.search(r'f"Loss is not finite \(global_avg_loss=\{global_avg_loss\}\) at "\s*f"step \{self\.step\}\.'
                         r' Stopping training\."', source)
    assert template, "torchtitan's non-finite loss message changed"
    line = not_finite(RuntimeError("Loss is not finite (global_avg_loss=nan) at step 3. Stopping training."))
    assert isinstance(line, UserError) and str(line).startswith("the loss at step 3 is nan: training diverged"), line
    assert not_finite(RuntimeError("something else")) is None  # any other error passes through untouched
    trainer_source = (Path(__file__).resolve().parents[1] / "common" / "recipe.py").read_text()
    assert "if (line := not_finite(e)) is None:\n            raise\n        raise line from None" in trainer_source
