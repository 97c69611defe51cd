"""Device choice and process group (self-launch under torchrun: common/harness/launcher.py). Every example calls `setup()` before anything imports
torchtitan, which picks its device type once, at import. `neuron_installed()` is the repository's one Neuron
availability check (find_spec only: launchers and parents decide with it and never start the runtime): without
torch-neuronx, `--device neuron` is an error and `--device auto` picks cuda or cpu. `neuron_runtime()` is the one
way to torch.neuron, and only in order: the Neuron environment first (the runtime reads it when it starts), then,
in a launched worker, its process group (the runtime must not start before init_process_group). torch is imported
where it is used: a command that needs no device (the compatibility lookup) starts without it.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import resource
import socket
import sys
from pathlib import Path
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace

from common.errors import UserError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "neuron")
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "neuron": "neuron"}
GIB = 1 << 30


@dataclass(frozen=True)
class DeviceInfo:
    device: torch.device
    device_type: str
    backend: str
    rank: int
    local_rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def neuron_installed() -> bool:
    """True where torch-neuronx is installed; imports nothing and starts no runtime."""
    return importlib.util.find_spec("torch_neuronx") is not None


_neuron_env_set = False  # set_neuron_env() ran in this process


def _check_neuron_order() -> None:
    import torch.distributed as dist

    if not _neuron_env_set:
        raise RuntimeError("torch.neuron used before the Neuron environment was set (NEURON_LOGICAL_NC_CONFIG, "
                           "the NEFF cache): common.device.setup() sets it first")
    if "RANK" in os.environ and not dist.is_initialized():
        raise RuntimeError("torch.neuron used before this worker's process group exists: the Neuron runtime must "
                           "not start before init_process_group (common.device.setup() creates it first)")


def neuron_runtime():
    """torch.neuron, checked to come after the Neuron environment and, in a worker, after its process group."""
    _check_neuron_order()
    import torch
    import torch_neuronx  # noqa: F401  registers the "neuron" device (PrivateUse1, renamed)

    return torch.neuron


def neuron_available() -> bool:
    """True when a NeuronCore is usable here, for code that runs after setup() (the kernel ops, the device tests).
    The order is checked first, on every machine, so that a launcher or parent calling this fails in CI too."""
    _check_neuron_order()
    return neuron_installed() and bool(neuron_runtime().is_available())


def resolve_device_type(requested: str) -> str:
    """`auto` prefers neuron, then cuda, then cpu; an explicit choice must be available."""
    import torch

    if requested not in DEVICE_CHOICES:
        raise UserError(f"unknown device {requested!r}: choose one of {', '.join(DEVICE_CHOICES)}")
    if requested == "auto":
        return "neuron" if neuron_installed() else "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "neuron" and not neuron_installed():
        raise UserError("--device neuron needs a Trainium host with torch-neuronx installed "
                        "(docs/first-hour-trn2.md); this machine has none")
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but torch sees no CUDA device here")
    return requested


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fill_single_process_env() -> bool:
    """Workaround: torchtitan always builds a process group, so plain `python script.py` needs the variables
    torchrun would set; True when filled in. Remove when torchtitan skips the group at world size 1."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return False
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
    )
    return True


def _cpu_device_module() -> SimpleNamespace:
    """What torchtitan calls on its `device_module` (torch.cuda-like), answered for the host CPU: torch.cpu lacks
    get_device_name, memory_stats and friends, which torchtitan's memory monitor and MFU logging call. Peak
    memory is the process's peak resident set size."""
    import psutil

    name, total = f"CPU {platform.processor() or platform.machine()}", psutil.virtual_memory().total
    nothing = lambda *args, **kwargs: None  # noqa: E731
    return SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0, set_device=nothing,
        synchronize=nothing, empty_cache=nothing, reset_peak_memory_stats=nothing,
        max_memory_allocated=lambda device=None: peak_memory_bytes("cpu"),
        get_device_name=lambda device=None: name,
        get_device_properties=lambda device=None: SimpleNamespace(total_memory=total, name=name),
        memory_stats=lambda device=None: dict.fromkeys(("active_bytes.all.peak", "reserved_bytes.all.peak"),
                                                       peak_memory_bytes("cpu")))


