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
# Neuron 2.34.0's TorchNeuron and TorchTitan Neuron (their release pages); a compiler and NKI newer than 2.33's
STACK_234 = {"torch": "2.14.0", "torch-neuronx": "2.14.3.1.2207", "neuronx-cc": "2.29.1024.0", "nki": "0.8.0",
             "transformers": "5.16.0", "torchtitan-neuron": "0.2.2+neuron.2"}


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


def test_a_234_torchneuron_with_233s_torchtitan_neuron_is_a_warning_row():
    """2.34's TorchNeuron makes the stack 2.34: a 2.33 torchtitan-neuron (0.2.2+neuron.1) beside it is named."""
    rows = _rows({**STACK_234, "torchtitan-neuron": "0.2.2+neuron.1"})
    assert rows["Neuron stack"][0].startswith("2.34 ")
    assert rows["torchtitan-neuron==0.2.2+neuron.2"] == ("0.2.2+neuron.1", "WARN")
    assert rows["neuronx-cc>2.28.7631.0,<3"] == ("2.29.1024.0 (2.34's own version unconfirmed: newer than 2.33's)",
                                                  "ok")


def test_233s_compiler_on_the_234_stack_and_234s_on_the_233_stack_are_warnings():
    rows_234 = _rows({**STACK_234, "neuronx-cc": RELEASE_233["neuronx-cc"], "nki": RELEASE_233["nki"]})
    assert rows_234["neuronx-cc>2.28.7631.0,<3"][1] == "WARN" and rows_234["nki>0.7.0,<1"][1] == "WARN"
    rows_233 = _rows({**STACK_233, "neuronx-cc": STACK_234["neuronx-cc"]})
    assert rows_233["neuronx-cc==2.28.7631.0"] == (STACK_234["neuronx-cc"], "WARN")


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
