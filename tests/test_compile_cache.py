"""The compile cache shared across hosts (common/harness/compile_cache.py) and its command line
(tools/compile_cache.py): two local caches through a shared folder, a file:// URL and an in-memory fsspec store; keys
kept apart; two pushers at once in two processes; a store it cannot reach or write as one error. In-process, no
training run: seconds."""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from common.errors import UserError
from common.harness import compile_cache
from common.harness.compile_cache import SharedCache
from common.results import installed_version
from conftest import ROOT
from tools import compile_cache as tool


def write(folder: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)


def read_all(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


INDUCTOR = {"fxgraph/ab/cd": b"graph", "xy/cxyz.py": b"code", "xy/cxyz.so": b"\x7fELF" * 100}
NOT_ENTRIES = {"locks/cxyz.lock": b"", "xy/.1234.5678.tmp": b"half", "xy/k.lock": b"", ".hidden/x": b"no"}


@pytest.mark.parametrize("form", ["folder", "file_url", "memory"])
def test_round_trip_between_two_hosts(tmp_path, form):
    store = tmp_path / "shared store"  # a space: Path.as_uri writes it %20, the folder's name is read back
    store.mkdir()
    url = {"folder": str(store), "file_url": store.as_uri(), "memory": f"memory://cc-{tmp_path.name}"}[form]
    first, second = tmp_path / "first", tmp_path / "second"
    write(first, INDUCTOR | NOT_ENTRIES)
    pusher = SharedCache(url, "cpu_torch-9.9_python-3.11", first)
    assert pusher.push() == 3 and pusher.push() == 0  # an entry the store has is skipped
    if form != "memory":
        assert read_all(store / "cpu_torch-9.9_python-3.11") == INDUCTOR  # no lock, temporary or hidden file
    puller = SharedCache(url, "cpu_torch-9.9_python-3.11", second)
    assert puller.pull() == 3 and read_all(second) == INDUCTOR and puller.pull() == 0
    (second / "fxgraph" / "new").write_bytes(b"compiled on the second host")
    assert SharedCache(url, "cpu_torch-9.9_python-3.11", second).push() == 1
    assert SharedCache(url, "cpu_torch-9.9_python-3.11", first).pull() == 1
    assert (first / "fxgraph" / "new").read_bytes() == b"compiled on the second host"
    assert not [p for p in first.rglob("*") if p.name.endswith(".tmp") and p.name != ".1234.5678.tmp"]
    summary = pusher.summary()  # a run pushes twice (after its first steps, at its end): the counts are the run's
    assert summary["url"] == url and summary["key"] == "cpu_torch-9.9_python-3.11" and summary["pushed"] == 3
    assert puller.summary()["pulled"] == 0 and puller.summary()["pushed"] is None


def test_neff_entries_are_whole_per_graph_folders(tmp_path):
    store, first, second = tmp_path / "store", tmp_path / "first", tmp_path / "second"
    store.mkdir()
    graph = {"neuronxcc-2.21/MODULE_1+ab/model.neff": b"neff", "neuronxcc-2.21/MODULE_1+ab/compile_flags.txt": b"-O1",
             "neuronxcc-2.21/MODULE_1+ab/model.hlo.pb": b"hlo"}
    compiling = {"neuronxcc-2.21/MODULE_2+ab/model.hlo.pb": b"no .neff yet"}  # still compiling, or failed
    write(first, graph | compiling)
    assert compile_cache.entries(compile_cache.local_files(first), "neff") == {
        "neuronxcc-2.21/MODULE_1+ab/": (sorted(graph), ["neuronxcc-2.21/MODULE_1+ab/model.neff"])}
    assert SharedCache(str(store), "neuron_k", first, kind="neff").push() == 1
    assert read_all(store / "neuron_k") == graph
    # a copy cut short before its .neff: no entry, not pulled
    write(store / "neuron_k", {"neuronxcc-2.21/MODULE_3+ab/model.hlo.pb": b"hlo"})
    assert SharedCache(str(store), "neuron_k", second, kind="neff").pull() == 1 and read_all(second) == graph
    # a local folder lacking its .neff takes the whole folder again
    (second / "neuronxcc-2.21/MODULE_1+ab/model.neff").unlink()
    assert SharedCache(str(store), "neuron_k", second, kind="neff").pull() == 1 and read_all(second) == graph


def test_a_host_of_another_key_neither_pulls_nor_pollutes(tmp_path):
    store, first, other = tmp_path / "store", tmp_path / "first", tmp_path / "other"
    store.mkdir()
    write(first, INDUCTOR)
    SharedCache(str(store), "cpu_torch-2.14.1_python-3.11", first).push()
    before = read_all(store)
    write(other, {"fxgraph/zz/yy": b"another torch's graph"})
    assert SharedCache(str(store), "cpu_torch-2.15.0_python-3.11", other).pull() == 0
    assert read_all(other) == {"fxgraph/zz/yy": b"another torch's graph"}
    assert SharedCache(str(store), "cpu_torch-2.15.0_python-3.11", other).push() == 1
    after = read_all(store)
    assert {k: v for k, v in after.items() if k.startswith("cpu_torch-2.14.1_python-3.11/")} == before
    assert sorted(after) == sorted(before) + ["cpu_torch-2.15.0_python-3.11/fxgraph/zz/yy"]


# ------------------------------------------------------------------------------------ two pushers at once
def versions(host: str, n: int = 16, shared: int = 8) -> dict[str, bytes]:
    """`n` files of ~0.5-1 MiB: `shared` of them under names both hosts have (with different bytes: two hosts
    compile the same graph), the rest the host's own."""
    out = {}
    for i in range(n):
        name = f"shared/{i:02d}.so" if i < shared else f"{host}/{i:02d}.so"
        out[name] = hashlib.sha256(f"{host}{i}".encode()).digest() * ((1 << 14) + 997 * i)
    return out


def _push_at_once(url, local, barrier, queue):
    compile_cache.CHUNK = 1 << 12  # many writes a file: a half-written file would stay visible for longer
    barrier.wait()
    try:
        queue.put(SharedCache(url, "cpu_k", local).push())
    except BaseException as e:  # noqa: BLE001  the test says what
        queue.put(repr(e))


def test_two_pushers_at_once_leave_a_whole_cache(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    hosts = {h: versions(h) for h in ("a", "b")}
    for h, files in hosts.items():
        write(tmp_path / h, files)
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_push_at_once, args=(str(store), str(tmp_path / h), barrier, queue)) for h in hosts]
    for p in procs:
        p.start()
    barrier.wait()
    sizes = {name: len(data) for files in hosts.values() for name, data in files.items()}  # same for both hosts
    seen_half = set()  # what a reader on a third host meets meanwhile under a final name: a file not yet whole
    while any(p.is_alive() for p in procs):
        for name, size in sizes.items():
            try:
                if os.stat(store / "cpu_k" / name).st_size != size:
                    seen_half.add(name)
            except FileNotFoundError:
                pass
    for p in procs:
        p.join(30)
    pushed = [queue.get(timeout=5) for _ in procs]
    assert all(isinstance(n, int) for n in pushed), f"a pusher failed: {pushed}"
    assert 24 <= sum(pushed) <= 32  # each host's own 8, and the 8 shared names once or by both
    assert not seen_half, f"half-written files under their final names: {sorted(seen_half)}"
    stored = read_all(store / "cpu_k")
    assert sorted(stored) == sorted(set(hosts["a"]) | set(hosts["b"])), "a file missing, or a temporary one left"
    for name, data in stored.items():
        assert data in (hosts["a"].get(name), hosts["b"].get(name)), f"{name} is neither host's whole file"


