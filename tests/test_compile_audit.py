"""The compile audit (examples/compat_check/compile_audit.py): graphs, recompiles and graph breaks counted by Dynamo
with a counting backend. The tiny Qwen3 and Qwen3-MoE with a static cache (one prefill graph, one decode graph, no
recompile while the cache fills), as the check's worker audits them; the other side, through the check itself: the
same tiny Qwen3 with a dynamic cache recompiles its decode step at every token, and the row says so; and the counting
itself on a small module whose graph breaks (each reason one line) and recompiles are known in advance.
"""
from __future__ import annotations

import json
import sys

import pyarrow.parquet as pq
import pytest
import torch

from compat_check import compile_audit, lookup, rows
from tools import prepare_assets as assets
from conftest import ROOT, run_example, run_python

SCRIPT = "generate_compat_check.py"


def _only_row(out) -> dict:
    files = sorted(out.glob("*.parquet"))
    assert len(files) == 1, files
    (row,) = rows.read_table(files[0]).to_dict("records")
    return row


# The check's worker for a single-core run (generate_compat_check.generate_on_device: load, greedy tokens with the
# static cache, the compile audit, the CPU eager reference), for several models one after another in one process:
# argv: the repository, a JSON file of {name: job}, the JSON file for {name: report}.
_RANK = """
import json
import sys
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/examples"]
import generate_compat_check as check
from common import device
jobs = json.loads(Path(sys.argv[2]).read_text())
try:
    reports = {name: check.generate_on_device(job) for name, job in jobs.items()}
finally:
    device.teardown()
Path(sys.argv[3]).write_text(json.dumps(reports))
"""


def _job(folder, task: str, new_tokens: int) -> dict:
    """The job that generate_compat_check.check_model gives the worker for a single-core CPU run of the offline
    preset with --no_compile --compile_audit --new_tokens N (every other setting at its default)."""
    from generate_compat_check import Config, OFFLINE_IMAGE

    cfg = Config()
    job = {"folder": str(folder), "cores": 1, "runner": "single", "device": "cpu", "task": task, "dtype": cfg.dtype,
           "compile": False, "fullgraph": cfg.fullgraph, "new_tokens": new_tokens, "timeout_s": cfg.timeout_s,
           "lnc": cfg.lnc, "trust_remote_code": False, "compile_audit": True, "cache": cfg.cache,
           "prompt": cfg.image_prompt if task == "image-text-to-text" else cfg.prompt}
    if task == "image-text-to-text":
        job["image"] = str(folder / OFFLINE_IMAGE)
    return job


# Tokens per audited generation: the prefill, the first decode step and 4 more decode steps over a filling cache
# (Dynamo compiles a frame again on the first call whose guard fails: any recompile as the cache fills shows at the
# first later step already, as the dynamic cache's does below).
NEW_TOKENS = 6


