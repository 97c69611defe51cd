"""Every training command that the README, docs/ and the examples' docstrings show is parsed with its script's
flags (the guards' among them), so a flag renamed or removed fails here and not on a rented box; and every one
that trains on Trainium over several processes is the scripts' own launch (`--nproc_per_node`): that launch
starts torchrun with 30 minutes for a stop's save and exits 75 on a stop, where a torchrun of the user's kills
its workers 30 s after a signal unless told otherwise, and exits 1 on any stop (tests/test_stop.py runs both).
In-process: parsing takes milliseconds."""
from __future__ import annotations

import ast
import importlib
import re
import shlex
from functools import cache

import pytest

from conftest import ROOT

SCRIPT = re.compile(r"examples/(train_\w+)\.py")
VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")
ASSIGN = re.compile(r"^\s*([A-Z][A-Z0-9_]*)=(.*)$")  # NAME=value, a shell variable set on the page
KNOWN = {"NODE_RANK": "1", "HEAD_NODE": "10.0.0.1", "HOME": "/home/ubuntu"}  # what a reader puts there


def _sources() -> list[tuple[str, str]]:
    """(name, text): the README, every page of docs/, and each training example's docstring (its --help)."""
    out = [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]]
    for p in sorted((ROOT / "examples").glob("train_*.py")):
        out.append((p.relative_to(ROOT).as_posix(), ast.get_docstring(ast.parse(p.read_text()))))
    return out


def _logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined, and a double-quoted value that runs over lines kept whole."""
    out: list[str] = []
    for line in text.replace("\\\n", " ").splitlines():
        if out and out[-1].count('"') % 2:
            out[-1] += " " + line
        else:
            out.append(line)
    return out


def _commands() -> list[tuple[str, str, list[str]]]:
    """(where, script, words) of every documented command that runs a training example, its shell variables
    expanded from the assignments before it on the same page."""
    found = []
    for name, text in _sources():
        shell_vars = dict(KNOWN)
        for line in _logical_lines(text):
            if assigned := ASSIGN.match(line):  # its value unquoted and expanded, as the shell keeps it
                value = VAR.sub(lambda v: _expand(v, shell_vars, name, line), assigned.group(2))
                shell_vars[assigned.group(1)] = " ".join(shlex.split(value, comments=True))
            spans = re.findall(r"`([^`]*)`", line) if "`" in line else [line]
            for span in spans:
                if not SCRIPT.search(span):
                    continue
                if assigned := ASSIGN.match(span):  # RUN="python examples/...": the command is the value
                    span = shell_vars[assigned.group(1)]
                span = VAR.sub(lambda v: _expand(v, shell_vars, name, span), span)
                script = SCRIPT.search(span)
                if not re.search(r"\b(python|torchrun)\b", span[:script.start()]):
                    continue  # the script named in prose
                words = [w for w in shlex.split(span, comments=True) if w != "..."]
                for stop in ("&", "&&", ";", "|"):
                    words = words[:words.index(stop)] if stop in words else words
                found.append((name, script.group(1), words))
    return found


def _expand(var: re.Match, shell_vars: dict, where: str, span: str) -> str:
    key = var.group(1) or var.group(2)
    assert key in shell_vars, f"{where}: ${key} in {span!r} is set nowhere before it (add it to KNOWN if a reader sets it)"
    return shell_vars[key]


COMMANDS = _commands()


@cache
def _recipe(script: str):
    return importlib.import_module(script).RECIPE


def _parse(script: str, argv: list[str]):
    from common.harness.lifecycle import parse

    return parse(_recipe(script), argv)


def test_the_documents_show_training_commands_on_every_page_that_runs_one():
    """The collection itself: each training example and each page that shows a trn2 run are covered."""
    where = {w for w, _, _ in COMMANDS}
    assert {"README.md", "docs/first-hour-trn2.md", "docs/resuming.md", "examples/train_native_qwen3.py",
            "examples/train_hf_backend.py", "examples/train_moe_nki.py"} <= where, sorted(where)
    assert {s for _, s, _ in COMMANDS} == {p.stem for p in (ROOT / "examples").glob("train_*.py")}
    assert len(COMMANDS) >= 40, len(COMMANDS)


@pytest.mark.parametrize("where,script,words", COMMANDS,
                         ids=[f"{w}:{' '.join(c)[:60]}" for w, _, c in COMMANDS])
def test_a_documented_training_command_parses_and_stops_with_exit_75_on_trainium(where, script, words):
    at = next(i for i, w in enumerate(words) if SCRIPT.search(w))
    launcher, argv = words[:at], words[at + 1:]
    try:
        cfg = _parse(script, argv)
    except SystemExit as e:  # argparse: an unknown flag or a bad value
        pytest.fail(f"{where}: {' '.join(words)!r} does not parse (exit {e.code})")
    assert launcher[0] in ("python", "torchrun"), (where, words)
    if cfg.device == "neuron" and (launcher[0] == "torchrun" or cfg.guards.nproc_per_node > 1):
        assert launcher == ["python"] and cfg.guards.nproc_per_node > 1, \
            f"{where}: {' '.join(words)!r} runs Trainium ranks under a torchrun of its own: show the scripts' launch"
