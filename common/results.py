"""What every script writes with: results.json, the version stamps, atomic writes. A training run's loss
curve and its closing results are in common/losses.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import json
import os
import platform
import re
import shlex
import shutil
import socket
import stat
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path

from common.errors import UserError, one_line


def installed_version(dist: str) -> str | None:
    """The installed version of a distribution, None where it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """The version stack a result was produced with (torch, torchtitan and transformers always named)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    # nki and nki-library: AWS's pip names (aws-neuron-sdk@81ce03a:nki/get-started/setup-env.rst:126,
    # nki/library/quickstart-nkl.rst:76); the nodes of one run compare these too (launcher.check_same_stack)
    for name in ("torch", "torchtitan", "transformers", "safetensors", "datasets", "torch-neuronx", "neuronx-cc", "nki",
                 "nki-library"):
        version = installed_version(name)
        if version is not None or name in ("torch", "torchtitan", "transformers"):
            out[name.replace("-", "_")] = version
    return out


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """A temp file beside `path` to write into; when the block ends without error it is synced to disk and renamed
    onto `path` (readers see the old file or the new one, never half of one), else removed. Every writer uses it."""
    path = Path(path)
    refuse_non_file(path, fix="move it")  # a folder or FIFO of that name: never replaced, no traceback at the end
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask's mode, as open() gives
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def replace_dir(tmp: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Move the finished folder `tmp` onto `dest` beside it. A folder cannot be renamed over a non-empty one, so the
    old `dest` is renamed aside first and removed last: a kill leaves the old folder or the new one (or, between the
    two renames, the old one under a hidden name), never a mix of the two. A `dest` that is a symlink is replaced
    itself, never what it points to: the link is renamed aside and unlinked. The aside name is new each time, so
    nothing left by an earlier run (a folder, a link) can block the renames; such leftovers are removed first."""
    tmp, dest = Path(tmp), Path(dest)
    aside = re.compile(rf"\.{re.escape(dest.name)}\.old(\.[0-9a-f]{{12}})?\.tmp")  # the names used here, no other
    for stale in dest.parent.glob(f".{glob.escape(dest.name)}.old*.tmp"):  # an earlier run's, cut short
        if aside.fullmatch(stale.name):
            remove(stale, quiet=True)
    old = dest.with_name(f".{dest.name}.old.{uuid.uuid4().hex[:12]}.tmp")
    moved = os.path.lexists(dest)  # a dangling symlink too: a folder cannot be renamed onto it
    if moved:
        os.replace(dest, old)  # rename(2) moves a symlink itself
    try:
        os.replace(tmp, dest)
    except OSError:
        if moved:
            os.replace(old, dest)  # the old folder (or link) back in its place
        raise
    remove(old, quiet=True)


def remove(path: str | os.PathLike, quiet: bool = False) -> None:
    """Remove what is at `path`, the one way every run deletes a file or folder it owns: a symlink (to a folder
    or not) or a file is unlinked, never what a link points to; a folder is removed with its contents; nothing
    there is fine. `quiet`: leave what cannot be removed (a leftover that blocks nothing)."""
    path = Path(path)
    try:
        if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
            path.unlink(missing_ok=True)
        elif path.is_dir():
            shutil.rmtree(path)
    except OSError:
        if not quiet:
            raise


