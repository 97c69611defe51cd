"""Bad input, shown the same way everywhere: one `error:` line on stderr and exit code 2, no traceback."""
from __future__ import annotations

import argparse


class UserError(Exception):
    """A problem the user can fix (a path, a flag, a checkpoint). The message names the problem and the fix."""


class AgreedError(UserError):
    """A UserError every rank raises at the same point of a run, from a decision they agreed on in a collective (no
    rank is left waiting in one): each can end as if training had ended."""


def one_line(text: str, keep: str = "") -> str:
    """`text` as one printable line: newlines, CR, ESC and other control characters (from a path, a model id, a
    file's cell) become U+FFFD, so they cannot split an `error:` line, hide text or recolour the terminal. `keep`:
    control characters left as they are (tabs and newlines of a file shown whole)."""
    if text.isprintable():  # nothing to replace (most text): as it is
        return text
    return "".join(ch if ch.isprintable() or ch in keep else "\N{REPLACEMENT CHARACTER}" for ch in text)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that refuses shortened flags (`--step` is not a guess at `--steps`) and reports a bad
    command line as one `error:` line instead of the usage block."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {one_line(message)} (see --help)\n")
