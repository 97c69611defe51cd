"""The subcommands of generate_compat_check.py, its one entry point: `lookup` (lookup.py: search the rows, print a
row's run_py, write the lookup page) and `rankings` (rankings.py: the Hub's most downloaded and trending models per
task, for lookup's Trending and Downloads views).

    python examples/generate_compat_check.py lookup runs/compat --name qwen3 [--task image-text-to-text]
    python examples/generate_compat_check.py lookup runs/compat --name smollm2 --run_py   # print a row's script
    python examples/generate_compat_check.py lookup runs/compat --html runs/compat/page.html  # the lookup page
Where the Hub is reachable (then offline: the lookup and its page read the file):
    python examples/generate_compat_check.py rankings --task text-generation --task image-text-to-text \\
        --limit 100 --out runs/compat/rankings.json
    python examples/generate_compat_check.py lookup runs/compat --rankings runs/compat/rankings.json \\
        [--view downloads] [--html runs/compat/page.html]

What the lookup takes from the check: its curated model list (the page's Selected view, the trn2_selected preset)
and its flag parser, which decides whether a row's run_args rerun it (`rerun_argv`: the page's Reproduce command).
"""
from __future__ import annotations

import re
import shlex
from collections.abc import Callable

from common.errors import UserError
from compat_check import lookup, rankings

NAMES = ("lookup", "rankings")
PROG = "generate_compat_check.py"


def run(name: str, argv: list[str], *, check_parser: Callable, selected: tuple[str, ...]) -> int:
    """Subcommand `name` (one of NAMES) with its arguments; its exit code. `check_parser()`: a new parser of the
    check's own flags; `selected`: the curated list the page shows first."""
    if name == "lookup":
        return lookup.lookup_main(argv, prog=f"{PROG} lookup", selected=selected, rerun=reruns(check_parser))
    if name == "rankings":
        return rankings.rankings_main(argv, prog=f"{PROG} rankings")
    raise ValueError(f"no subcommand {name!r}: {', '.join(NAMES)}")


def reruns(check_parser: Callable) -> Callable:
    """`rerun_argv` with one parser for every row of a page, and each verdict of it kept: building the parser takes
    milliseconds, and parsing takes tens of microseconds, seconds for a page of 100,000 rows that each name their own
    model. Rows whose words differ only in the values of free-text flags (`--models ID`, `--prompt TEXT`: a str
    flag without choices, whatever its value) share one verdict (`_shape`), so a page parses once per distinct set
    of settings; every other word (a flag, a number, a choice, a value starting with '-') is compared as it is."""
    parser = check_parser()
    free = _free_text_flags(parser)
    verdicts: dict[tuple[str, ...], bool] = {}

    def rerun(run_args: str) -> list[str] | None:
        argv = _words(run_args)
        if argv is None:
            return None
        shape = _shape(argv, free, parser.prefix_chars)
        if shape not in verdicts:
            verdicts[shape] = rerun_argv(run_args, parser, argv) is not None
        return argv if verdicts[shape] else None
    return rerun


def _free_text_flags(parser) -> frozenset[str]:
    """The flags of `parser` that store one value as text, unchecked: any word that does not start with a prefix
    character ('-') is taken as their value alike, so it cannot change whether a command line parses."""
    import argparse

    if any(not a.option_strings or a.nargs in (argparse.REMAINDER, argparse.PARSER) for a in parser._actions):
        return frozenset()  # a positional, or a flag taking every word after it: a stray word could be read by it
    return frozenset(s for a in parser._actions if type(a) is argparse._StoreAction and a.nargs is None
                     and a.type in (None, str) and a.choices is None for s in a.option_strings)


FREE = "\0free-text value"  # the word a free-text flag's value stands as in a shape (no argv word holds a NUL)


def _shape(argv: list[str], free: frozenset[str], prefix_chars: str) -> tuple[str, ...]:
    """`argv` with each word that follows a free-text flag (as a word of its own, not `--flag=value`) and does not
    start with a prefix character replaced by FREE. argparse reads such a word the same way whatever it says: as
    that flag's value (kept as text), or, where the flag is itself read otherwise (after `--`), as a stray word,
    refused whatever it says; two argvs of one shape therefore both parse or both fail."""
    return tuple(FREE if i and argv[i - 1] in free and word and word[0] not in prefix_chars else word
                 for i, word in enumerate(argv))


_PLAIN = re.compile(r"[^'\"\\]*")  # no quote, no backslash: shlex splits such text at whitespace alone
_WHITESPACE = re.compile(r"[ \t\r\n]+")  # shlex's whitespace (posix mode)


def _words(run_args: str) -> list[str] | None:
    """run_args split as the shell would (`shlex.split`), or None for an unclosed quote, a word that is not
    printable, or --help. Text without quotes or backslashes is split at shlex's whitespace directly (the same
    words, without shlex's character-by-character reading)."""
    if _PLAIN.fullmatch(run_args):
        argv = [w for w in _WHITESPACE.split(run_args) if w]
    else:
        try:
            argv = shlex.split(run_args)
        except ValueError:  # an unclosed quote
            return None
    if not argv or any(not a.isprintable() or a in ("-h", "--help") for a in argv):
        return None
    return argv


def rerun_argv(run_args: str, parser, argv: list[str] | None = None) -> list[str] | None:
    """A row's run_args as the argv that reruns it (the page's Reproduce command), or None: not reproducible from
    that row. Only printable words that the check's `parser` takes as its flags and their values pass; a stray
    word (a `;`-separated second command), an unknown flag, --help, a value it refuses or an unclosed quote fail.
    `argv`: run_args already split (`_words`)."""
    argv = _words(run_args) if argv is None else argv
    if argv is None:
        return None

    def refuse(message: str):
        raise UserError(message)

    parser.error = refuse  # a word it refuses: None, nothing printed
    try:
        parser.parse_args(argv)
    except UserError:
        return None
    return argv