# ------------------------------------------------------------------------------------ errors
class RefusingFS(MemoryFileSystem):
    """A store that answers every call with `error` (set per test): no permission, no network."""
    protocol = "refusing"
    error: Exception = PermissionError(13, "Access Denied")

    def _refuse(self, *args, **kwargs):
        raise self.error

    find = ls = info = open = makedirs = _open = _refuse


@pytest.mark.parametrize("case", ["missing", "scheme", "a_file", "key_is_a_file", "denied", "network"])
def test_a_store_it_cannot_reach_or_write_is_one_user_error(tmp_path, case):
    fsspec.register_implementation("refusing", RefusingFS, clobber=True)
    RefusingFS.error = ConnectionError("Could not connect to the endpoint URL\nsecond line") if case == "network" \
        else PermissionError(13, "Access Denied")
    local = tmp_path / "local"
    write(local, INDUCTOR)
    (tmp_path / "file").write_text("x")
    (tmp_path / "store" / "cpu_k").parent.mkdir()
    (tmp_path / "store" / "cpu_k").write_text("a file where the key's folder goes")
    url = {"missing": str(tmp_path / "nowhere"), "scheme": "nosuch://bucket/cache", "a_file": str(tmp_path / "file"),
           "key_is_a_file": str(tmp_path / "store"), "denied": "refusing://bucket/cache",
           "network": "refusing://bucket/cache"}[case]
    for step in ("pull", "push"):
        if case == "key_is_a_file" and step == "pull":
            assert SharedCache(url, "cpu_k", local).pull() == 0  # nothing of this key there
            continue
        with pytest.raises(UserError) as e:
            getattr(SharedCache(url, "cpu_k", local), step)()
        message = str(e.value)
        assert url in message and "\n" not in message and "Traceback" not in message, message
    assert read_all(local) == INDUCTOR


def test_a_local_cache_inside_the_store_is_refused(tmp_path):
    (tmp_path / "store").mkdir()
    with pytest.raises(UserError, match="overlap"):
        SharedCache(str(tmp_path / "store"), "cpu_k", tmp_path / "store" / "cpu_k" / "x").push()
    with pytest.raises(UserError, match="plain name"):
        SharedCache(str(tmp_path / "store"), "../up", tmp_path / "local")


