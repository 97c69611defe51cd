"""The compile audit (examples/compat_check/compile_audit.py): graphs, recompiles and graph breaks counted by Dynamo
with a counting backend. The four offline models with a static cache (one prefill graph, one decode graph, no
recompile over 32 tokens): tests/test_generate_compat_check.py::test_offline_preset_rows. Here the other side: the
same tiny Qwen3 with a dynamic cache recompiles its decode step at every token, and the audit says so; and the
counting itself on a small module whose graph breaks and recompiles are known in advance.
"""
from __future__ import annotations

import json

import pytest
import torch

from compat_check import compile_audit, rows
from conftest import run_example

SCRIPT = "generate_compat_check.py"


def _only_row(out) -> dict:
    files = sorted(out.glob("*.parquet"))
    assert len(files) == 1, files
    (row,) = rows.read_table(files[0]).to_dict("records")
    return row


def test_dynamic_cache_recompiles_at_every_token(tmp_path, prepared_assets):
    """--cache dynamic (what a model without static-cache support gets): the cache grows by one position per token,
    so every decode step after the first is a graph of its own (the guard on the cache's length fails), and the row
    says what that costs on Trainium. With the static cache (the offline preset's rows) there is none."""
    out = tmp_path / "out"
    run_example(SCRIPT, "--models", "tiny-qwen3", "--no_compile", "--compile_audit", "--cache", "dynamic",
                "--new_tokens", "8", "--out_dir", str(out))
    r = _only_row(out)
    assert r["result"] == "PASS" and "dynamic cache (--cache dynamic)" in r["notes"]
    audit = json.loads(r["compile_audit"])
    assert audit["forward_calls"] == 8 and audit["phases"] == {"prefill": 1, "first_decode_step": 1,
                                                                "later_decode_steps": 6}
    assert (r["compile_graphs"], r["compile_recompiles"], r["compile_graph_breaks"]) == (8, 6, 0)
    reasons = json.loads(r["compile_recompile_reasons"])
    assert len(reasons) == 6 and all("past_key_values" in reason and "size mismatch at index 2" in reason
                                     for reason in reasons), reasons
    assert reasons[0].startswith("forward call 3: ") and "expected 13, actual 14" in reasons[0]  # 13 prompt tokens
    assert not audit["compiles_once"] and audit["same_tokens"]
    assert ("the decode step recompiles at every new token (6 recompilations over 8 tokens" in r["notes"]
            and "one more neuronx-cc compilation" in r["notes"]), r["notes"]
    assert "--compile_audit --cache dynamic" in r["run_args"]


class Toy(torch.nn.Module):
    """A forward with one graph break (a Python float from a tensor) and a shape that changes every call."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        scale = float(y.abs().max().item())  # Dynamo stops the graph here and starts another after it
        return torch.relu(y) / (1.0 + scale)


class Broken(Toy):
    def forward(self, x):
        y = self.linear(x)
        torch._dynamo.graph_break()
        return y


@pytest.mark.parametrize("growing", [False, True])
def test_counts_on_a_module_whose_graphs_are_known(growing):
    """Two graphs per shape (split by the .item() break); a fixed shape compiles once, a growing one recompiles
    at every call after the second, each for the size guard that failed."""
    model = Toy()
    shapes = [(1, 4)] + [(2 + i if growing else 1, 4) for i in range(5)]  # call 1 "prefill", then 5 "decode steps"

    def generate():
        return [model(torch.ones(s)) for s in shapes]

    audit = compile_audit.audit_generation(model, model.forward, generate, fullgraph=False, new_tokens=len(shapes))
    assert "forward" not in model.__dict__  # the model's own forward is back
    assert audit["forward_calls"] == 6 and len(audit.pop("output")) == 6
    assert audit["graph_breaks"] >= 1 and any("item()" in reason for reason in audit["graph_break_reasons"]), audit
    if not growing:
        assert audit["recompiles"] == 0 and audit["phases"]["later_decode_steps"] == 0
        assert compile_audit.note(audit).endswith("no recompile over 6 tokens: compiles once")
    else:
        # calls 3 to 6: a shape each, and both graphs of it (before and after the break) compiled again
        assert audit["recompiles"] == 8 and audit["phases"]["later_decode_steps"] == 8
        assert compile_audit.per_token(audit)
        assert all("size mismatch" in reason for reason in audit["recompile_reasons"]), audit["recompile_reasons"]
        assert "recompiles at every new token" in compile_audit.note(audit)
    columns = compile_audit.row_columns(audit)
    assert (columns["compile_graphs"], columns["compile_recompiles"]) == (audit["graphs"], audit["recompiles"])
    assert json.loads(columns["compile_audit"])["compiles_once"] is (not growing)


def test_fullgraph_refusal_is_the_audits_not_the_rows():
    """fullgraph=True on a forward with a graph break (torch._dynamo.graph_break(): Dynamo's own): Dynamo refuses
    it; the row gets the audit's error and no counts, and the model's forward is restored."""
    model = Broken()
    with pytest.raises(Exception) as e:
        compile_audit.audit_generation(model, model.forward, lambda: model(torch.ones(1, 4)), fullgraph=True,
                                       new_tokens=1)
    assert "forward" not in model.__dict__
    columns = compile_audit.row_columns({"error": f"{type(e.value).__name__}: boom"})
    assert list(columns) == ["compile_audit"] and json.loads(columns["compile_audit"])["error"].endswith("boom")
    assert compile_audit.note({"error": "Unsupported: boom"}) == "compile audit failed: Unsupported: boom"
