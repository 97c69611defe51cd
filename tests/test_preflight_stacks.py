"""common/harness/preflight.py on the two Neuron stacks: the trn2 table names the stack the installed TorchNeuron
belongs to (Neuron 2.33 or 2.34) and holds each to its own versions, its compile-fallback default and the call its
memory peak is read with. The installed versions are version sets passed to the preflight's reader in this process
(`_versions(..., read=...)`); nothing stands in for a Neuron module.
"""
from __future__ import annotations

import json

import pytest

from common.harness import preflight
from conftest import ROOT

RELEASE_233 = json.loads((ROOT / "tests" / "assets" / "neuron-2.33.0.json").read_text())["pip"]
STACK_233 = {**RELEASE_233, "transformers": "5.16.0", "torch-neuronx": "2.14.3.0.1180"}
# The Neuron 2.34.0 release's own versions: the compiler, NKI and OS packages from its package list
# (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.34.0/release-notes/releasecontent.html), TorchNeuron from
# https://github.com/aws-neuron/torch-neuronx/releases/tag/v2.34.0 (no build suffix given), TorchTitan Neuron from
# https://awsdocs-neuron.readthedocs-hosted.com/en/v2.34.0/_sources/release-notes/components/torchtitan-neuron.rst
RELEASE_234 = {"pip": {"torch-neuronx": "2.14.3.1", "neuronx-cc": "2.29.16866.0", "nki": "0.8.0",
                       "torchtitan-neuron": "0.2.2+neuron.2"},
               "system": {"aws-neuronx-runtime-lib": "2.36.8.0", "aws-neuronx-collectives": "2.36.0.0",
                          "aws-neuronx-dkms": "2.32.6.0"}}
# An installed 2.34 stack: TorchNeuron with a build suffix (its number here is made up: the release names none)
STACK_234 = {**RELEASE_234["pip"], "torch": "2.14.0", "torch-neuronx": "2.14.3.1.2207", "transformers": "5.16.0"}


def _rows(versions: dict[str, str]) -> dict[str, tuple[str, str]]:
    """The trn2 version rows with `versions` installed, by requirement: (found, verdict)."""
    return {r: (f, v) for r, f, v in preflight._versions("trn2", read=versions.get)}


@pytest.mark.parametrize("versions, stack, pins_file, fallback, memory", [
    (STACK_233, "2.33", "requirements-trn2.txt", "unset: default not stated for 2.33",
     "torch.neuron.max_memory_allocated"),
    (STACK_234, "2.34", "requirements-trn2-2.34.txt", "unset: default True (a graph that fails to compile raises)",
     "torch.accelerator.max_memory_allocated"),
], ids=["2.33", "2.34"])
def test_each_stack_is_named_and_held_to_its_own_versions(monkeypatch, versions, stack, pins_file, fallback, memory):
    monkeypatch.delenv(preflight.FALLBACK_VAR, raising=False)
    rows = _rows(versions)
    found, verdict = rows["Neuron stack"]
    assert found == f"{stack} (torch-neuronx {versions['torch-neuronx']}); pins: {pins_file}", found
    assert verdict == "info"
    pins = preflight.TRN2_STACKS[stack][0]
    for dist, want in pins.items():
        assert rows[f"{dist}{want}"][1] == "ok", (dist, want, rows[f"{dist}{want}"])
    assert rows[f"{preflight.FALLBACK_VAR} (torch.compile only)"][0].startswith(fallback)
    assert rows["device memory peak read with"][0].startswith(memory)


def test_the_234_stack_is_held_to_the_234_releases_own_versions():
    """The preflight's 2.34 pins are the Neuron 2.34.0 release's versions, each of them exact (the compiler and NKI
    as 2.33's are), TorchNeuron as its 2.14.3.1 builds; its OS packages are that release's too."""
    pins = preflight.TRN2_234_PINS
    assert pins["neuronx-cc"] == "==" + RELEASE_234["pip"]["neuronx-cc"]
    assert pins["nki"] == "==" + RELEASE_234["pip"]["nki"]
    assert pins["torch-neuronx"] == "==" + RELEASE_234["pip"]["torch-neuronx"] + ".*"
    assert pins["torchtitan-neuron"] == "==" + RELEASE_234["pip"]["torchtitan-neuron"]
    assert preflight.NEURON_SYSTEM_234 == RELEASE_234["system"]
    assert preflight.SYSTEM_STACKS["2.34"] == (preflight.NEURON_SYSTEM_234, "Neuron 2.34.0")


