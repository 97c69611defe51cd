"""Smoke and contract tests for examples/generate_compat_check.py and common/compat.py (issue 6).

The script runs as a subprocess on the offline models, eager (--no_compile: inductor on a 2-core CPU
takes about two minutes per model), and the tests read its Parquet rows and results.json.
"""
from __future__ import annotations

import json
import math
import random
import shutil
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common import device, paths
from compat_check import rows as compat
from tools import prepare_assets as assets
from conftest import ROOT, assert_clean_error, kill_when, read_results, run_example

SCRIPT = "generate_compat_check.py"
OFFLINE = ("tiny-qwen3", "tiny-qwen3-moe", "smollm2-135m-instruct")


@pytest.fixture(scope="module")
def model_assets(prepared_assets):
    return assets.prepare(["tiny_qwen3", "tiny_qwen3_moe", "smollm2"])


def _only_file(out: Path) -> Path:
    files = sorted(out.glob("*.parquet"))
    assert len(files) == 1, files
    return files[0]


def _broken_copy(src: Path, dest: Path) -> Path:
    """The tiny MoE's weights under a config that promises other shapes: loading fails in the worker."""
    dest.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(src / name, dest / name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def _kill_after_first_row(args: tuple, out: Path, timeout: float = 300) -> pd.DataFrame:
    """Start the check, SIGKILL it (its workers too) as soon as its Parquet file holds a row, and
    return what a reader then finds in the file (issue 8: finished rows survive a kill)."""
    kill_when(SCRIPT, *args, ready=lambda: any(out.glob("*.parquet")), what="its first row", timeout=timeout)
    models = args[args.index("--models") + 1].split(",")
    done = read_results(out)["models"] if (out / "results.json").exists() else []  # written after each model
    assert len(done) < len(models)  # it died mid-run
    # A kill in the middle of a write leaves at most a hidden temporary file beside the last complete one.
    assert all(f.name.endswith(".tmp") for f in out.iterdir() if f.name.startswith(".")), list(out.iterdir())
    return pd.read_parquet(_only_file(out))


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory, model_assets):
    """The offline preset's three models, with a broken one slipped in second: it crashes in its
    worker, gets a FAIL row with its error, and the models after it still run. The first attempt
    is SIGKILLed once a row is written; the same command then skips the recorded models."""
    tmp = tmp_path_factory.mktemp("compat_offline")
    broken = _broken_copy(model_assets["tiny_qwen3_moe"], tmp / "broken-moe")
    models = [OFFLINE[0], str(broken), *OFFLINE[1:]]
    out = tmp / "out"
    args = ("--preset", "offline", "--no_compile", "--models", ",".join(models), "--out_dir", str(out))
    start = time.perf_counter()
    killed = _kill_after_first_row(args, out)
    run_example(SCRIPT, *args)
    return out, time.perf_counter() - start, args, models, killed


def test_killed_check_keeps_its_rows_and_the_rerun_skips_them(offline_run):
    out, _, _, models, killed = offline_run
    assert 1 <= len(killed) < len(models) and list(killed["model_id"]) == models[: len(killed)]
    assert killed.iloc[0]["result"] == "PASS" and killed.iloc[0]["run_py"]
    skipped = [(m["model_id"], m["skipped"]) for m in read_results(out)["models"]]
    assert skipped == [(m, i < len(killed)) for i, m in enumerate(models)]
    after = pd.read_parquet(_only_file(out))
    kept = ["model_id", "result", "tested_at", "wall_s", "generated_text", "run_py"]  # the rerun kept the rows it found
    assert after.iloc[: len(killed)][kept].to_dict("records") == killed[kept].to_dict("records")