def test_names_leading_out_of_the_folder_are_never_entries(tmp_path):
    assert not compile_cache._safe("../x") and not compile_cache._safe("a/../../x") and not compile_cache._safe("/x")
    assert not compile_cache._safe("a/.b.123.tmp") and compile_cache._safe("a/b.so")
    store = MemoryFileSystem()  # an object store takes any name
    store.pipe({f"/cc-{tmp_path.name}/cpu_k/fx/a.so": b"a", f"/cc-{tmp_path.name}/cpu_k/fx/b\n\x1b[2J.so": b"b"})
    shared = SharedCache(f"memory://cc-{tmp_path.name}", "cpu_k", tmp_path / "local")
    assert shared.pull() == 1 and read_all(tmp_path / "local") == {"fx/a.so": b"a"}
    assert shared.summary()["unsafe_names"] == 1


# ------------------------------------------------------------------------------------ keys
def test_the_cpu_key_holds_torchs_version():
    key = compile_cache.cache_key("cpu")
    torch_version = re.sub(r"[^A-Za-z0-9.]", "-", installed_version("torch"))
    assert key == f"cpu_torch-{torch_version}_python-{sys.version_info.major}.{sys.version_info.minor}"
    assert re.fullmatch(r"[A-Za-z0-9._-]+", key)
    neuron = {"neuronx-cc": "2.21.33363.0+82129205", "torch-neuronx": "2.8.0.2.10.16998+e9bf8a50"}
    assert compile_cache.key_from_versions("neuron", neuron) == \
        "neuron_neuronx-cc-2.21.33363.0-82129205_torch-neuronx-2.8.0.2.10.16998-e9bf8a50"
    assert compile_cache.key_from_versions("neuron", {"neuronx-cc": "2.21"}) is None  # torch-neuronx not recorded
    assert compile_cache.key_from_versions("cuda", {"torch": "2.14.1", "python": "3.12.3", "cuda": "13.0"}) == \
        "cuda_torch-2.14.1_python-3.12_cuda-13.0"  # triton where installed
    assert compile_cache.key_from_versions("cpu", {"torch": "2.14/../x y", "python": "3.12"}) == \
        "cpu_torch-2.14-..-x-y_python-3.12"
    if installed_version("neuronx-cc") is None:
        with pytest.raises(UserError, match="neuronx-cc, torch-neuronx not installed"):
            compile_cache.cache_key("neuron")


# ------------------------------------------------------------------------------------ the command line
def test_the_command_line(tmp_path, capsys):
    store, local, elsewhere = tmp_path / "store", tmp_path / "local", tmp_path / "elsewhere"
    store.mkdir()
    write(local, INDUCTOR)
    key = compile_cache.cache_key("cpu")
    assert tool.main(["push", str(store), "--from", str(local), "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith(f"pushed 3 entries (0.0 MiB) from {local} to {store}/{key} in ")
    assert tool.main(["pull", store.as_uri(), "--to", str(elsewhere), "--device", "cpu", "--key", key]) == 0
    assert "pulled 3 entries" in capsys.readouterr().out and read_all(elsewhere) == INDUCTOR
    assert tool.main(["pull", str(store), "--to", str(elsewhere), "--device", "cpu", "--key", "neuron_x"]) == 2
    assert capsys.readouterr().err.startswith("error: --key neuron_x is not this host's key")
    assert tool.main(["pull", str(tmp_path / "no\x1b[31mwhere"), "--to", str(elsewhere), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "no such folder" in err
    proc = subprocess.run([sys.executable, "-m", "tools.compile_cache", "key", "--device", "cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, key + "\n")
    proc = subprocess.run([sys.executable, "-m", "tools.compile_cache", "pull"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1


COMPILE_ONCE = """
import torch
from torch._dynamo.utils import counters
torch.compile(lambda x: (x.sin() * 2 + x.cos()).sum(), backend="inductor")(torch.ones(64))
print(sorted(k for k in counters["inductor"] if k.startswith("fxgraph_cache")))
"""


@pytest.mark.extended  # two inductor compiles on CPU: about 20 s
def test_a_host_that_pulls_compiles_nothing(tmp_path):
    """inductor's own cache, pushed from one host's folder and pulled into a new host's empty one: the same graph in a
    new process is read from the FX graph cache, not compiled (measured: 17.3 s cold, 0.8 s after the pull)."""
    from conftest import script_env

    def compile_with(folder):
        proc = subprocess.run([sys.executable, "-c", COMPILE_ONCE], env=dict(script_env(), TORCHINDUCTOR_CACHE_DIR=str(
            folder)), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.strip().splitlines()[-1]

    (tmp_path / "store").mkdir()
    assert compile_with(tmp_path / "first") == "['fxgraph_cache_miss']"
    key = compile_cache.cache_key("cpu")
    assert SharedCache(str(tmp_path / "store"), key, tmp_path / "first").push() > 0
    assert SharedCache((tmp_path / "store").as_uri(), key, tmp_path / "second").pull() > 0
    assert compile_with(tmp_path / "second") == "['fxgraph_cache_hit']"
