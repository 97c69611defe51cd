"""Smoke and contract tests for examples/generate_compat_check.py and its helpers in examples/compat_check/: what a
model's row says (sharded, excluded, not fetched, non-finite), flags refused before any row, the lookup and its
results files, and the helpers in process.

The script runs as a subprocess on the offline models, eager (--no_compile: inductor on a 2-core CPU
takes about two minutes per model), and the tests read its Parquet rows and results.json. Elsewhere: the offline
preset's rows, a killed check and its rerun (tests/test_compat_offline.py); --task train (tests/test_compat_train.py);
time limits, signals and concurrent writers (tests/test_compat_processes.py); the compile audit
(tests/test_compile_audit.py); the lookup page in a real browser (tests/test_compat_page.py).
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import stat
import subprocess
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common import device, paths
from common.errors import UserError
from compat_check import judge as judging, lookup, page, rows, sizing
from tools import prepare_assets as assets
from conftest import ROOT, assert_clean_error, example_command, read_results, run_example, run_in_process, script_env

SCRIPT = "generate_compat_check.py"


@pytest.fixture(scope="module")
def model_assets(prepared_assets):
    folders = assets.prepare(["tiny_qwen3", "tiny_qwen3_moe", "smollm2"])
    # The vision-language asset, through the registry once it lists it, else its own builder.
    folders["tiny_qwen_vl"] = assets.prepare(["tiny_qwen_vl"])["tiny_qwen_vl"]
    return folders


def _only_file(out: Path) -> Path:
    files = sorted(out.glob("*.parquet"))
    assert len(files) == 1, files
    return files[0]


def _gpt2_without_plan(dest: Path) -> Path:
    """A real (random) GPT-2: transformers gives it no tensor-parallel plan, and it has no experts."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, n_positions=64, vocab_size=256)).save_pretrained(dest)
    return dest