def test_offline_preset_rows(offline_run):
    out, _, _, models, _ = offline_run
    path = _only_file(out)
    stack = compat.stack_versions()
    assert path.name == f"neuronx-cc-none__transformers-{stack['transformers']}.parquet"
    df = pd.read_parquet(path)  # plain pandas reads it
    from datasets import load_dataset  # and so does `datasets`, as the public dataset is read

    ds = load_dataset("parquet", data_files=str(path), split="train")
    assert ds.num_rows == len(df) and ds.column_names == list(df.columns)
    assert list(df.columns[: len(compat.PUBLIC_COLUMNS)]) == list(compat.PUBLIC_COLUMNS)
    assert list(df["model_id"]) == models  # one row per model, in the order they finished
    rows = {r["model_id"]: r for r in df.to_dict("records")}

    crashed = rows.pop(models[1])
    assert crashed["result"] == "FAIL" and "ignore_mismatched_sizes" in crashed["error"], crashed["error"]
    assert crashed["run_py"] and crashed["torch"] == stack["torch"] and crashed["tp"] == 1

    for model_id, r in rows.items():
        assert r["result"] == "PASS" and bool(r["cpu_match"]) is True, (model_id, r["notes"], r["error"])
        assert (r["tp"], r["runner"], r["device"], r["library"]) == (1, "single", "cpu", "transformers"), model_id
        assert r["wall_s"] > 0 and r["hbm_peak_gb"] > 0 and r["compile_s"] == 0.0
        assert r["hbm_capacity_gb"] == 24.0
        assert (r["torch"], r["transformers"], r["library_version"]) == (
            stack["torch"], stack["transformers"], stack["transformers"])
        assert r["tested_at"].tzinfo is not None
        # the exact source of the script that ran, byte for byte
        assert r["run_py"] == (ROOT / "examples" / SCRIPT).read_text()
    # The offline preset also asks the judge about single-core runs: the real pretrained model
    # writes English, the random tiny models do not.
    assert bool(rows["smollm2-135m-instruct"]["english"]) is True, rows["smollm2-135m-instruct"]["judge"]
    assert len(rows["smollm2-135m-instruct"]["generated_text"].split()) >= 8
    for tiny in ("tiny-qwen3", "tiny-qwen3-moe"):
        assert bool(rows[tiny]["english"]) is False
        assert json.loads(rows[tiny]["judge"])["reasons"]
    res = read_results(out)
    assert res["files"] == [str(path)]
    assert [(m["model_id"], m["result"]) for m in res["models"]] == [
        (m, "FAIL" if m == models[1] else "PASS") for m in models]


def test_rerun_skips_recorded_models_and_keeps_the_file(offline_run):
    out, first_s, args, models, _ = offline_run
    path = _only_file(out)
    before = path.read_bytes()
    start = time.perf_counter()
    run_example(SCRIPT, *args)
    assert time.perf_counter() - start < first_s / 2
    assert path.read_bytes() == before
    assert [(m["model_id"], m["skipped"]) for m in read_results(out)["models"]] == [(m, True) for m in models]


def test_training_rows_beside_generation_rows(offline_run):
    """--task train (issue 9): a few steps of the HF-backend recipe per offline model, written to the
    same Parquet file as the generation rows and found by the lookup. Runs after the rerun test
    (which expects the file unchanged)."""
    out, _, _, _, _ = offline_run
    models = OFFLINE  # every offline model: Qwen3, Qwen3-MoE, Llama (SmolLM2, about 90 s of it)
    run_example(SCRIPT, "--task", "train", "--models", ",".join(models), "--out_dir", str(out))
    df = pd.read_parquet(_only_file(out))
    train = {r["model_id"]: r for r in df[df["task"] == "train"].to_dict("records")}
    assert set(train) == set(models) and set(df[df["task"] == "generate"]["model_id"]) >= set(OFFLINE)
    for model_id in ("tiny-qwen3", "smollm2-135m-instruct"):  # the HF-backend recipe trains Qwen3 and Llama
        r = train[model_id]
        losses = json.loads(r["train_losses"])
        assert r["result"] == "PASS" and len(losses) == 4 and losses[-1] < losses[0], (model_id, r["notes"])
        assert r["export_max_abs_logit_diff"] <= 1e-4 and "train_hf_backend.py" in r["run_py"]
    moe = train["tiny-qwen3-moe"]  # an architecture the recipe does not train: FAIL, with the reason
    assert moe["result"] == "FAIL" and "Qwen3MoeForCausalLM" in moe["error"]
    proc = run_example(SCRIPT, "lookup", str(out), "--task", "train")
    assert proc.stdout.splitlines()[-1] == "3 row(s)" and "train_hf_backend" in proc.stdout


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
    run_example(SCRIPT, "--models", models, "--cores", "2", "--no_compile", "--out_dir", str(out),
                "--timeout_s", "300")
    rows = {Path(r["model_id"]).name: r for r in pd.read_parquet(_only_file(out)).to_dict("records")}
    assert len(rows) == 3

    sharded = rows["tiny-qwen3-moe"]  # qwen3_moe has a TP plan: tensor parallel over 2 gloo processes
    assert (sharded["tp"], sharded["runner"], sharded["hbm_capacity_gb"]) == (2, "tp", 48.0)
    assert sharded["cpu_match"] is None or pd.isna(sharded["cpu_match"])  # not a single-core run
    verdict = json.loads(sharded["judge"])
    assert sharded["english"] == verdict["english"] is False  # random weights: honest FAIL
    assert sharded["result"] == "FAIL" and verdict["reasons"]
    assert sharded["wall_s"] > 0 and sharded["hbm_peak_gb"] > 0

    no_plan = rows["gpt2-tiny"]
    assert no_plan["result"] == "EXCLUDED" and no_plan["exclusion"].startswith("no sharding plan"), no_plan

    refused = rows["remote-code"]
    assert refused["result"] == "EXCLUDED" and "--trust_remote_code" in refused["exclusion"]
    assert not (tmp_path / "remote-code" / "modeling_evil.py").exists()


