"""One error type for bad input: the scripts print its message on one line and exit 2, no traceback."""
from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix (a path, a flag, a checkpoint). The message names the problem and the fix."""
