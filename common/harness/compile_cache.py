"""A compile cache shared across hosts: each new trn2 host starts with an empty NEFF cache, and step 1 compiles for
minutes; a host that pulls the graphs an earlier host compiled (with the same compiler) starts warm.

The shared store holds one folder per key, `<url>/<key>/`, with the local cache's entries under it at their relative
paths. The key (`cache_key`) names what makes a compiled graph reusable: on Trainium the neuronx-cc and torch-neuronx
versions, elsewhere torch's (inductor is part of torch), Python's, and on CUDA triton's and CUDA's. A host pulls and
pushes its own key's folder only, so graphs of another compiler are neither pulled nor mixed in.

The URL: a plain folder (shared storage mounted on every host: FSx for Lustre, EFS, NFS), a `file://` URL, or any
fsspec URL (`s3://bucket/prefix` with the s3fs package installed). The store's root must exist; `<url>/<key>/` is
made by the first push.

The API a training run calls (common/harness/lifecycle.py wires it; results.json `compile_cache_shared`):

    from common.harness import compile_cache
    shared = compile_cache.for_run(url, dev.device_type, compiled=tc.compile.enable)  # None: no URL, nothing compiled
    # after common.device.setup() (it sets TORCH_NEURONX_NEFF_CACHE_DIR), before the model is built and step 1:
    if shared and local_rank == 0: shared.pull()      # one process per node; the node's other ranks wait (barrier)
    # after the first steps have compiled their graphs (step 2: the optimizer's first update compiles too):
    if shared and local_rank == 0: shared.push()      # one process per node; pushes from several nodes may overlap
    results["compile_cache_shared"] = shared.summary() if shared else None

    compile_cache.cache_key(device_type) -> str  # Neuron 2.33.0: "neuron_neuronx-cc-2.28.7631.0_torch-neuronx-2.14.3.0"
    compile_cache.local_folder(device_type, compiled) -> str | None   # compile_cache_folder's folder
    SharedCache(url, key, local_dir, kind="neff" | "inductor").pull() -> int, .push() -> int, .summary() -> dict

pull() and push() return the entries copied. Failures talking to the store (no such folder, no permission, no network,
an unknown URL scheme, a backend not installed) are one UserError naming the URL; a failure writing the local folder
names that folder.

What an entry is. The local folder's regular files, by their paths relative to it; never hidden files (a name
starting with '.': inductor's and this module's temporary files), lock files (`*.lock`, inductor's `locks/`
folder), `*.tmp` files or symbolic links. In inductor's cache each file is an entry. In the NEFF cache an entry is a
whole per-graph folder, the folder holding a `.neff` file, with every file under it: it travels as one, its `.neff`
last, so a reader that finds the `.neff` finds the rest of the folder; a folder without its `.neff` (a graph still
compiling, a compile that failed, a copy cut short) is no entry and is not copied. (AWS documents the NEFF cache's
folders as one per graph: `neuronxcc-<version>/MODULE_<hash>/model.neff`, aws-neuron-sdk@81ce03a
about-neuron/arch/neuron-features/neuron-caching.rst:77.) An entry the destination has is skipped, never written
again.

Every file is written under a unique temporary name beside its final name (`.<name>.<random>.tmp`), then renamed
onto it (os.replace locally; the store's move, a rename on a shared file system): no reader sees a half-written file
under its final name, and two pushers at once (two nodes) leave whole files whichever renames last.
"""
from __future__ import annotations

import io
import os
import posixpath
import re
import shutil
import stat
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from common.errors import UserError, one_line
from common.results import atomic_path, installed_version

KINDS = ("neff", "inductor")  # compile_cache_folder's kinds: TorchNeuron's NEFF cache, inductor's cache
KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
CHUNK = 1 << 20  # bytes a copy reads and writes at a time

# What a key is made of, per device: the parts a compiled graph needs the same to be reused, each a distribution's
# version. Trainium: a NEFF is reused only by the neuronx-cc that compiled it: "The cache uses hash of the Neuron
# compiler flags and XLA graph as the key. If the Neuron compiler version or XLA graph changes, you will see
# recompilation" (aws-neuron-sdk@81ce03a about-neuron/arch/neuron-features/neuron-caching.rst:81-83; each compiler
# version has its own folder, line 77; TorchNeuron's page of the same name in the 2.34 docs:
# https://awsdocs-neuron.readthedocs-hosted.com/en/v2.34.0/about-neuron/arch/neuron-features/neuron-caching.html);
# torch-neuronx lowers the graphs neuronx-cc compiles. Elsewhere inductor (in torch) generates the code: Python
# modules and C++ extensions built for this Python; on CUDA, Triton kernels built for this CUDA. Triton's version is
# left out on CPU, where inductor generates C++ and no Triton code.
REQUIRED = {"neuron": ("neuronx-cc", "torch-neuronx"), "cpu": ("torch", "python"),
            "cuda": ("torch", "python", "cuda")}