def test_timeout_gives_an_error_row_and_the_next_model_runs(tmp_path, model_assets):
    out = tmp_path / "out"
    start = time.perf_counter()
    proc = run_example(SCRIPT, "--models", "tiny-qwen3,tiny-qwen3-moe", "--cores", "2", "--timeout_s", "3",
                       "--no_compile", "--out_dir", str(out))
    assert time.perf_counter() - start < 120  # two 3-second limits and start-up, not two full runs
    rows = {r["model_id"]: r for r in pd.read_parquet(_only_file(out)).to_dict("records")}
    for model_id in ("tiny-qwen3", "tiny-qwen3-moe"):  # the second ran (and timed out) after the first
        assert rows[model_id]["result"] == "FAIL" and "timed out after 3 s" in rows[model_id]["error"]
    assert proc.stdout.count("[model]") == 2


# --------------------------------------------------------------------------- lookup
def _public_schema_file(path: Path, marker: Path) -> None:
    """A file in the public dataset's schema, without the `exclusion` column (as some public files are).
    Its run_py would create `marker` if anything ever executed it."""
    run_py = f"from pathlib import Path\nPath({str(marker)!r}).write_text('executed')\n"
    rows = [
        {"model_id": "Qwen/Qwen3-8B", "library": "transformers", "tp": 2, "runner": "tp", "result": "PASS",
         "notes": None, "error": None, "wall_s": 812.5, "hbm_peak_gb": 17.9, "hbm_capacity_gb": 48.0,
         "cpu_match": None, "english": True, "neuronx_cc": "2.23.6484.0", "library_version": "5.16.0",
         "transformers": "5.16.0", "accelerate": "1.15.0", "torch_neuronx": "2.14.3", "torch": "2.14.0",
         "nki": "0.2.0", "python": "3.11.7", "neuron_driver": "2.25.4.0", "run_py": run_py},
        {"model_id": "Qwen/Qwen3-0.6B", "library": "transformers", "tp": 1, "runner": "single", "result": "PASS",
         "notes": None, "error": None, "wall_s": 201.0, "hbm_peak_gb": 2.1, "hbm_capacity_gb": 24.0,
         "cpu_match": True, "english": None, "neuronx_cc": "2.23.6484.0", "library_version": "5.16.0",
         "transformers": "5.16.0", "accelerate": "1.15.0", "torch_neuronx": "2.14.3", "torch": "2.14.0",
         "nki": "0.2.0", "python": "3.11.7", "neuron_driver": "2.25.4.0", "run_py": run_py},
    ]
    table = pa.Table.from_pylist(rows)
    ts = pa.array([pd.Timestamp("2026-10-20T12:00:00Z")] * 2, pa.timestamp("us", tz="UTC"))
    pq.write_table(table.append_column("tested_at", ts), path)