# The TorchNeuron releases from which AWS documents torch.accelerator's memory functions on Neuron: Neuron 2.34.0's
# (torch-neuronx 2.14.3.1 and 2.13.3.1; https://github.com/aws-neuron/torch-neuronx/releases/tag/v2.34.0: "The
# torch.accelerator memory functions ... work on Neuron"), by torch line.
ACCELERATOR_MEMORY_FROM = {(2, 13): (2, 13, 3, 1), (2, 14): (2, 14, 3, 1)}


def accelerator_memory_documented(torch_neuronx_version: str | None) -> bool:
    """Whether this torch-neuronx version is one whose torch.accelerator memory functions AWS documents on Neuron
    (ACCELERATOR_MEMORY_FROM, and any later torch line)."""
    import re

    numbers = tuple(int(n) for n in re.findall(r"\d+", (torch_neuronx_version or "").split("+")[0])[:4])
    if len(numbers) < 2:
        return False
    first = ACCELERATOR_MEMORY_FROM.get(numbers[:2])
    return numbers >= first if first else numbers[:2] > max(ACCELERATOR_MEMORY_FROM)


def neuron_peak_memory():
    """(read, name): how this process's device memory peak is read on Neuron: torch.accelerator's
    max_memory_allocated where the installed torch-neuronx documents it (accelerator_memory_documented), else
    torch.neuron's (the 2.33 stack). Both read TorchNeuron's allocator, whose peak torch.neuron's
    reset_peak_memory_stats resets."""
    from importlib import metadata

    import torch

    neuron = neuron_runtime()
    try:
        version = metadata.version("torch-neuronx")
    except metadata.PackageNotFoundError:
        version = None
    if accelerator_memory_documented(version):
        return torch.accelerator.max_memory_allocated, "torch.accelerator.max_memory_allocated"
    return neuron.max_memory_allocated, "torch.neuron.max_memory_allocated"


def peak_memory_bytes(device_type: str) -> int:
    """Peak device memory of this process. CPU has no device memory: the peak resident set size."""
    import torch

    if device_type == "cuda":
        return int(torch.cuda.max_memory_allocated())
    if device_type == "neuron":
        return int(neuron_peak_memory()[0]())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def route_torchtitan_device(device_type: str) -> None:
    """Workaround: make torchtitan use `device_type` rather than what it detects at import. torchtitan 0.3.0
    binds `device_type, device_module` in torchtitan/tools/utils.py at import ("cuda" when it finds no
    accelerator), and every other module copies the pair; setting it right after importing that one module,
    before any other torchtitan import, routes all of torchtitan.
    Remove when torchtitan detects CPU-only hosts (or takes the device as a setting)."""
    already_imported = "torchtitan.tools.utils" in sys.modules
    try:
        import torchtitan.tools.utils as tt_utils
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != "torchtitan":
            raise
        raise UserError(f"{sys.executable} has no torchtitan: use the environment `make setup` made (`make demo` "
                        "prints its activate line), or on trn2 the Neuron environment of docs/first-hour-trn2.md"
                        ) from None

    if tt_utils.device_type == device_type:
        return
    if already_imported:
        raise RuntimeError(
            "torchtitan was imported before common.device.setup(); call setup() first so that "
            f"torchtitan runs on {device_type!r} rather than {tt_utils.device_type!r}"
        )
    import torch

    if device_type == "neuron":
        import torch_neuronx  # noqa: F401  registers torch.neuron; the module object is handed over, nothing called
    tt_utils.device_type = device_type
    tt_utils.device_module = _cpu_device_module() if device_type == "cpu" else getattr(torch, device_type)


