"""What every script writes with: results.json, the version stamps, atomic writes. A training run's loss
curve and its closing results are in common/losses.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import shutil
import uuid
from importlib import metadata
from pathlib import Path


def versions() -> dict[str, str | None]:
    """The version stack a result was produced with."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "torchtitan", "transformers", "safetensors", "datasets",
                 "torch-neuronx", "neuronx-cc"):
        try:
            out[name.replace("-", "_")] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name in ("torch", "torchtitan", "transformers"):
                out[name] = None
    return out


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """A temp file beside `path` to write into; when the block ends without error it is synced to disk and renamed
    onto `path` (readers see the old file or the new one, never half of one), else removed. Every writer uses it."""
    path = Path(path)
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
    """Move the finished folder `tmp` onto `dest` beside it. A folder cannot be renamed over a non-empty
    one, so the old `dest` is renamed aside first and removed last: a kill leaves the old folder or the
    new one (or, between the two renames, the old one under a hidden name), never a mix of the two."""
    tmp, dest = Path(tmp), Path(dest)
    old = dest.with_name(f".{dest.name}.old.tmp")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    try:
        os.replace(tmp, dest)
    except OSError:
        if old.exists():
            os.replace(old, dest)  # the old folder back in its place
        raise
    shutil.rmtree(old, ignore_errors=True)


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
