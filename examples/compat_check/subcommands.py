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
    """`rerun_argv` with one parser for every row of a page: building it takes milliseconds, most of a page of
    100,000 rows if built for each."""
    parser = check_parser()
    return lambda run_args: rerun_argv(run_args, parser)


def rerun_argv(run_args: str, parser) -> list[str] | None:
    """A row's run_args as the argv that reruns it (the page's Reproduce command), or None: not reproducible from
    that row. Only printable words that the check's `parser` takes as its flags and their values pass; a stray
    word (a `;`-separated second command), an unknown flag, --help, a value it refuses or an unclosed quote fail."""
    try:
        argv = shlex.split(run_args)
    except ValueError:  # an unclosed quote
        return None
    if not argv or any(not a.isprintable() or a in ("-h", "--help") for a in argv):
        return None

    def refuse(message: str):
        raise UserError(message)

    parser.error = refuse  # a word it refuses: None, nothing printed
    try:
        parser.parse_args(argv)
    except UserError:
        return None
    return argv