# TorchNeuron's NEFF cache; unset, it is /tmp/neff_cache (TorchNeuron's public source, April 2026:
# PersistentCacheBackend.cpp lines 21-27, kernels/cache_utils.py lines 8-10; not run on a trn2 host here).
NEFF_CACHE_VAR = "TORCH_NEURONX_NEFF_CACHE_DIR"


def neff_cache_dir(flag: str | None, out_dir: Path) -> str:
    """The NEFF cache of a run: --neff_cache_dir, else TORCH_NEURONX_NEFF_CACHE_DIR where the user set it, else
    OUT_DIR/neff_cache (durable beside the run, not TorchNeuron's /tmp/neff_cache that a new host starts without)."""
    return str(Path(flag or os.environ.get(NEFF_CACHE_VAR) or Path(out_dir) / "neff_cache").absolute())


def set_neuron_env(lnc: int, neff_cache_dir: str) -> dict[str, str]:
    """Neuron runtime/compiler settings from config fields, in one place (Trainium only): LNC (logical
    NeuronCore size) must match the NKI kernels' launch grid; the NEFF cache keeps compiled graphs across runs,
    always set, so the folder the pilot watches is the one TorchNeuron writes."""
    global _neuron_env_set
    env = {"NEURON_LOGICAL_NC_CONFIG": str(lnc), NEFF_CACHE_VAR: neff_cache_dir}
    os.environ.update(env)
    _neuron_env_set = True
    return env


def setup(requested: str = "auto", *, lnc: int = 2, neff_cache_dir: str | None = None,
          timeout_s: int = 600) -> DeviceInfo:
    """Choose the device, fill in the launcher variables for plain `python`, route torchtitan to the device, and
    create the process group (torchtitan reuses it). Neuron settings first: the runtime reads them at start
    (`neff_cache_dir`: the run's, see neff_cache_dir(); None: the variable's or TorchNeuron's default)."""
    import torch
    import torch.distributed as dist

    device_type = resolve_device_type(requested)
    if device_type == "neuron":
        cache = neff_cache_dir or os.environ.get(NEFF_CACHE_VAR) or "/tmp/neff_cache"
        print(f"[neuron] {set_neuron_env(lnc, cache)}", flush=True)
    fill_single_process_env()
    try:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        world_size = int(os.environ["WORLD_SIZE"])
    except ValueError as e:
        raise UserError(f"launcher variables RANK/LOCAL_RANK/WORLD_SIZE are not integers: {e}") from None
    route_torchtitan_device(device_type)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    elif device_type == "neuron":
        # One NeuronCore per process; the neuron backend maps LOCAL_RANK to NEURON_RT_VISIBLE_CORES.
        # The runtime must not start before init_process_group, so no tensor touches the device here.
        device = torch.device("neuron")
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend=BACKENDS[device_type], timeout=timedelta(seconds=timeout_s))
    if device_type == "neuron" and not neuron_runtime().is_available():  # the first runtime call: after the group
        raise UserError("torch-neuronx is installed but sees no NeuronCore (check NEURON_RT_VISIBLE_CORES and "
                        "`neuron-ls`; docs/first-hour-trn2.md)")
    # torchtitan's init_distributed skips everything when the group exists, including this: it runs
    # backward on the calling thread (activation-checkpoint recompute must see the process groups).
    torch.autograd.set_multithreading_enabled(False)
    return DeviceInfo(device, device_type, BACKENDS[device_type], rank, local_rank, world_size)


def agree_max(values: list[float], device=None) -> list[float]:
    """Each value's largest over the ranks, in one all-reduce (the values themselves in a single process): what every
    rank must decide alike (a stop, a save step, a held-out batch, a refusal) is decided from the same numbers.
    `device`: where the collective runs (default: the device torchtitan trains on, routed by `setup`)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return [float(v) for v in values]
    if device is None:
        from torchtitan.tools.utils import device_type as device  # bound by setup's routing
    flags = torch.tensor([float(v) for v in values], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags.tolist()


def teardown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