OPTIONAL = {"cuda": ("triton",)}  # in the key where installed


def _clean(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]", "-", text)


def key_from_versions(device_type: str, versions: dict) -> str | None:
    """The key of a stack given as {part: version} (the parts of REQUIRED and OPTIONAL: distribution names, "python"
    as major.minor, "cuda" as torch.version.cuda), or None where a required part is missing (a results row that did
    not record it). Only [A-Za-z0-9._-]: a safe folder or object name."""
    if device_type not in REQUIRED:
        return None
    parts = []
    for name in REQUIRED[device_type] + OPTIONAL.get(device_type, ()):
        version = versions.get(name)
        if not version or not isinstance(version, str):
            if name in REQUIRED[device_type]:
                return None
            continue
        if name == "python":
            version = ".".join(version.split(".")[:2])
        parts.append(f"{name}-{_clean(version)}")
    return "_".join([device_type, *parts])[:200]


def stack_versions(device_type: str) -> dict:
    """This host's versions of what its key is made of (None where not installed)."""
    if device_type == "neuron":
        return {name: installed_version(name) for name in REQUIRED["neuron"]}
    out = {"torch": installed_version("torch"), "python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    if device_type == "cuda":
        import torch

        out.update(triton=installed_version("triton"), cuda=torch.version.cuda)
    return out


def cache_key(device_type: str) -> str:
    """This host's key for `device_type` ("neuron", "cuda", "cpu"): cpu_torch-2.14.1-cu130_python-3.12, say."""
    if device_type not in REQUIRED:
        raise UserError(f"no compile cache key for device {one_line(str(device_type))!r}: one of "
                        f"{', '.join(REQUIRED)}")
    versions = stack_versions(device_type)
    key = key_from_versions(device_type, versions)
    if key is None:
        missing = [n for n in REQUIRED[device_type] if not versions.get(n)]
        raise UserError(f"no compile cache key for {device_type}: {', '.join(missing)} not installed here")
    return key


def local_folder(device_type: str, compiled: bool) -> str | None:
    """The folder this run's compiled graphs go to (compile_cache_folder: on Trainium the NEFF cache,
    TORCH_NEURONX_NEFF_CACHE_DIR, which common.device.setup sets; elsewhere inductor's), or None where nothing is
    compiled (CPU or CUDA without torch.compile)."""
    where = compile_cache_folder(device_type, compiled)
    return None if where is None else where["dir"]


def for_run(url: str | None, device_type: str, compiled: bool) -> SharedCache | None:
    """The shared cache of a training run: None where no URL is given or nothing is compiled."""
    if not url:
        return None
    where = compile_cache_folder(device_type, compiled)
    if where is None:
        return None
    return SharedCache(url, cache_key(device_type), where["dir"], kind=where["kind"])


def compile_cache_folder(device_type: str, compiled: bool) -> dict | None:
    """{"kind", "dir", "dir_from"} of the cache this run's compiled graphs go to, or None where nothing is compiled.
    Neuron compiles every graph with neuronx-cc, eager mode too, into TorchNeuron's NEFF cache:
    TORCH_NEURONX_NEFF_CACHE_DIR, which common.device.setup sets for every Neuron run (the run's --neff_cache_dir;
    unset, TorchNeuron writes /tmp/neff_cache). Elsewhere only torch.compile compiles (`compiled`: the
    Trainer.Config's compile.enable), into inductor's cache (TORCHINDUCTOR_CACHE_DIR, by default a folder in the
    temp dir)."""
    if device_type == "neuron":
        folder = os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR")
        return {"kind": "neff", "dir": folder or "/tmp/neff_cache",
                "dir_from": "TORCH_NEURONX_NEFF_CACHE_DIR" if folder else "TorchNeuron's default"}
    if not compiled:
        return None
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir  # private in torch 2.14

    folder = cache_dir()  # inductor's first call sets TORCHINDUCTOR_CACHE_DIR to its default: compared, not read
    return {"kind": "inductor", "dir": folder,
            "dir_from": "the default" if folder == default_cache_dir() else "TORCHINDUCTOR_CACHE_DIR"}


def count_entries(folder, suffix: str = "") -> int:
    """The entries under `folder` (`local_files`: what a push copies, not a lock or a temporary file) whose names end
    with `suffix`, at any depth (0 where there is no such folder): a compile adds at least one (a NEFF cache: one
    .neff per compiled graph); a compile served from the cache adds none."""
    return sum(1 for rel in local_files(folder) if rel.endswith(suffix))


class CompileCacheWatch:
    """Counts the compile cache's entries before step 1 (`start`) and when step 1 has ended (`first_step`, a
    when step 1 has ended): new entries mean step 1 compiled, a cold cache; none, a warm one. `result()` is
    timing.compile_cache: {"kind", "dir", "entries_before", "entries_after", "state"}, the state "cold", "warm",
    or "none" where nothing is compiled (CPU or CUDA without torch.compile: eager mode) or nothing compiled is kept on
    disk (a torch.compile `backend` other than inductor, such as aot_eager: it generates no code)."""

    def __init__(self, where: dict | None, device_type: str, backend: str | None = None):
        self.where, self.device_type, self.backend = where, device_type, backend
        self.suffix = ".neff" if where is not None and where["kind"] == "neff" else ""  # NEFFs, not their locks
        self.before = self.after = None

    def start(self) -> None:
        if self.where is not None:
            self.before = count_entries(self.where["dir"], self.suffix)

    def first_step(self) -> None:
        if self.where is not None and self.after is None:
            self.after = count_entries(self.where["dir"], self.suffix)

    def result(self) -> dict:
        if self.where is None:
            return {"kind": None, "dir": None, "entries_before": None, "entries_after": None, "state": "none",
                    "note": f"eager mode on {self.device_type}: nothing compiled (torch.compile is off)"}
        if self.where["kind"] == "inductor" and self.backend not in (None, "inductor"):
            return {**self.where, "entries_before": self.before, "entries_after": self.after, "state": "none",
                    "note": f"torch.compile's {self.backend} backend keeps nothing on disk (inductor's cache holds "
                            "what inductor generates)"}
        state = ("unknown" if self.before is None or self.after is None
                 else "cold" if self.after > self.before else "warm")
        return {**self.where, "entries_before": self.before, "entries_after": self.after, "state": state}


def shown_url(url: str) -> str:
    """`url` as it may be printed and written into results.json: one printable line, without a user name or
    password it may carry (scheme://user:secret@host/...)."""
    try:
        parts = urlsplit(url)
        if parts.netloc and "@" in parts.netloc:
            url = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
    except ValueError:  # not a URL urllib can split (a bracket in a plain path): shown as it is
        pass
    return one_line(url)


def _skipped_name(name: str) -> bool:
    """A file or folder name that is never an entry: hidden (temporary files), a lock, a temporary file."""
    return name.startswith(".") or name.endswith((".lock", ".tmp")) or name == "locks"


def _safe(rel: str) -> bool:
    """A relative path that stays inside the folder it is joined to, printable, with no part that is skipped."""
    parts = rel.split("/")
    return bool(rel) and rel.isprintable() and not rel.startswith("/") and \
        all(p not in ("", ".", "..") and not _skipped_name(p) for p in parts)


def entries(files, kind: str) -> dict[str, tuple[list[str], list[str]]]:
    """{entry: (its files, its markers)} from relative file paths: inductor's cache, one entry a file (its own
    marker); the NEFF cache, one entry per folder holding a .neff file (its files: all under that folder; its
    markers: its .neff files), and a .neff file at the top as an entry of its own. Files of no entry are left out."""
    files = sorted(set(files))
    if kind == "inductor":
        return {f: ([f], [f]) for f in files}
    graph_dirs = {posixpath.dirname(f) for f in files if f.endswith(".neff")} - {""}
    out: dict[str, tuple[list[str], list[str]]] = {}
    for f in files:
        folder = posixpath.dirname(f)
        while folder and folder not in graph_dirs:
            folder = posixpath.dirname(folder)
        if folder:
            group = out.setdefault(folder + "/", ([], []))
        elif f.endswith(".neff"):
            group = out.setdefault(f, ([], []))
        else:
            continue
        group[0].append(f)
        if f.endswith(".neff") and posixpath.dirname(f) == folder:
            group[1].append(f)
    return out


def local_files(folder: str | os.PathLike) -> list[str]:
    """The relative paths (with '/') of the regular files under `folder` that can be entries; none where it is
    not there. Links are not followed."""
    root = Path(folder)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _skipped_name(d) and not os.path.islink(os.path.join(dirpath, d))]
        for name in filenames:
            if _skipped_name(name):
                continue
            path = os.path.join(dirpath, name)
            try:
                if not stat.S_ISREG(os.lstat(path).st_mode):
                    continue
            except OSError:  # removed meanwhile
                continue
            found.append(Path(path).relative_to(root).as_posix())
    return found