@pytest.mark.extended
def test_static_cache_compiles_once_text_models_in_one_graph(tmp_path, prepared_assets, capsys):
    """The tiny Qwen3 and Qwen3-MoE as the check runs and audits them (static cache, 6 tokens): a prefill graph and a
    decode graph, no graph break, no recompile while the cache fills, the audited generation the same tokens as the
    run. The rows' audit columns and notes say so, and the lookup's --compiles_once keeps every such row. (The
    offline preset's other models: SmolLM2 is a Llama, the dense decoder the tiny Qwen3 shares; the Qwen3-VL's vision
    tower breaks into some 30 graphs, 20 CPU-seconds of Dynamo tracing: graph breaks and their one-line reasons are
    counted on the small module below.)"""
    folders = assets.prepare(["tiny_qwen3", "tiny_qwen3_moe"])
    models = {"tiny-qwen3": folders["tiny_qwen3"], "tiny-qwen3-moe": folders["tiny_qwen3_moe"]}
    jobs, script, reports = tmp_path / "jobs.json", tmp_path / "rank.py", tmp_path / "reports.json"
    jobs.write_text(json.dumps({name: _job(folder, "text-generation", NEW_TOKENS) for name, folder in models.items()}))
    script.write_text(_RANK)
    proc = run_python([sys.executable, str(script), str(ROOT), str(jobs), str(reports)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = json.loads(reports.read_text())
    assert list(reports) == list(models)
    path = tmp_path / "rows.parquet"
    for name, rep in reports.items():
        audit = rep["audit"]
        assert rep["static"] and not rep["compiled"] and rep["compile_s"] == 0.0, name
        assert rep["tokens"] == rep["cpu_tokens"] and len(rep["tokens"]) == NEW_TOKENS, name  # the row's cpu_match
        assert audit["recompiles"] == 0 and audit["recompile_reasons"] == [], (name, audit)
        assert audit["phases"] == {"prefill": 1, "first_decode_step": 1, "later_decode_steps": 0}, (name, audit)
        assert audit["forward_calls"] == NEW_TOKENS and audit["same_tokens"], (name, audit)
        assert rep["timings"]["compile_audit_s"] > 0  # timed apart from the run's own times
        columns = compile_audit.row_columns(audit)  # what the check adds to the row, and to its notes
        assert json.loads(columns["compile_audit"])["compiles_once"] and columns["compile_recompiles"] == 0
        assert compile_audit.note(audit).endswith(f"no recompile over {NEW_TOKENS} tokens: compiles once"), name
        assert (audit["graphs"], audit["graph_breaks"]) == (2, 0), (name, audit)
        assert (columns["compile_graphs"], columns["compile_graph_breaks"]) == (2, 0), (name, columns)
        assert json.loads(columns["compile_graph_break_reasons"]) == {}, name
        rows.write_row(path, {"model_id": name, "task": "text-generation", "result": "PASS", **columns})
    assert lookup.lookup_main([str(path), "--compiles_once"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "2 row(s): 2 PASS, 0 FAIL, 0 EXCLUDED (not failures)"


@pytest.mark.extended
def test_dynamic_cache_recompiles_at_every_token(tmp_path, prepared_assets, capsys):
    """--cache dynamic (what a model without static-cache support gets): the cache grows by one position per token,
    so every decode step after the first is a graph of its own (the guard on the cache's length fails), and the row
    says what that costs on Trainium. With the static cache there is none (above); the lookup's --compiles_once
    leaves this row out."""
    out = tmp_path / "out"
    run_example(SCRIPT, "--models", "tiny-qwen3", "--no_compile", "--compile_audit", "--cache", "dynamic",
                "--new_tokens", "4", "--no-judge_single_core", "--out_dir", str(out),
                process=True)  # Dynamo's guards, and so its recompile reasons, depend on what the process compiled
    r = _only_row(out)
    assert r["result"] == "PASS" and "dynamic cache (--cache dynamic)" in r["notes"]
    audit = json.loads(r["compile_audit"])
    assert audit["forward_calls"] == 4 and audit["phases"] == {"prefill": 1, "first_decode_step": 1,
                                                                "later_decode_steps": 2}
    assert (r["compile_graphs"], r["compile_recompiles"], r["compile_graph_breaks"]) == (4, 2, 0)
    reasons = json.loads(r["compile_recompile_reasons"])
    assert len(reasons) == 2 and all("past_key_values" in reason and "size mismatch at index 2" in reason
                                     for reason in reasons), reasons
    assert reasons[0].startswith("forward call 3: ") and "expected 13, actual 14" in reasons[0]  # 13 prompt tokens
    assert reasons[1].startswith("forward call 4: ") and "expected 14, actual 15" in reasons[1]  # one more each token
    assert not audit["compiles_once"] and audit["same_tokens"]
    assert ("the decode step recompiles at every new token (2 recompilations over 4 tokens" in r["notes"]
            and "one more neuronx-cc compilation" in r["notes"]), r["notes"]
    assert "--compile_audit --cache dynamic" in r["run_args"]
    assert json.loads(r["timings"])["compile_audit_s"] > 0 and r["compile_s"] == 0.0  # not in the row's times
    # the counts are integer columns, their reasons text beside them
    schema = pq.read_schema(next(out.glob("*.parquet")))
    assert [str(schema.field(c).type) for c in ("compile_graphs", "compile_recompiles", "compile_graph_breaks",
                                                 "compile_recompile_reasons")] == ["int64"] * 3 + ["string"]
    assert lookup.lookup_main([str(out), "--compiles_once"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "0 row(s): 0 PASS, 0 FAIL, 0 EXCLUDED (not failures)"


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
    """Two graphs per shape (split by the .item() break, its reason one line); a fixed shape compiles once, a growing
    one recompiles at every call after the second, each for the size guard that failed."""
    model = Toy()
    shapes = [(1, 4)] + [(2 + i if growing else 1, 4) for i in range(5)]  # call 1 "prefill", then 5 "decode steps"

    def generate():
        return [model(torch.ones(s)) for s in shapes]

    audit = compile_audit.audit_generation(model, model.forward, generate, fullgraph=False, new_tokens=len(shapes))
    assert "forward" not in model.__dict__  # the model's own forward is back
    assert audit["forward_calls"] == 6 and len(audit.pop("output")) == 6
    assert audit["graph_breaks"] >= 1 and any("item()" in reason for reason in audit["graph_break_reasons"]), audit
    assert all(reason.strip() and "\n" not in reason for reason in audit["graph_break_reasons"]), audit
    breaks = json.loads(compile_audit.row_columns(audit)["compile_graph_break_reasons"])
    assert compile_audit.row_columns(audit)["compile_graph_breaks"] == sum(breaks.values()), breaks
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


def test_the_audit_compiles_with_the_checks_own_arguments():
    """One set of torch.compile arguments (compile_audit.compile_options) for the check's compiled forward
    (generate_compat_check.compile_forward) and for the audit: dynamic=False, one graph per input shape, as the neuron
    backend takes them. A forward called with four input lengths is four graphs in the check's own call and four in
    the audit (with dynamic unset, Dynamo compiles the second length as a symbolic graph for every later one)."""
    import generate_compat_check as check
    from torch._dynamo.testing import CompileCounter

    assert compile_audit.compile_options(fullgraph=True) == {"fullgraph": True, "dynamic": False}
    assert compile_audit.compile_options(fullgraph=False) == {"fullgraph": False, "dynamic": False}
    model = torch.nn.Linear(4, 4)
    shapes = [(n, 4) for n in (3, 4, 5, 6)]
    counter = CompileCounter()  # torch's own counting backend
    torch._dynamo.reset()
    try:
        compiled = check.compile_forward(model.forward, counter, fullgraph=False)
        for shape in shapes:
            compiled(torch.ones(shape))
    finally:
        torch._dynamo.reset()
    audit = compile_audit.audit_generation(model, model.forward, lambda: [model(torch.ones(s)) for s in shapes],
                                           fullgraph=False, new_tokens=len(shapes))
    assert counter.frame_count == audit["graphs"] == len(shapes), (counter.frame_count, audit["graphs"])
