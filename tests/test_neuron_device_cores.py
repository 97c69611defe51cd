"""The NeuronCores tests/test_neuron_device.py gives its two sides, checked on any machine (no device, no
torch-neuronx): the tests that run in the pytest process and the training run the last one starts as a child get
disjoint cores, each written as the Neuron runtime reads NEURON_RT_VISIBLE_CORES."""
from __future__ import annotations

import inspect
import re

import pytest

import test_neuron_device as nd
from common import device


def visible_cores(value: str) -> list[int]:
    """The NeuronCore indices a NEURON_RT_VISIBLE_CORES value selects, by the runtime's documented syntax: indices
    and ranges "p-q", comma-separated, together contiguous and in increasing order
    (aws-neuron/aws-neuron-sdk@81ce03a:neuron-runtime/guides/nrt-developer-guide.rst:1051-1054)."""
    ids = []
    for part in value.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m or int(m[2] or m[1]) < int(m[1]):
            raise ValueError(f"NEURON_RT_VISIBLE_CORES={value}: {part!r} is neither an index nor a range p-q")
        ids += range(int(m[1]), int(m[2] or m[1]) + 1)
    if ids != list(range(ids[0], ids[0] + len(ids))):
        raise ValueError(f"NEURON_RT_VISIBLE_CORES={value}: not contiguous and increasing")
    return ids


def test_the_syntax_reader_takes_the_guides_examples():
    """The guide's valid examples and its invalid one (4 missing), nrt-developer-guide.rst:1053-1054."""
    assert visible_cores("3,4,5,6") == visible_cores("3-6") == visible_cores("3-5,6") == [3, 4, 5, 6]
    for bad in ("3,5,6", "6-3", "", "0-", "a"):
        with pytest.raises(ValueError):
            visible_cores(bad)


def test_in_process_tests_and_the_child_run_get_disjoint_cores():
    """As on a trn2 box: the module sets its own cores in os.environ (here a user's shell had selected all 64),
    then the pilot test builds the child's environment from that os.environ."""
    shell = {nd.CORES_VAR: "0-63", device.NEFF_CACHE_VAR: "/tmp/neff_cache", "PATH": "/usr/bin", "LNC_KEPT": "2"}
    in_process, _ = nd.core_split(shell)
    pytest_env = {**shell, **in_process}
    _, child = nd.core_split(pytest_env)
    assert set(in_process) == {"NEURON_RT_VISIBLE_CORES"}
    mine, theirs = visible_cores(pytest_env["NEURON_RT_VISIBLE_CORES"]), visible_cores(child["NEURON_RT_VISIBLE_CORES"])
    assert mine and theirs and not set(mine) & set(theirs), (mine, theirs)
    # the child writes its NEFFs under its own OUT_DIR/neff_cache; everything else it inherits
    assert device.NEFF_CACHE_VAR not in child and child["PATH"] == "/usr/bin" and child["LNC_KEPT"] == "2"


def test_the_split_comes_before_any_device_use():
    """In the module, the pytest process's cores are set before its first call that can start the runtime (the
    skip condition's neuron_available()), and the child is started with the split's environment."""
    source = inspect.getsource(nd)
    first_use = source.index("pytestmark = pytest.mark.skipif(")  # its condition calls neuron_available()
    assert source.index("os.environ.update(core_split(os.environ)[0])") < first_use
    pilot = inspect.getsource(nd.test_a_neuron_runs_pilot_fields_memory_neff_cache_and_fallback_ops)
    assert "env = core_split(os.environ)[1]" in pilot and "env=env" in pilot