def not_a_file(path: str | os.PathLike) -> str | None:
    """What is at `path` when it is there and is not a regular file (symlinks followed): "a folder", "a FIFO",
    "a socket", "a device"; None for a regular file, a link to one, or nothing (a dangling link included)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:  # a link loop, a folder it may not look into
        return f"not readable ({e.strerror or e})"
    if stat.S_ISREG(mode):
        return None
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "a special file")


def refuse_non_file(path: str | os.PathLike, what: str = "a file this run writes",
                    fix: str = "move it or choose another --out_dir") -> None:
    """A UserError when `path` is there and is not a regular file: a folder, FIFO, socket or device of that name
    is never opened (a FIFO would block), replaced or deleted."""
    kind = not_a_file(path)
    if kind is not None:
        raise UserError(f"{path} is {kind}, not {what}: it is left alone; {fix}")


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


# --------------------------------------------------------------------------- the out_dir's lock
LOCK = ".run.lock"  # in OUT_DIR: flock'd for the whole run by one process of it; holds who holds it
HELD_LOCKS: list[int] = []  # this process's lock descriptors, open until it exits
# What a lock file of these scripts holds: the line hold_out_dir writes (or nothing, when a run ended before it wrote).
_LOCK_LINE = re.compile(rb"(pid [0-9]+ on [^\n]* since [^\n]*\n?)?")
_LOCK_MAX = 1 << 20  # bytes: a lock line is one command line long


def hold_lock(out_dir: Path) -> None:
    """An exclusive lock on OUT_DIR for the whole run, released by the OS however the holder ends; a second run
    into the same folder (a run with the guards or of the core alone: both take this lock) refuses in one line
    naming the holder.

    The lock file is created anew (O_EXCL) or is the one a run of these scripts left: a regular file of one name
    holding nothing or a lock line. Anything else of that name (a link, followed never: O_NOFOLLOW; a folder, a
    FIFO, a file holding other text, such as a hard link of a user's file) is a UserError naming it, left as it is.
    One implementation for both (not filelock, the kept library: its lock file holds nothing, and a refusal here
    names the run that holds the folder, from the line this writes in it)."""
    path = Path(out_dir) / LOCK
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that has not said which"
        os.close(fd)
        raise UserError(f"--out_dir {out_dir} is in use by another run ({one_line(holder)}){_holder_gone(holder)}: "
                        "wait for it to end, or choose another --out_dir") from None
    try:
        _check_own_lock(fd, path)  # read under the lock: no other run is writing it now
    except UserError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: "
                  f"{shlex.join([Path(sys.executable).name, *sys.argv])}\n".encode(), 0)
    HELD_LOCKS.append(fd)


def _holder_gone(holder: str) -> str:
    """What to add when the lock line names a process of this host that has ended: the processes it started (a
    self-launch's torchrun and workers inherit the lock) still hold the folder, as while a stop's save finishes."""
    match = re.match(r"pid ([0-9]+) on (\S+) since", holder)
    if not match or match[2] != socket.gethostname():
        return ""
    try:
        os.kill(int(match[1]), 0)
    except ProcessLookupError:
        return (f"; pid {match[1]} has ended, but the processes it started (its torchrun and workers) still hold "
                "the folder, saving or ending")
    except (PermissionError, OverflowError):
        pass
    return ""


def _refuse_lock(path: Path, what: str) -> UserError:
    return UserError(f"{path} {what}: it is left alone; move it or choose another --out_dir")


def _open_lock(path: Path) -> int:
    """A descriptor of the lock file: created here, or the existing regular file, never through a link, never
    blocking (a FIFO)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(3):  # created and removed by another run meanwhile: look again
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        if path.is_symlink():
            raise _refuse_lock(path, "is a symbolic link, not a lock file of these scripts (a lock never follows a link)")
        kind = not_a_file(path)
        if kind is not None:
            raise _refuse_lock(path, f"is {kind}, not a lock file of these scripts")
        try:
            return os.open(path, flags)
        except FileNotFoundError:
            continue
        except OSError as e:  # ELOOP: a link put there since the look; EACCES, EISDIR...
            raise _refuse_lock(path, f"cannot be opened as a lock file ({one_line(e.strerror or str(e))})") from None
    raise _refuse_lock(path, "keeps appearing and disappearing: another program is making and removing it")


def _check_own_lock(fd: int, path: Path) -> None:
    """The file open at `fd` is one this run may truncate: a regular file holding a lock line or nothing (a copy
    of an out_dir made with hard links shares the lock file a run made: taken too)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _refuse_lock(path, "is not a regular file, not a lock file of these scripts")
    if st.st_size > _LOCK_MAX or not _LOCK_LINE.fullmatch(os.pread(fd, _LOCK_MAX, 0)):
        raise _refuse_lock(path, "is not a lock file of these scripts (it holds other text)")