def test_a_234_torchneuron_with_233s_torchtitan_neuron_is_a_warning_row():
    """2.34's TorchNeuron makes the stack 2.34: a 2.33 torchtitan-neuron (0.2.2+neuron.1) beside it is named."""
    rows = _rows({**STACK_234, "torchtitan-neuron": "0.2.2+neuron.1"})
    assert rows["Neuron stack"][0].startswith("2.34 ")
    assert rows["torchtitan-neuron==0.2.2+neuron.2"] == ("0.2.2+neuron.1", "WARN")
    assert rows["neuronx-cc==2.29.16866.0"] == ("2.29.16866.0", "ok")
    assert rows["nki==0.8.0"] == ("0.8.0", "ok")


def test_233s_compiler_on_the_234_stack_and_234s_on_the_233_stack_are_warnings():
    rows_234 = _rows({**STACK_234, "neuronx-cc": RELEASE_233["neuronx-cc"], "nki": RELEASE_233["nki"]})
    assert rows_234["neuronx-cc==2.29.16866.0"] == (RELEASE_233["neuronx-cc"], "WARN")
    assert rows_234["nki==0.8.0"] == (RELEASE_233["nki"], "WARN")
    rows_233 = _rows({**STACK_233, "neuronx-cc": STACK_234["neuronx-cc"], "nki": STACK_234["nki"]})
    assert rows_233["neuronx-cc==2.28.7631.0"] == (STACK_234["neuronx-cc"], "WARN")
    assert rows_233["nki==0.7.0"] == (STACK_234["nki"], "WARN")


def test_another_234_compiler_build_is_a_warning_row():
    """Another neuronx-cc 2.29 build than the release's is off the stack."""
    rows = _rows({**STACK_234, "neuronx-cc": "2.29.1024.0"})
    assert rows["neuronx-cc==2.29.16866.0"] == ("2.29.1024.0", "WARN")


@pytest.mark.parametrize("installed, verdict, found", [
    ("2.34.0", "ok", "{v}"),
    ("2.33.1", "WARN", "{v}: older than Neuron 2.34.0's"),
], ids=["2.34.0", "2.33.1"])
def test_the_234_stacks_os_packages_are_held_to_2340s(monkeypatch, installed, verdict, found):
    """On the 2.34 stack the runtime, collectives and driver rows name Neuron 2.34.0's versions: 2.34.0's own are ok,
    2.33.1's (what the 2.33 stack asks for) are older. The OS package versions are given to the preflight's reader in
    this process."""
    system = RELEASE_234["system"] if installed == "2.34.0" else preflight.NEURON_SYSTEM
    monkeypatch.setattr(preflight, "_system_version", system.get)
    rows = _rows(STACK_234)
    for pkg, want in RELEASE_234["system"].items():
        assert rows[f"{pkg} >= {want} (Neuron 2.34.0)"] == (found.format(v=system[pkg]), verdict), pkg


def test_the_234_requirements_file_pins_the_234_release():
    """requirements-trn2-2.34.txt pins the 2.34.0 release's compiler and NKI exactly, as requirements-trn2.txt pins
    2.33.0's."""
    lines = {line.split("#")[0].strip() for line in (ROOT / "requirements-trn2-2.34.txt").read_text().splitlines()}
    for dist in ("neuronx-cc", "nki"):
        assert f"{dist}=={RELEASE_234['pip'][dist]}" in lines, dist
    assert f"torch-neuronx=={RELEASE_234['pip']['torch-neuronx']}.*" in lines


def test_no_torchneuron_is_checked_against_233_and_says_so():
    stack, why = preflight.trn2_stack({}.get)
    assert (stack, why) == ("2.33", "no torch-neuronx: checked against 2.33, the AWS guide's")


def test_a_set_fallback_variable_is_shown(monkeypatch):
    monkeypatch.setenv(preflight.FALLBACK_VAR, "0")
    assert _rows(STACK_234)[f"{preflight.FALLBACK_VAR} (torch.compile only)"] == ("set to '0'", "info")


def test_the_234_requirements_file_pins_what_the_preflight_holds_the_234_stack_to():
    """requirements-trn2-2.34.txt and TRN2_234_PINS agree (torchtitan-neuron comes from a clone, not pip)."""
    from packaging.requirements import Requirement

    reqs = {}
    for line in (ROOT / "requirements-trn2-2.34.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            req = Requirement(line)
            reqs[req.name] = req.specifier
    from packaging.specifiers import SpecifierSet

    for dist, want in preflight.TRN2_234_PINS.items():
        if dist == "torchtitan-neuron":
            assert dist not in reqs
            continue
        assert reqs[dist] == SpecifierSet(want), (dist, reqs.get(dist), want)
