"""examples/generate_compat_check.py on the offline preset: its four models with a broken one among them, a check
SIGKILLed after its first row and rerun, the rows it writes, and the lookup over them beside a public file.

The check runs as a subprocess, eager (--no_compile: inductor on a 2-core CPU takes about two minutes per model),
and the tests read its Parquet rows and results.json. The compile audit of the same models:
tests/test_compile_audit.py. Training rows: tests/test_compat_train.py.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from compat_check import lookup, rows
from tools import prepare_assets as assets, tiny_qwen_vl
from conftest import ROOT, kill_when, read_results, run_example, run_in_process

SCRIPT = "generate_compat_check.py"
OFFLINE = ("tiny-qwen3", "tiny-qwen3-moe", "smollm2-135m-instruct", "tiny-qwen-vl")


@pytest.fixture(scope="module")
def model_assets(prepared_assets):
    return assets.prepare(["tiny_qwen3", "tiny_qwen3_moe", "smollm2", "tiny_qwen_vl"])


def only_file(out: Path) -> Path:
    files = sorted(out.glob("*.parquet"))
    assert len(files) == 1, files
    return files[0]


def broken_copy(src: Path, dest: Path) -> Path:
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
    return what a reader then finds in the file (finished rows survive a kill)."""
    kill_when(SCRIPT, *args, ready=lambda: any(out.glob("*.parquet")), what="its first row", timeout=timeout)
    models = args[args.index("--models") + 1].split(",")
    done = read_results(out)["models"] if (out / "results.json").exists() else []  # written after each model
    assert len(done) < len(models)  # it died mid-run
    # A kill in the middle of a write leaves at most a hidden temporary file beside the last complete one (and the
    # hidden lock files that writers take turns on: rows.locked).
    assert all(f.name.endswith((".tmp", ".lock")) for f in out.iterdir() if f.name.startswith(".")), list(out.iterdir())
    return pd.read_parquet(only_file(out))


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory, model_assets):
    """The offline preset's four models, with a broken one slipped in second: it crashes in its
    worker, gets a FAIL row with its error, and the models after it still run. The first attempt
    is SIGKILLed once a row is written; the same command then skips the recorded models. Eager, without the
    compile audit (that is tests/test_compile_audit.py's)."""
    tmp = tmp_path_factory.mktemp("compat_offline")
    broken = broken_copy(model_assets["tiny_qwen3_moe"], tmp / "broken-moe")
    models = [OFFLINE[0], str(broken), *OFFLINE[1:]]
    out = tmp / "out"
    args = ("--preset", "offline", "--no_compile", "--models", ",".join(models), "--out_dir", str(out))
    # The check's workers take OMP_NUM_THREADS (1, from script_env) as torch's thread count: no OpenMP thread spins
    # waiting for a core another test process holds.
    killed = _kill_after_first_row(args, out)
    run_example(SCRIPT, *args)
    return out, args, models, killed


def test_killed_check_keeps_its_rows_and_the_rerun_skips_them(offline_run):
    out, _, models, killed = offline_run
    assert 1 <= len(killed) < len(models) and list(killed["model_id"]) == models[: len(killed)]
    assert killed.iloc[0]["result"] == "PASS" and killed.iloc[0]["run_py"]
    skipped = [(m["model_id"], m["skipped"]) for m in read_results(out)["models"]]
    assert skipped == [(m, i < len(killed)) for i, m in enumerate(models)]
    after = pd.read_parquet(only_file(out))
    kept = ["model_id", "result", "tested_at", "wall_s", "generated_text", "run_py"]  # the rerun kept the rows it found
    assert after.iloc[: len(killed)][kept].to_dict("records") == killed[kept].to_dict("records")