def test_lookup_reads_ours_and_public_files(offline_run, tmp_path, capsys):
    out = offline_run[0]
    public = tmp_path / "public.parquet"
    marker = tmp_path / "executed.txt"
    _public_schema_file(public, marker)
    assert "exclusion" not in pq.read_schema(public).names

    # the script's subcommand, once as a subprocess ...
    proc = run_example(SCRIPT, "lookup", str(out), str(public), "--name", "QWEN3", "--task", "generate")
    lines = proc.stdout.splitlines()
    assert lines[-1] == "4 row(s)"  # tiny-qwen3, tiny-qwen3-moe, and the two public rows
    assert sum("Qwen/Qwen3" in line for line in lines) == 2 and sum("tiny-qwen3" in line for line in lines) == 2
    assert "cores" in lines[0] and "wall_s" in lines[0] and "hbm_peak_gb" in lines[0]
    proc = run_example(SCRIPT, "lookup", str(public), "--name", "Qwen3-8B", "--run_py")
    assert proc.stdout == f"from pathlib import Path\nPath({str(marker)!r}).write_text('executed')\n"
    assert not marker.exists()  # printed, never executed

    # ... and the same function in process, for the filters
    def lookup(*argv: str) -> tuple[int, str, str]:
        code = compat.lookup_main([str(out), str(public), *argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, stdout, _ = lookup("--compiler", "2.23", "--transformers", "5.16")
    assert code == 0 and stdout.splitlines()[-1] == "2 row(s)" and "tiny" not in stdout
    code, stdout, _ = lookup("--compiler", "none", "--name", "smollm2", "--task", "generate")
    assert stdout.splitlines()[-1] == "1 row(s)" and "PASS" in stdout
    code, stdout, _ = lookup("--transformers", "4.")
    assert stdout.splitlines()[-1] == "0 row(s)"
    code, stdout, _ = lookup("--name", "smollm2", "--run_py", "--task", "generate")
    assert code == 0 and stdout == (ROOT / "examples" / SCRIPT).read_text()
    code, _, stderr = lookup("--name", "broken", "--run_py")  # a crashed model's row still holds its script
    assert code == 0 and not stderr
    code, _, stderr = lookup("--name", "qwen3", "--run_py", "--task", "generate")
    assert code == 2 and stderr.startswith("error: --run_py needs exactly one matching row, found 4")
    assert compat.lookup_main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'nowhere'} is neither")


# --------------------------------------------------------------------------- plumbing, in process
def test_sizing_from_headers_and_plan(model_assets):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    tiny = model_assets["tiny_qwen3"]
    tensors = load_file(str(tiny / "model.safetensors"))
    assert compat.weight_bytes(tiny) == sum(t.numel() * t.element_size() for t in tensors.values())
    assert compat.weight_bytes(tiny, run_dtype_bytes=2) == sum(t.numel() * 2 for t in tensors.values())
    assert compat.min_cores(25 * device.GIB, 24.0) == 2 and compat.min_cores(1, 24.0) == 1

    smollm2 = AutoConfig.from_pretrained(model_assets["smollm2"])  # 9 heads, 3 key/value heads
    assert compat.choose_plan(smollm2, 1, 16) == compat.Plan("single", 1)
    assert compat.choose_plan(smollm2, 2, 16) == compat.Plan("tp", 3)  # 2 does not divide 9 heads
    assert compat.choose_plan(smollm2, 17, 16).exclusion.startswith("needs 17 cores")
    assert "divides" in compat.choose_plan(smollm2, 2, 16, forced_cores=2).exclusion
    moe = AutoConfig.from_pretrained(model_assets["tiny_qwen3_moe"])
    assert compat.choose_plan(moe, 2, 16) == compat.Plan("tp", 2)
    assert compat.choose_plan(moe, 3, 16, sharding="ep") == compat.Plan("ep", 4)  # 8 experts
    assert compat.choose_plan(smollm2, 2, 16, sharding="ep").exclusion.startswith("no expert-parallel plan")
    assert compat.choose_plan(moe, 1, 16, sharding="ep") == compat.Plan("single", 1)  # one core is never sharded


def test_judge_separates_english_from_shuffled_and_repeated(model_assets):
    """Fluent English passes; the same words shuffled, gibberish, and repetition fail. Thresholds
    (compat.JudgeLimits): perplexity under the judge <= 250, unknown words (wordfreq) <= 15%,
    distinct word pairs >= 60%, at least 8 words."""
    corpus = paths.corpus_dir() / "train.jsonl"
    with corpus.open() as f:  # Emma's first sentence, without the title lines above it
        first = json.loads(next(f))["text"]
    text = " ".join(first[first.index("Emma Woodhouse"):].split()[:40])
    judge = compat.EnglishJudge(model_assets["smollm2"])
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
    compat.write_row(path, {"model_id": "a", "result": "ERROR", "tp": 1})
    compat.write_row(path, {"model_id": "a", "result": "PASS", "tp": 1})  # replaces the only row (--redo)
    assert list(compat.read_table(path)["result"]) == ["PASS"]
    compat.write_row(path, {"model_id": "b", "result": "ERROR", "error": "boom"})
    compat.write_row(path, {"model_id": "a", "result": "FAIL", "tp": 2})
    df = compat.read_table(path)
    assert sorted(zip(df["model_id"], df["result"])) == [("a", "FAIL"), ("b", "ERROR")]
    assert not list(tmp_path.glob(".*.tmp"))  # no temp file left behind


def test_bad_input_is_one_error_line(tmp_path):
    assert_clean_error(run_example(SCRIPT, "--cores", "20", "--out_dir", str(tmp_path), check=False),
                       "--cores must be between 0")
    assert_clean_error(run_example(SCRIPT, "--models", str(tmp_path / "missing"), "--out_dir", str(tmp_path),
                                   check=False), "is not a folder")
    assert not list(tmp_path.glob("*.parquet"))