def _sync(f) -> None:
    """Flush and fsync a file written through fsspec where it is a local file (a store's own file objects have no
    file descriptor: their close commits them)."""
    try:
        f.flush()
        os.fsync(f.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass


class SharedCache:
    """The entries of one key in a shared store, `<url>/<key>/`, and the local folder a run compiles into. `kind`:
    "neff" (TorchNeuron's NEFF cache: per-graph folders) or "inductor" (one file an entry)."""

    def __init__(self, url: str, key: str, local_dir: str | os.PathLike, kind: str = "inductor"):
        if not isinstance(url, str) or not url.strip():
            raise UserError("the shared compile cache needs a URL: a folder on shared storage, file://..., or "
                            "s3://bucket/prefix")
        if not KEY_RE.fullmatch(key or ""):
            raise UserError(f"compile cache key {one_line(str(key))!r} is not a plain name ([A-Za-z0-9._-], at most "
                            "200 characters): use cache_key()")
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r}: one of {KINDS}")
        self.url, self.key, self.local_dir, self.kind = url, key, Path(local_dir), kind
        self.pulled = self.pushed = self.pulled_bytes = self.pushed_bytes = None
        self.pull_s = self.push_s = None
        self.unsafe = 0  # store names leading out of the local folder ('..') or not printable: never copied
        self._fs = self._root = None

    # ------------------------------------------------------------------ the store
    def _fail(self, what: str, e: BaseException) -> UserError:
        detail = one_line(f"{type(e).__name__}: {e}")[:300]
        return UserError(f"shared compile cache {shown_url(self.url)}: cannot {one_line(what)} ({detail}); check "
                         "that the URL is right, that this host reaches it and may read and write there (a plain "
                         "path: a shared folder mounted on every host, such as FSx or EFS; s3://: the s3fs package "
                         "and AWS credentials)")

    def _store(self):
        """(fsspec file system, this key's folder in it), connected once. A local store's root must be a folder."""
        if self._fs is None:
            try:
                import fsspec

                url = self.url  # a file URL's %-escapes are its folder's characters (Path.as_uri writes " " as %20)
                if url.startswith("file://"):
                    url = "file://" + unquote(url.removeprefix("file://"))
                fs, root = fsspec.core.url_to_fs(url)
                local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
                if local and not fs.isdir(root):
                    kind = "a file, not a folder" if fs.exists(root) else "no such folder"
                    raise UserError(f"shared compile cache {shown_url(self.url)}: {kind}; create the folder (mkdir "
                                    "-p) or mount the shared file system there")
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001  each fsspec backend raises its own types
                raise self._fail("open it", e) from None
            base = posixpath.join(root.rstrip("/"), self.key) if root.rstrip("/") else self.key
            if local:  # one folder inside the other: a push would copy the store into itself, or the cache onto itself
                mine, shared = os.path.realpath(self.local_dir), os.path.realpath(base)
                if mine == shared or mine.startswith(shared + os.sep) or shared.startswith(mine + os.sep):
                    raise UserError(f"the local compile cache {one_line(str(self.local_dir))} and the shared store "
                                    f"{shown_url(self.url)} overlap: give the run a folder of its own on this host")
            self._fs, self._root = fs, base
        return self._fs, self._root

    def reachable(self) -> None:
        """The store opened (and a local one found a folder), or one UserError naming it: before a launch."""
        self._store()

    def _store_files(self) -> tuple[dict[str, int], int]:
        """({relative path: size} of this key's files in the store that can be entries, names refused as unsafe)."""
        fs, base = self._store()
        try:
            found = fs.find(base, withdirs=False, detail=True)
        except FileNotFoundError:
            return {}, 0
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"list {self.key}/", e) from None
        files, unsafe = {}, 0
        for path, info in found.items():
            path = path.rstrip("/")
            if not path.startswith(base.rstrip("/") + "/") or info.get("islink"):
                continue
            rel = path[len(base.rstrip("/")) + 1:]
            if _safe(rel):
                files[rel] = int(info.get("size") or 0)
            elif not any(_skipped_name(p) for p in rel.split("/")):  # '..', an empty part, a control character
                unsafe += 1
        return files, unsafe

    # ------------------------------------------------------------------ pull
    def pull(self) -> int:
        """Copy the entries of this key that the local folder lacks into it, each file atomically (a temporary name
        in the same folder, then os.replace), an entry's markers last. Returns the entries copied."""
        start = time.perf_counter()
        stored, self.unsafe = self._store_files()
        have = set(local_files(self.local_dir))
        fs, base = self._store()
        copied = copied_bytes = 0
        for _, (files, markers) in sorted(entries(stored, self.kind).items()):
            if all(m in have for m in markers):
                continue
            for rel in [f for f in files if f not in markers] + markers:
                copied_bytes += self._get(fs, f"{base}/{rel}", self.local_dir / rel)
            copied += 1
        self.pulled, self.pulled_bytes, self.pull_s = copied, copied_bytes, time.perf_counter() - start
        return copied

    def _get(self, fs, src: str, dest: Path) -> int:
        """One file of the store into the local folder: written under a temporary name beside `dest`, synced and
        renamed onto it (common.results.atomic_path). Its size."""
        try:
            fin = fs.open(src, "rb")
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"read {src}", e) from None
        size = 0
        try:
            with fin, atomic_path(dest) as tmp, open(tmp, "wb") as fout:
                while True:
                    try:
                        chunk = fin.read(CHUNK)
                    except Exception as e:  # noqa: BLE001
                        raise self._fail(f"read {src}", e) from None
                    if not chunk:
                        break
                    fout.write(chunk)
                    size += len(chunk)
        except UserError:
            raise
        except OSError as e:
            raise UserError(f"cannot write the local compile cache {one_line(str(self.local_dir))} "
                            f"({one_line(e.strerror or str(e))}: {one_line(str(e.filename or dest))}): free space, "
                            "or give it a folder this process may write") from None
        return size

    # ------------------------------------------------------------------ push
    def push(self) -> int:
        """Copy the local entries the store lacks into `<url>/<key>/`, each file to a unique temporary name beside
        its final name and then moved onto it, an entry's markers last; an entry the store has is skipped. Returns
        the entries copied (added to `pushed`, the counts of every push of this object)."""
        start = time.perf_counter()
        stored, self.unsafe = self._store_files()
        fs, base = self._store()
        copied = copied_bytes = 0
        for _, (files, markers) in sorted(entries(local_files(self.local_dir), self.kind).items()):
            if all(m in stored for m in markers):
                continue
            try:
                sizes = [self._put(fs, self.local_dir / rel, f"{base}/{rel}")
                         for rel in [f for f in files if f not in markers] + markers]
            except FileNotFoundError as e:
                if e.filename is not None and str(e.filename).startswith(str(self.local_dir)):
                    continue  # removed from the local cache meanwhile (inductor prunes it): not an entry now
                raise
            copied += 1
            copied_bytes += sum(sizes)
        # a run pushes more than once (after its first steps, at its end): the counts are the run's
        self.pushed = (self.pushed or 0) + copied
        self.pushed_bytes = (self.pushed_bytes or 0) + copied_bytes
        self.push_s = (self.push_s or 0.0) + time.perf_counter() - start
        return copied

    def _put(self, fs, src: Path, dest: str) -> int:
        """One local file into the store: written to a unique temporary name beside `dest`, then moved onto it (a
        rename on a shared file system; an object store's copy, whose object appears whole). Its size."""
        parent, name = posixpath.split(dest)
        tmp = f"{parent}/.{name}.{uuid.uuid4().hex[:12]}.tmp"
        fin = open(src, "rb")  # FileNotFoundError: the caller skips the entry
        try:
            with fin:
                fs.makedirs(parent, exist_ok=True)
                with fs.open(tmp, "wb") as fout:
                    shutil.copyfileobj(fin, fout, CHUNK)
                    _sync(fout)
                fs.mv(tmp, dest)
            return src.stat().st_size
        except Exception as e:  # noqa: BLE001
            try:
                fs.rm_file(tmp)
            except Exception:  # noqa: BLE001  not written, or moved already
                pass
            raise self._fail(f"write {dest}", e) from None

    # ------------------------------------------------------------------ results.json
    def summary(self) -> dict:
        """results.json's `compile_cache_shared`: {"url", "key", "kind", "dir", "pulled", "pushed", "pulled_bytes",
        "pushed_bytes", "pull_s", "push_s", "unsafe_names"}; a count is null where that step did not run."""
        return {"url": shown_url(self.url), "key": self.key, "kind": self.kind, "dir": str(self.local_dir),
                "pulled": self.pulled, "pushed": self.pushed, "pulled_bytes": self.pulled_bytes,
                "pushed_bytes": self.pushed_bytes, "pull_s": self.pull_s, "push_s": self.push_s,
                "unsafe_names": self.unsafe}