def test_offline_preset_rows(offline_run, capsys):
    out, _, models, _ = offline_run
    path = only_file(out)
    stack = rows.stack_versions()
    assert path.name == f"neuronx-cc-none__transformers-{stack['transformers']}.parquet"
    df = pd.read_parquet(path)  # plain pandas reads it
    from datasets import load_dataset  # and so does `datasets`, as the public dataset is read

    ds = load_dataset("parquet", data_files=str(path), split="train")
    assert ds.num_rows == len(df) and ds.column_names == list(df.columns)
    assert list(df.columns[: len(rows.PUBLIC_COLUMNS)]) == list(rows.PUBLIC_COLUMNS)
    assert list(df["model_id"]) == models  # one row per model, in the order they finished
    by_id = {r["model_id"]: r for r in df.to_dict("records")}

    crashed = by_id.pop(models[1])
    assert crashed["result"] == "FAIL" and "ignore_mismatched_sizes" in crashed["error"], crashed["error"]
    assert crashed["run_py"] and crashed["torch"] == stack["torch"] and crashed["tp"] == 1

    for model_id, r in by_id.items():
        assert r["result"] == "PASS" and r["cpu_match"] == "true", (model_id, r["notes"], r["error"])
        assert r["task"] == ("image-text-to-text" if model_id == "tiny-qwen-vl" else "text-generation")
        assert "static cache" in r["notes"] and r["compile_cache"] == "nothing compiled: eager run"
        assert "--no_compile" in r["run_args"] and json.loads(r["timings"])["reference_s"] > 0
        assert (r["tp"], r["runner"], r["device"], r["library"]) == (1, "single", "cpu", "transformers"), model_id
        assert r["wall_s_precise"] > 0 and r["wall_s"] == round(r["wall_s_precise"])  # the public type: whole seconds
        assert r["hbm_peak_gb"] > 0 and r["compile_s"] == 0.0
        assert r["hbm_capacity_gb"] == 24.0
        assert (r["torch"], r["transformers"], r["library_version"]) == (
            stack["torch"], stack["transformers"], stack["transformers"])
        assert r["tested_at"].tzinfo is not None
        # the exact source of the script that ran, byte for byte
        assert r["run_py"] == (ROOT / "examples" / SCRIPT).read_text()
    # An eager run without --compile_audit is not audited (the audit costs seconds a model): no counts, and the
    # lookup's --compiles_once, which keeps audited rows only, keeps none of them.
    for r in df.to_dict("records"):
        assert pd.isna(r["compile_graphs"]) and pd.isna(r["compile_audit"]), r["model_id"]
        assert "compile audit" not in str(r["notes"]) and "compile_audit_s" not in str(r["timings"])
    assert lookup.lookup_main([str(out), "--compiles_once"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "0 row(s): 0 PASS, 0 FAIL, 0 EXCLUDED (not failures)"

    # The offline preset also asks the judge about single-core runs: the real pretrained model
    # writes English, the random tiny models do not.
    assert by_id["smollm2-135m-instruct"]["english"] == "true", by_id["smollm2-135m-instruct"]["judge"]
    assert len(by_id["smollm2-135m-instruct"]["generated_text"].split()) >= 8
    for tiny in ("tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen-vl"):
        assert by_id[tiny]["english"] == "false"
        assert json.loads(by_id[tiny]["judge"])["reasons"]
    # image-text-to-text: the model's processor, the asset's photograph, the Qwen3 tokenizer's vision tokens
    vl = by_id["tiny-qwen-vl"]
    assert vl["prompt"] == "Describe this photograph." and tiny_qwen_vl.PHOTO_SHA256 in vl["image"]
    assert "pillow" in json.loads(vl["packages"]) and len(vl["generated_text"]) > 0
    res = read_results(out)
    assert res["files"] == [str(path)]
    assert [(m["model_id"], m["result"]) for m in res["models"]] == [
        (m, "FAIL" if m == models[1] else "PASS") for m in models]


def test_rerun_skips_recorded_models_and_keeps_the_file(offline_run):
    out, args, models, _ = offline_run
    path = only_file(out)
    before = path.read_bytes()
    proc = run_example(SCRIPT, *args)
    # nothing ran again: a [skip] line per model and no model checked (lines, not seconds: a busy machine
    # cannot fail it)
    lines = proc.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines if ln.startswith("[skip] ")] == [f"[skip] {m}" for m in models]
    assert not [ln for ln in lines if ln.startswith("[model] ")], lines
    assert path.read_bytes() == before
    assert [(m["model_id"], m["skipped"]) for m in read_results(out)["models"]] == [(m, True) for m in models]


def _public_schema_file(path: Path, marker: Path) -> None:
    """A file in the public dataset's schema and types (tp and wall_s int32, tested_at in milliseconds, cpu_match and
    english text), without the `exclusion` column (as some public files are). Its run_py would create `marker` if
    anything ever executed it."""
    run_py = f"from pathlib import Path\nPath({str(marker)!r}).write_text('executed')\n"
    public = [
        {"model_id": "Qwen/Qwen3-8B", "library": "transformers", "tp": 2, "runner": "tp", "result": "PASS",
         "notes": None, "error": None, "wall_s": 812, "hbm_peak_gb": 17.9, "hbm_capacity_gb": 48.0,
         "cpu_match": None, "english": "true", "neuronx_cc": "2.23.6484.0", "library_version": "5.16.0",
         "transformers": "5.16.0", "accelerate": "1.15.0", "torch_neuronx": "2.14.3", "torch": "2.14.0",
         "nki": "0.2.0", "python": "3.11.7", "neuron_driver": "2.25.4.0", "run_py": run_py},
        {"model_id": "Qwen/Qwen3-0.6B", "library": "transformers", "tp": 1, "runner": "single", "result": "PASS",
         "notes": None, "error": None, "wall_s": 201, "hbm_peak_gb": 2.1, "hbm_capacity_gb": 24.0,
         "cpu_match": "true", "english": None, "neuronx_cc": "2.23.6484.0", "library_version": "5.16.0",
         "transformers": "5.16.0", "accelerate": "1.15.0", "torch_neuronx": "2.14.3", "torch": "2.14.0",
         "nki": "0.2.0", "python": "3.11.7", "neuron_driver": "2.25.4.0", "run_py": run_py},
    ]
    table = pa.Table.from_pylist(public)
    table = table.cast(pa.schema([(f.name, pa.int32() if f.name in ("tp", "wall_s") else
                                   pa.string() if pa.types.is_null(f.type) else f.type) for f in table.schema]))
    ts = pa.array([pd.Timestamp("2026-10-20T12:00:00Z")] * 2, pa.timestamp("ms", tz="UTC"))
    pq.write_table(table.append_column("tested_at", ts), path)


def test_lookup_reads_ours_and_public_files(offline_run, tmp_path, capsys):
    out = offline_run[0]
    public = tmp_path / "public.parquet"
    marker = tmp_path / "executed.txt"
    _public_schema_file(public, marker)
    assert "exclusion" not in pq.read_schema(public).names

    # the script's subcommand, as the command line runs it (its __main__, in this process: it loads no model) ...
    proc = run_in_process(SCRIPT, "lookup", str(out), str(public), "--name", "QWEN3", "--task", "text-generation")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "4 row(s): 4 PASS, 0 FAIL, 0 EXCLUDED (not failures)"  # 2 tiny, 2 public rows
    assert sum("Qwen/Qwen3" in line for line in lines) == 2 and sum("tiny-qwen3" in line for line in lines) == 2
    assert "cores" in lines[0] and "wall_s" in lines[0] and "hbm_peak_gb" in lines[0]
    proc = run_in_process(SCRIPT, "lookup", str(out), "--task", "image-text-to-text")
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "1 row(s): 1 PASS, 0 FAIL, 0 EXCLUDED (not failures)"
    assert "tiny-qwen-vl" in proc.stdout and "image-text-to-text" in proc.stdout
    proc = run_in_process(SCRIPT, "lookup", str(public), "--name", "Qwen3-8B", "--run_py")
    assert proc.returncode == 0 and proc.stdout == f"from pathlib import Path\nPath({str(marker)!r}).write_text('executed')\n"
    assert not marker.exists()  # printed, never executed

    # ... and the same function in process, for the filters
    def search(*argv: str) -> tuple[int, str, str]:
        code = lookup.lookup_main([str(out), str(public), *argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, stdout, _ = search("--compiler", "2.23", "--transformers", "5.16")
    assert code == 0 and stdout.splitlines()[-1].startswith("2 row(s)") and "tiny" not in stdout
    code, stdout, _ = search("--compiler", "none", "--name", "smollm2", "--task", "text-generation")
    assert stdout.splitlines()[-1].startswith("1 row(s): 1 PASS")
    code, stdout, _ = search("--transformers", "4.")
    assert stdout.splitlines()[-1].startswith("0 row(s)")
    code, stdout, _ = search("--name", "smollm2", "--run_py", "--task", "text-generation")
    assert code == 0 and stdout == (ROOT / "examples" / SCRIPT).read_text()
    code, _, stderr = search("--name", "broken", "--run_py")  # a crashed model's row still holds its script
    assert code == 0 and not stderr
    code, _, stderr = search("--name", "qwen3", "--run_py", "--task", "text-generation")
    assert code == 2 and stderr.startswith("error: --run_py needs exactly one matching row, found 4")
    assert lookup.lookup_main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'nowhere'} is neither")