def test_sharded_run_no_plan_and_remote_code(tmp_path, model_assets):
    moe = model_assets["tiny_qwen3_moe"]
    gpt2 = _gpt2_without_plan(tmp_path / "gpt2-tiny")
    remote = tmp_path / "remote-code"
    remote.mkdir()
    cfg = json.loads((moe / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (remote / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    models = ",".join(str(p) for p in (moe, gpt2, remote))
    run_example(SCRIPT, "--models", models, "--cores", "2", "--no_compile", "--new_tokens", "4",
                "--out_dir", str(out), "--timeout_s", "300")
    by_name = {Path(r["model_id"]).name: r for r in rows.read_table(_only_file(out)).to_dict("records")}
    assert len(by_name) == 3

    sharded = by_name["tiny-qwen3-moe"]  # qwen3_moe has a TP plan: tensor parallel over 2 gloo processes
    assert (sharded["tp"], sharded["runner"], sharded["hbm_capacity_gb"]) == (2, "tp", 48.0)
    assert sharded["cpu_match"] is None or pd.isna(sharded["cpu_match"])  # not a single-core run
    verdict = json.loads(sharded["judge"])
    assert sharded["english"] == verdict["english"] is False  # random weights: honest FAIL
    assert sharded["result"] == "FAIL" and verdict["reasons"]
    assert sharded["wall_s"] > 0 and sharded["hbm_peak_gb"] > 0

    no_plan = by_name["gpt2-tiny"]
    assert no_plan["result"] == "EXCLUDED" and no_plan["exclusion"].startswith("no sharding plan"), no_plan

    refused = by_name["remote-code"]
    assert refused["result"] == "EXCLUDED" and "--trust_remote_code" in refused["exclusion"]
    assert not (tmp_path / "remote-code" / "modeling_evil.py").exists()


def test_task_mismatch_and_unreachable_hub_id_are_not_failures(tmp_path, model_assets):
    """A text model asked for image-text-to-text is EXCLUDED with the reason; a Hub id on an offline
    machine (as a new user would try it) is no verdict: EXCLUDED as not fetched, and tried again on a
    rerun without --redo while the recorded exclusion stays skipped."""
    out = tmp_path / "out"
    args = ("--task", "image-text-to-text", "--models", "tiny-qwen3,Qwen/Qwen3-0.6B", "--no_compile",
            "--out_dir", str(out))
    proc = run_in_process(SCRIPT, *args)  # nothing loaded nor launched: in this process
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_id = {r["model_id"]: r for r in rows.read_table(_only_file(out)).to_dict("records")}
    text_model, hub = by_id["tiny-qwen3"], by_id["Qwen/Qwen3-0.6B"]
    assert text_model["result"] == "EXCLUDED" and text_model["task"] == "image-text-to-text"
    assert text_model["exclusion"].startswith("not a vision-language model: model_type 'qwen3'")
    assert hub["result"] == "EXCLUDED" and hub["unavailable"] is True and not hub["error"]
    assert hub["exclusion"].startswith("not fetched") and "LocalEntryNotFoundError" in hub["exclusion"]
    assert run_in_process(SCRIPT, *args).returncode == 0
    assert [(m["model_id"], m["skipped"]) for m in read_results(out)["models"]] == [
        ("tiny-qwen3", True), ("Qwen/Qwen3-0.6B", False)]
    proc = run_in_process(SCRIPT, "lookup", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "2 row(s): 0 PASS, 0 FAIL, 2 EXCLUDED (not failures)"


def _poisoned_copy(src: Path, dest: Path, value: float) -> Path:
    """The tiny Qwen3 with `value` (NaN or Inf) in its final norm: every logit is non-finite, and greedy
    decoding on CPU and on the device picks the same token from them."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("manifest.json"))
    tensors = load_file(str(dest / "model.safetensors"))
    tensors["model.norm.weight"][0] = value
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_nonfinite_weights_or_logits_never_pass(tmp_path, model_assets):
    """A checkpoint holding NaN or Inf makes both runs emit the same garbage token: cpu_match is true,
    and still the row is a FAIL with the reason."""
    nan = _poisoned_copy(model_assets["tiny_qwen3"], tmp_path / "nan-qwen3", float("nan"))
    inf = _poisoned_copy(model_assets["tiny_qwen3"], tmp_path / "inf-qwen3", float("inf"))
    out = tmp_path / "out"
    run_example(SCRIPT, "--models", f"{nan},{inf}", "--no_compile", "--new_tokens", "4", "--no-judge_single_core",
                "--out_dir", str(out))
    for r in rows.read_table(_only_file(out)).to_dict("records"):
        assert r["result"] == "FAIL", (r["model_id"], r["notes"])
        assert r["error"] == "non-finite weight model.norm.weight (NaN or Inf)", r["error"]


@pytest.mark.parametrize("flag, value", [
    ("core_memory_gib", "nan"), ("core_memory_gib", "inf"), ("core_memory_gib", "0"), ("core_memory_gib", "1e9"),
    ("new_tokens", "1000000000"), ("new_tokens", "0"), ("max_cores", "-1"), ("max_cores", "100000"),
    ("timeout_s", "0"), ("timeout_s", "99999999999"), ("judge_max_perplexity", "nan"), ("judge_max_perplexity", "-5"),
    ("train_lr", "nan"), ("train_lr", "0"), ("train_lr", "10"), ("train_steps", "0"), ("lnc", "3"), ("cores", "-1"),
    ("prompt", ""), ("image_prompt", "   "), ("image", "no/such/image.png")])
def test_bad_flag_values_are_refused_before_any_row(flag, value):
    """Every numeric flag is checked (finite, positive where it must be, no absurd size) before a row can be
    written: a bad flag must never become a stored verdict that reruns then skip."""
    from generate_compat_check import Config, PRESETS
    from common import cli

    with pytest.raises(UserError) as e:
        cli.parse_config(Config, PRESETS, [f"--{flag}", value], "", "offline")
    assert f"--{flag}" in str(e.value)


def test_bad_flag_value_is_one_error_line_and_no_row(tmp_path):
    for flag, value in (("--core_memory_gib", "nan"), ("--new_tokens", "1000000000")):
        proc = run_in_process(SCRIPT, "--models", "tiny-qwen3", flag, value, "--no_compile", "--out_dir",
                              str(tmp_path))
        assert_clean_error(proc, flag)
        assert proc.returncode == 2 and not list(tmp_path.glob("*.parquet"))


# --------------------------------------------------------------------------- lookup
def odd_public_files(folder: Path) -> list[Path]:
    """Files that the public schema allows or that turn up in practice: empty strings, nulls, NaN,
    float columns all null or absent, numbers and booleans stored as text or integers, timestamps as
    text, a column of another type, no model_id in a row; and one file that is not Parquet at all."""
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    base = {"model_id": "org/odd-model", "library": "transformers", "result": "FAIL", "neuronx_cc": "2.23.6484.0",
            "transformers": "5.16.0", "library_version": "5.16.0"}
    variants = {
        "empty_strings.parquet": [dict(base, error="", notes="", exclusion="", runner="", run_py="", tp=1,
                                       wall_s=1.0, hbm_peak_gb=0.5, cpu_match=False)],
        "nulls_and_nan.parquet": [dict(base, error=None, wall_s=float("nan"), hbm_peak_gb=None, tp=None,
                                       cpu_match=None, english=None),
                                  dict(base, model_id=None, result=None, wall_s=float("inf"))],
        "float_columns_all_null.parquet": pa.table({**{k: [v] * 2 for k, v in base.items()},
                                                    "wall_s": pa.nulls(2), "hbm_peak_gb": pa.nulls(2),
                                                    "hbm_capacity_gb": pa.nulls(2), "tp": pa.nulls(2)}),
        "no_optional_columns.parquet": [{"model_id": "org/minimal", "result": "PASS"}],
        "other_types.parquet": [dict(base, tp="2", wall_s="812.5", hbm_peak_gb="n/a", cpu_match="true",
                                     english=1, tested_at="2026-10-20 12:00:00", error=b"bytes error\nline 2",
                                     notes=12345, run_py=None)],
    }
    for name, content in variants.items():
        table = content if isinstance(content, pa.Table) else pa.Table.from_pylist(content)
        pq.write_table(table, folder / name)
        files.append(folder / name)
    (folder / "not_parquet.parquet").write_bytes(b"this is not a parquet file\x00\xff")
    files.append(folder / "not_parquet.parquet")
    return files


def test_lookup_survives_every_value_the_public_schema_allows(tmp_path, capsys):
    odd = tmp_path / "odd"
    odd_public_files(odd)
    code = lookup.lookup_main([str(odd), "--html", str(tmp_path / "page.html")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "Traceback" not in captured.err
    # the unreadable file is one line; every other file is still shown
    assert [line.split(" is ")[0] for line in captured.err.splitlines()] == [
        f"skipped: {odd / 'not_parquet.parquet'}"]
    lines = captured.out.splitlines()
    assert lines[-2] == "7 row(s): 1 PASS, 5 FAIL, 0 EXCLUDED (not failures)"
    assert lines[-1] == f"page: {tmp_path / 'page.html'} (7 rows)"
    df = lookup.load_results([odd])[0]
    other = df[df["source_file"].str.endswith("other_types.parquet")].iloc[0]
    assert (other["tp"], other["wall_s"], other["cpu_match"], other["english"]) == (2.0, 812.5, True, True)
    assert math.isnan(other["hbm_peak_gb"]) and other["error"].startswith("bytes error")
    assert other["tested_at"] == pd.Timestamp("2026-10-20T12:00:00Z")
    for argv in (["--name", "odd", "--task", "text-generation"], ["--compiler", "2.23"], ["--transformers", "5"]):
        assert lookup.lookup_main([str(odd), *argv]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert lookup.lookup_main([str(odd / "not_parquet.parquet")]) == 2  # nothing readable: an error
    assert capsys.readouterr().err.startswith("error: no readable results file")


def test_lookup_output_is_one_printable_line_per_row(tmp_path, capsys):
    """A model id or error holding newlines or terminal escapes cannot add lines or move the cursor."""
    path = tmp_path / "r.parquet"
    rows.write_row(path, {"model_id": "evil\x1b[2J\nPASS", "result": "FAIL", "error": "\r\n\x1b]0;title\x07boom"})
    assert lookup.lookup_main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and len(out.splitlines()) == 4  # header, the row, no shared compile cache, summary


def test_lookup_page_never_replaces_an_input_or_a_file_it_did_not_write(tmp_path):
    """--html over a results file it reads, or over any existing file that is not a page lookup wrote: one
    error line, exit 2, the file untouched. A page it wrote is replaced."""
    runs = tmp_path / "runs"
    results = runs / "r.parquet"
    rows.write_row(results, {"model_id": "org/m", "result": "PASS"})
    notes = tmp_path / "notes.html"
    notes.write_text("<!DOCTYPE html>\n<p>my own notes</p>\n")
    before = {f: f.read_bytes() for f in (results, notes)}
    for target, why in ((results, "is one of the results files this lookup reads"),
                        (notes, "exists and is not a page this lookup wrote")):
        proc = run_in_process(SCRIPT, "lookup", str(runs), "--html", str(target))
        assert proc.returncode == 2
        assert_clean_error(proc, f"--html {target} {why}")
    assert {f: f.read_bytes() for f in before} == before
    page_file = tmp_path / "page.html"
    for _ in range(2):  # a new file, then over the page it wrote
        proc = run_in_process(SCRIPT, "lookup", str(runs), "--html", str(page_file))
        assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == f"page: {page_file} (1 rows)", proc.stderr
    assert '<meta name="generator" content="qwen3-trainium-recipes compat lookup">' in page_file.read_text()


def test_lookup_page_is_never_written_through_a_fifo_or_a_link(tmp_path):
    """--html naming a FIFO (opening it would wait for a writer forever) or a symlink (to a page lookup wrote, to
    nothing): one error line before anything is read, exit 2, the FIFO and the links left as they were."""
    runs = tmp_path / "runs"
    rows.write_row(runs / "r.parquet", {"model_id": "org/m", "result": "PASS"})
    ours = tmp_path / "ours.html"
    assert run_in_process(SCRIPT, "lookup", str(runs), "--html", str(ours)).returncode == 0
    fifo, link, dangling = tmp_path / "fifo.html", tmp_path / "link.html", tmp_path / "dangling.html"
    os.mkfifo(fifo)
    link.symlink_to(ours)
    dangling.symlink_to(tmp_path / "nothing.html")
    for target, why in ((fifo, "is a FIFO, not a page this lookup wrote"),
                        (link, "is a symbolic link"), (dangling, "is a symbolic link")):
        # the FIFO in a process of its own with a time limit (a lookup that opened it would wait forever), the
        # links in this one
        proc = (run_example(SCRIPT, "lookup", str(runs), "--html", str(target), check=False, timeout=60)
                if target == fifo else run_in_process(SCRIPT, "lookup", str(runs), "--html", str(target)))
        assert proc.returncode == 2, (target, proc.stdout[-2000:], proc.stderr[-2000:])
        assert_clean_error(proc, f"--html {target} {why}")
        assert proc.stdout == ""  # refused before any work: no table
    assert fifo.is_fifo() and link.readlink() == ours and dangling.is_symlink() and not dangling.exists()


def test_page_rerun_commands_parse_with_one_parser(monkeypatch):
    """The page's Reproduce command of each row parses its run_args with the script's parser, built once: building
    it (argparse, every Config field) for each of 100,000 rows took minutes."""
    import generate_compat_check as check
    from common import cli
    from compat_check import subcommands

    built = []
    build = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda *a, **k: built.append(1) or build(*a, **k))
    df = rows.normalize(pd.DataFrame([{"model_id": f"org/m{i}", "result": "PASS",
                                       "run_args": f"--models org/m{i} --task text-generation --cores {i % 4 + 1}"}
                                      for i in range(200)] + [{"model_id": "org/bad", "run_args": "--models x; y"}]))
    data = page.page_data(df, (), [], subcommands.reruns(check.check_parser))
    commands = [r[data["columns"].index("rerun")] for r in data["rows"]]
    assert commands[7] == "python generate_compat_check.py --models org/m7 --task text-generation --cores 4"
    assert commands[-1] is None and len(set(commands)) == 201
    assert len(built) <= 1, f"the parser was built {len(built)} times for 201 rows"



def test_rerun_verdicts_are_shared_by_rows_that_differ_only_in_free_text():
    """The page parses a row's run_args once per distinct set of settings: rows differing only in the values of
    text flags (--models, --prompt) share a verdict, and every verdict equals a parse of that row's own words."""
    import shlex

    import generate_compat_check as check
    from compat_check import subcommands

    parses = []
    parser = check.check_parser()
    parse = parser.parse_args
    parser.parse_args = lambda argv: parses.append(argv) or parse(argv)
    rerun = subcommands.reruns(lambda: parser)
    fresh = check.check_parser()
    rng = random.Random(0)
    values = ["org/m", "-org", "", "a b", "x;y", "4", "--", "\t", "é", "--models", "a=b", "'q'", "\x1b[2K"]
    texts = []
    for i in range(400):
        words = ["--models", rng.choice(values) if i % 4 else f"org/model-{i}"]
        for _ in range(rng.randint(0, 3)):
            words += rng.choice([["--task", rng.choice(["text-generation", "train", "x"])], ["--no_compile"],
                                 ["--cores", rng.choice(["1", "4", "-1", "x"])], ["--prompt", rng.choice(values)],
                                 ["--device", rng.choice(["cpu", "gpu"])], ["--", rng.choice(values)]])
        texts.append(shlex.join(words) if i % 3 else " ".join(words))  # quoted, and as typed (quotes unclosed too)
    for text in texts:
        assert rerun(text) == subcommands.rerun_argv(text, fresh), text
    parses.clear()  # a page's rows: a model each, three sets of settings
    for i in range(1000):
        argv = rerun(f"--models org/model-{i} --task text-generation --cores {2 ** (i % 3)} --prompt 'Hi {i}'")
        assert argv == ["--models", f"org/model-{i}", "--task", "text-generation", "--cores", str(2 ** (i % 3)),
                        "--prompt", f"Hi {i}"]
    assert len(parses) == 3, f"{len(parses)} parses for 1000 rows of 3 settings"
    assert rerun("--models org/a --no_compile") == ["--models", "org/a", "--no_compile"]
    assert rerun("--models 'org/b' --no_compile") == ["--models", "org/b", "--no_compile"]
    assert rerun("--models -org --no_compile") is None and rerun("--models x --cores x") is None

def test_check_never_rewrites_another_scripts_results_json(tmp_path):
    """The check rewrites <out_dir>/results.json after every model: an --out_dir holding another script's is
    refused before anything runs, and that file stays."""
    other = tmp_path / "results.json"
    other.write_text(json.dumps({"script": "train_native_qwen3.py", "losses": [1.0]}) + "\n")
    before = other.read_bytes()
    proc = run_in_process(SCRIPT, "--models", "tiny-qwen3", "--no_compile", "--out_dir", str(tmp_path))
    assert proc.returncode == 2
    assert_clean_error(proc, f"--out_dir {tmp_path} holds a results.json that this script did not write "
                             "(written by train_native_qwen3.py)")
    assert other.read_bytes() == before and not list(tmp_path.glob("*.parquet"))


def test_lookup_prints_run_py_and_paths_as_printable_text(tmp_path, model_assets):
    """A carriage return or escape sequence in run_py cannot hide lines of the script users save; a path with
    a newline or an escape sequence cannot split or colour an error line or the check's own lines."""
    path = tmp_path / "r.parquet"
    run_py = "print('shown')\rimport os; os.remove('x')  # hidden\x1b[2K\n\tpass\n"
    rows.write_row(path, {"model_id": "org/m", "result": "PASS", "run_py": run_py})
    proc = run_in_process(SCRIPT, "lookup", str(path), "--run_py")
    assert proc.stdout == "print('shown')\ufffdimport os; os.remove('x')  # hidden\ufffd[2K\n\tpass\n"
    assert proc.stderr.startswith("warning: run_py holds 2 control character(s)")

    nowhere = tmp_path / "no\nwhere\x1b[31m"
    proc = run_in_process(SCRIPT, "lookup", str(nowhere))
    assert proc.returncode == 2 and "\x1b" not in proc.stderr
    assert proc.stderr.splitlines() == [f"error: {tmp_path}/no\ufffdwhere\ufffd[31m is neither a Parquet file nor "
                                        "a folder of them"]

    out = tmp_path / "out\n\x1b[31mred"  # a text model asked for image-text-to-text: EXCLUDED at once
    proc = run_in_process(SCRIPT, "--models", "tiny-qwen3", "--task", "image-text-to-text", "--out_dir", str(out))
    assert proc.returncode == 0 and "\x1b" not in proc.stdout, proc.stderr[-3000:]
    shown = str(out).replace("\n", "\ufffd").replace("\x1b", "\ufffd")
    assert [line.split()[0] for line in proc.stdout.splitlines() if shown in line] == ["[config]", "[stack]", "[done]"]


# --------------------------------------------------------------------------- plumbing, in process
def test_sizing_from_headers_and_plan(model_assets):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    tiny = model_assets["tiny_qwen3"]
    tensors = load_file(str(tiny / "model.safetensors"))
    assert sizing.weight_bytes(tiny) == sum(t.numel() * t.element_size() for t in tensors.values())
    assert sizing.weight_bytes(tiny, run_dtype_bytes=2) == sum(t.numel() * 2 for t in tensors.values())
    assert sizing.min_cores(25 * device.GIB, 24.0) == 2 and sizing.min_cores(1, 24.0) == 1

    smollm2 = AutoConfig.from_pretrained(model_assets["smollm2"])  # 9 heads, 3 key/value heads
    assert sizing.choose_plan(smollm2, 1, 16) == sizing.Plan("single", 1)
    assert sizing.choose_plan(smollm2, 2, 16) == sizing.Plan("tp", 3)  # 2 does not divide 9 heads
    assert sizing.choose_plan(smollm2, 17, 16).exclusion.startswith("needs 17 cores")
    assert "divides" in sizing.choose_plan(smollm2, 2, 16, forced_cores=2).exclusion
    moe = AutoConfig.from_pretrained(model_assets["tiny_qwen3_moe"])
    assert sizing.choose_plan(moe, 2, 16) == sizing.Plan("tp", 2)
    assert sizing.choose_plan(moe, 3, 16, sharding="ep") == sizing.Plan("ep", 4)  # 8 experts
    assert sizing.choose_plan(smollm2, 2, 16, sharding="ep").exclusion.startswith("no expert-parallel plan")
    assert sizing.choose_plan(moe, 1, 16, sharding="ep") == sizing.Plan("single", 1)  # one core is never sharded
    vl = model_assets["tiny_qwen_vl"]
    assert sizing.is_vision_language(vl) and not sizing.is_vision_language(tiny)
    assert sizing.choose_plan(AutoConfig.from_pretrained(vl), 2, 16).exclusion.startswith("no sharding plan")


def test_judge_separates_english_from_shuffled_and_repeated(model_assets):
    """Fluent English passes; the same words shuffled, gibberish, and repetition fail. Thresholds
    (judge.JudgeLimits): perplexity under the judge <= 250, unknown words (wordfreq) <= 15%,
    distinct word pairs >= 60%, at least 8 words."""
    corpus = paths.asset_dir("corpus") / "train.jsonl"
    with corpus.open() as f:  # Emma's first sentence, without the title lines above it
        first = json.loads(next(f))["text"]
    text = " ".join(first[first.index("Emma Woodhouse"):].split()[:40])
    judge = judging.EnglishJudge(model_assets["smollm2"])
    fluent = judge.judge(text)
    assert fluent["english"] is True, fluent
    words = text.split()
    random.Random(0).shuffle(words)
    shuffled = judge.judge(" ".join(words))
    assert shuffled["english"] is False and shuffled["perplexity"] > 5 * fluent["perplexity"]
    gibberish = judge.judge("vorp quil zanth ekko brimsel tav oong, drass plimmet urk zeeb fonch yarl "
                            "gristen mawp ildo quenth sarv blick ombrel")
    assert gibberish["english"] is False, gibberish
    repeated = judge.judge("the cat sat on the mat. " * 6)
    assert repeated["english"] is False and any("repetition" in r for r in repeated["reasons"])
    assert math.isfinite(fluent["perplexity"])


def test_write_row_replaces_a_model_and_unions_columns(tmp_path):
    path = tmp_path / "r.parquet"
    rows.write_row(path, {"model_id": "a", "result": "ERROR", "tp": 1})
    rows.write_row(path, {"model_id": "a", "result": "PASS", "tp": 1})  # replaces the only row (--redo)
    assert list(rows.read_table(path)["result"]) == ["PASS"]
    rows.write_row(path, {"model_id": "b", "result": "ERROR", "error": "boom"})
    rows.write_row(path, {"model_id": "a", "result": "FAIL", "tp": 2})
    df = rows.read_table(path)
    assert sorted(zip(df["model_id"], df["result"])) == [("a", "FAIL"), ("b", "ERROR")]
    # a "not fetched" row is replaced by the model's first verdict, whatever task it guessed
    rows.write_row(path, {"model_id": "c", "task": "text-generation", "result": "EXCLUDED", "unavailable": True})
    rows.write_row(path, {"model_id": "c", "task": "image-text-to-text", "result": "PASS"})
    df = rows.read_table(path)
    assert df[df["model_id"] == "c"][["task", "result"]].values.tolist() == [["image-text-to-text", "PASS"]]
    assert not list(tmp_path.glob(".*.tmp"))  # no temp file left behind


def test_bad_input_is_one_error_line(tmp_path):
    assert_clean_error(run_in_process(SCRIPT, "--cores", "20", "--out_dir", str(tmp_path)),
                       "--cores must be between 0")
    assert_clean_error(run_in_process(SCRIPT, "--models", str(tmp_path / "missing"), "--out_dir", str(tmp_path)),
                       "is not a folder")
    assert not list(tmp_path.glob("*.parquet"))


# --------------------------------------------------------------------------- hostile input
def test_flags_the_model_cannot_follow_are_refused_before_any_row(tmp_path, model_assets, monkeypatch):
    """A bad --image or a --cores that the model cannot be split over is the command line's mistake: one error line,
    exit 2, no row (a stored FAIL or EXCLUDED would make the correct rerun say "already recorded")."""
    out = tmp_path / "out"
    proc = run_in_process(SCRIPT, "--models", "tiny-qwen3", "--cores", "16", "--no_compile", "--out_dir", str(out))
    assert proc.returncode == 2
    assert_clean_error(proc, "--cores 16 cannot run tiny-qwen3: no core count in [16] divides its 4 attention")
    not_image = tmp_path / "notimage.png"
    not_image.write_text("not an image\n")
    photo = model_assets["tiny_qwen_vl"] / "photograph.png"
    cut = tmp_path / "cut.png"  # a PNG whose header opens, its pixels cut off
    cut.write_bytes(photo.read_bytes()[:2000])
    for image in (not_image, cut):
        proc = run_in_process(SCRIPT, "--models", "tiny-qwen-vl", "--image", str(image), "--no_compile", "--out_dir",
                              str(out))
        assert proc.returncode == 2
        assert_clean_error(proc, f"--image {image} is not an image Pillow can read")
    assert not list(out.glob("*.parquet"))
    # Where the machine bounds the cores (CUDA: its GPUs; Trainium: its visible NeuronCores), --cores above that
    # is refused too; CPU has no bound (a core is a gloo process).
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-3,6")
    assert sizing.machine_cores("neuron") == 5 and sizing.machine_cores("cpu") is None


def _peak_rss_mb(cmd: list[str], out: Path) -> tuple[float, str]:
    """Run `cmd`, its output to files; (peak resident memory of that process in MB, stdout). It must succeed."""
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=script_env(), stdout=stdout, stderr=stderr)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (Linux: ru_maxrss in KiB)
        proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, (out / "stderr").read_text()[-3000:]
    return usage.ru_maxrss / 1024, (out / "stdout").read_text()


def test_lookup_reads_only_what_a_view_needs(tmp_path):
    """A public-schema file of 20,000 rows, each with the usual ~20 KB run_py (dictionary-encoded: under 1 MB on
    disk). Reading every column of every row took 900 MB above the lookup's own start-up (a 200,000-row file: an
    ArrowMemoryError); --run_py reads no run_py but the one row's, and the page reads it as its one distinct
    text: tens of megabytes. Peak memory is the process's own high-water mark (no timing, no sampling)."""
    n, run_py = 20_000, "# the script that ran\n" + "x = 1  # padding to the usual size of a run_py\n" * 420
    table = pa.table({"model_id": [f"org/model-{i:06d}" for i in range(n)], "result": ["PASS", "FAIL"] * (n // 2),
                      "tp": [1] * n, "neuronx_cc": ["2.23.6484.0"] * n, "transformers": ["5.16.0"] * n,
                      "run_py": pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int32()), pa.array([run_py]))})
    big, small = tmp_path / "big.parquet", tmp_path / "small.parquet"
    pq.write_table(table, big)
    pq.write_table(table.slice(0, 2), small)
    assert big.stat().st_size < 1_000_000
    start_up, _ = _peak_rss_mb(example_command(SCRIPT, "lookup", str(small)), tmp_path)
    one_row, stdout = _peak_rss_mb(
        example_command(SCRIPT, "lookup", str(big), "--name", "model-012345", "--run_py"), tmp_path)
    assert stdout == run_py
    page_mb, stdout = _peak_rss_mb(example_command(SCRIPT, "lookup", str(big), "--html", str(tmp_path / "p.html")),
                                      tmp_path)
    assert stdout.splitlines()[-1] == f"page: {tmp_path / 'p.html'} ({n} rows)"
    assert (tmp_path / "p.html").read_text().count("padding to the usual size") == 420  # one copy of the text
    assert max(one_row, page_mb) - start_up < 250, (start_up, one_row, page_mb)


def test_lookup_and_rankings_start_without_torch(tmp_path):
    """Reading Parquet rows needs no device: with a `torch` on the path that fails on import, `lookup` (terminal and
    page) and `rankings --help` still run (torch's import alone was 2 CPU-seconds and 850 MB of a lookup's 2.5 s)."""
    shadow = tmp_path / "shadow" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('torch imported by a command that needs no device')\n")
    pq.write_table(pa.table({"model_id": ["org/a"], "result": ["PASS"], "tp": [1]}), tmp_path / "rows.parquet")
    env = dict(script_env(), PYTHONPATH=str(tmp_path / "shadow"))
    for args in (["lookup", str(tmp_path / "rows.parquet"), "--html", str(tmp_path / "p.html")],
                 ["rankings", "--help"]):
        proc = subprocess.run(example_command(SCRIPT, *args), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, (args, proc.stderr[-2000:])
        if args[0] == "lookup":  # the terminal's table, and the page
            assert proc.stdout.splitlines()[-2] == "1 row(s): 1 PASS, 0 FAIL, 0 EXCLUDED (not failures)", proc.stdout
    assert "org/a" in (tmp_path / "p.html").read_text()


def test_lookup_reads_a_spark_folder_once_and_names_duplicate_columns(tmp_path, capsys):
    """A Spark-style `x.parquet/` folder (part files, _SUCCESS, a _temporary/ attempt, .crc files) counts its
    committed part files once, whether the folder or its parent is named, or both; a file that names a column twice
    is one clear line, and the other files are still shown."""
    runs = tmp_path / "runs"
    spark = runs / "x.parquet"
    (spark / "_temporary" / "0").mkdir(parents=True)
    pq.write_table(pa.table({"model_id": ["org/a", "org/b"], "result": ["PASS", "FAIL"]}),
                   spark / "part-00000-1f2e.snappy.parquet")
    pq.write_table(pa.table({"model_id": ["org/c"], "result": ["PASS"]}),
                   spark / "_temporary" / "0" / "part-00001-1f2e.snappy.parquet")  # an attempt not committed
    (spark / "_SUCCESS").write_text("")
    (spark / ".part-00000-1f2e.snappy.parquet.crc").write_bytes(b"crc")
    for sources in ([runs], [spark], [runs, spark]):
        assert lookup.lookup_main([str(s) for s in sources]) == 0
        captured = capsys.readouterr()
        assert captured.out.splitlines()[-1] == "2 row(s): 1 PASS, 1 FAIL, 0 EXCLUDED (not failures)", sources
        assert not captured.err

    dup = tmp_path / "dup.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["org/d"]), pa.array(["PASS"]), pa.array(["FAIL"])],
                                        names=["model_id", "result", "result"]), dup)
    proc = run_in_process(SCRIPT, "lookup", str(dup))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert_clean_error(proc, f"{dup} names the column(s) 'result' more than once")
    proc = run_in_process(SCRIPT, "lookup", str(dup), str(runs))
    assert proc.returncode == 0
    assert proc.stderr.splitlines() == [f"skipped: {dup} names the column(s) 'result' more than once: a results file "
                                        "names each column once (rewrite it with one column of each name)"]
    assert proc.stdout.splitlines()[-1].startswith("2 row(s)")


# --------------------------------------------------------------------------- the public dataset's types
# The public dataset's columns and their types as its viewer reports them: tp and wall_s int32, hbm_*_gb float64,
# tested_at timestamp[ms, UTC], every other column (cpu_match and english included) a string.
PUBLIC = ("model_id", "library", "tp", "runner", "result", "notes", "error", "exclusion", "wall_s", "hbm_peak_gb",
          "hbm_capacity_gb", "cpu_match", "english", "neuronx_cc", "library_version", "transformers", "accelerate",
          "torch_neuronx", "torch", "nki", "python", "neuron_driver", "tested_at", "run_py")
PUBLIC_TYPES = {"tp": pa.int32(), "wall_s": pa.int32(), "hbm_peak_gb": pa.float64(), "hbm_capacity_gb": pa.float64(),
                "tested_at": pa.timestamp("ms", tz="UTC")}


def _public_typed_file(path: Path) -> Path:
    schema = pa.schema([(c, PUBLIC_TYPES.get(c, pa.string())) for c in PUBLIC])
    row = {"model_id": "Qwen/Qwen3-8B", "library": "transformers", "tp": 2, "runner": "tp", "result": "PASS",
           "wall_s": 812, "hbm_peak_gb": 17.9, "hbm_capacity_gb": 48.0, "cpu_match": None, "english": "true",
           "neuronx_cc": "2.28.7631.0", "library_version": "5.16.0", "transformers": "5.16.0",
           "tested_at": pd.Timestamp("2026-10-20T12:00:00.123Z").to_pydatetime(), "run_py": "print('public')\n"}
    pq.write_table(pa.Table.from_pylist([row], schema=schema), path)
    return path


def _old_file(path: Path) -> Path:
    """A file as this check wrote its rows before they took the public types: tp int64, wall_s float64, cpu_match and
    english booleans, tested_at in microseconds."""
    types = {"tp": pa.int64(), "wall_s": pa.float64(), "hbm_peak_gb": pa.float64(), "hbm_capacity_gb": pa.float64(),
             "cpu_match": pa.bool_(), "english": pa.bool_(), "tested_at": pa.timestamp("us", tz="UTC"),
             "compile_s": pa.float64(), "unavailable": pa.bool_(), "compile_graphs": pa.int64()}
    columns = (*PUBLIC, "device", "compile_s", "task", "unavailable", "compile_graphs")
    row = {"model_id": "org/old", "library": "transformers", "tp": 1, "runner": "single", "result": "PASS",
           "wall_s": 3.75, "hbm_peak_gb": 0.25, "hbm_capacity_gb": 24.0, "cpu_match": True, "english": False,
           "neuronx_cc": None, "transformers": "5.23.0", "library_version": "5.23.0",
           "tested_at": pd.Timestamp("2026-11-01T08:00:00.123456Z").to_pydatetime(), "device": "cpu",
           "compile_s": 0.0, "task": "text-generation", "compile_graphs": 2}
    pq.write_table(pa.Table.from_pylist([row], schema=pa.schema([(c, types.get(c, pa.string())) for c in columns])),
                   path)
    return path


def test_rows_take_the_public_types_and_both_forms_read(tmp_path, capsys):
    """A row written here appends to a file typed as the public dataset is, without a cast: its public columns have
    the public types (pyarrow's concat_tables with its default promotion, which fills missing columns with nulls and
    casts nothing else). What the public types drop stays in columns of ours (wall_s_precise: the measured seconds).
    Files of both forms read alike: public-typed ones, and files this check wrote with its earlier types (int64,
    float64, booleans, microseconds), which a later write converts."""
    public = _public_typed_file(tmp_path / "public.parquet")
    ours = tmp_path / "ours.parquet"
    rows.write_row(ours, {"model_id": "org/ours", "task": "text-generation", "result": "PASS", "tp": 1,
                          "wall_s": 12.625, "hbm_peak_gb": 0.5, "hbm_capacity_gb": 24.0, "cpu_match": True,
                          "english": False, "compile_graphs": 2, "unavailable": None})
    a, b = pq.read_table(public), pq.read_table(ours)
    assert [(c, str(b.schema.field(c).type)) for c in PUBLIC] == [(c, str(a.schema.field(c).type)) for c in PUBLIC]
    assert b.column_names[: len(PUBLIC)] == list(PUBLIC)
    pa.concat_tables([a, b.select(PUBLIC)])  # the public columns alone: identical schemas
    both = pa.concat_tables([a, b], promote_options="default")
    got = {r["model_id"]: r for r in both.to_pylist()}
    assert (got["org/ours"]["tp"], got["org/ours"]["wall_s"], got["org/ours"]["cpu_match"],
            got["org/ours"]["english"]) == (1, 13, "true", "false")
    assert got["org/ours"]["wall_s_precise"] == 12.625 and got["Qwen/Qwen3-8B"]["wall_s_precise"] is None

    old = _old_file(tmp_path / "old.parquet")
    before = rows.read_table(old).iloc[0]
    assert (before["tp"], before["wall_s"], before["cpu_match"], before["english"]) == (1.0, 3.75, True, False)
    rows.write_row(old, {"model_id": "org/new", "result": "PASS", "tp": 2, "wall_s": 0.4, "english": True})
    converted = pq.read_table(old)
    assert [str(converted.schema.field(c).type) for c in PUBLIC] == [str(a.schema.field(c).type) for c in PUBLIC]
    by_id = {r["model_id"]: r for r in converted.to_pylist()}
    assert (by_id["org/old"]["wall_s"], by_id["org/old"]["wall_s_precise"], by_id["org/old"]["cpu_match"]) == (
        4, 3.75, "true")
    assert by_id["org/old"]["tested_at"] == pd.Timestamp("2026-11-01T08:00:00.123Z")  # milliseconds kept
    assert str(converted.schema.field("compile_graphs").type) == "int64" and by_id["org/old"]["compile_graphs"] == 2

    for path in (public, ours, old):  # the reader: each column in one type, whichever form the file has
        df = rows.read_table(path)
        assert df["tp"].dtype == df["wall_s"].dtype == "float64" and str(df["tested_at"].dtype).endswith(", UTC]"), path
        assert set(df["cpu_match"]) <= {True, False, None} and set(df["english"]) <= {True, False, None}, path
    # the lookup's table and page: wall_s is the measured seconds where a row has them, else the whole seconds
    df = lookup.load_results([public, ours, old], lookup.FILTER_COLUMNS + ("wall_s", "cpu_match", "english"))[0]
    df = df.set_index("model_id")
    assert df.loc["Qwen/Qwen3-8B", "english"] is True and df.loc["org/ours", "cpu_match"] is True
    assert df.loc["org/ours", "english"] is False and df.loc["org/new", "english"] is True
    assert df["wall_s"].to_dict() == {"Qwen/Qwen3-8B": 812.0, "org/ours": 12.625, "org/old": 3.75, "org/new": 0.4}
    assert lookup.lookup_main([str(public), str(ours), str(old)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "4 row(s): 4 PASS, 0 FAIL, 0 EXCLUDED (not failures)"


def test_a_lock_that_is_a_link_or_a_fifo_is_refused_before_any_model(tmp_path, model_assets):
    """A results file is locked through `.<name>.lock` beside it (results.json through `.results.json.lock`). A lock
    that is a symbolic link (here to a file of the user's) or a FIFO is never followed nor opened: one error line,
    exit 2, before any model runs; the file it points to stays byte for byte."""
    user = tmp_path / "notes.txt"
    user.write_bytes(b"my own notes\n")
    out = tmp_path / "out"
    results = rows.results_file(out, rows.stack_versions())
    cases = ((results.with_name(f".{results.name}.lock"), "link"), (out / ".results.json.lock", "link"),
             (results.with_name(f".{results.name}.lock"), "fifo"))
    for lock, kind in cases:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        lock.symlink_to(user) if kind == "link" else os.mkfifo(lock)
        args = ("--models", "tiny-qwen3", "--no_compile", "--new_tokens", "2", "--no-judge_single_core", "--out_dir",
                str(out))
        # the FIFO in a process of its own with a time limit (a check that opened it would wait forever), the links
        # in this one (refused before any model: nothing launched)
        proc = (run_example(SCRIPT, *args, check=False, timeout=120) if kind == "fifo" else
                run_in_process(SCRIPT, *args))
        assert proc.returncode == 2, (lock, kind, proc.stderr[-3000:])
        assert_clean_error(proc, f"{lock} is a ")
        assert not [line for line in proc.stdout.splitlines() if line.startswith("[model]")], proc.stdout
        assert user.read_bytes() == b"my own notes\n" and not list(out.glob("*.parquet"))
        assert (lock.is_symlink() if kind == "link" else stat.S_ISFIFO(lock.lstat().st_mode))  # left as it was
