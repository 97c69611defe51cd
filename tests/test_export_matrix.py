"""The HF export of every model family the scripts train, each trained 2 steps through the real CLI,
checked here independently of the scripts' own export check:
  - tied dense: the tiny Qwen3 preset of train_native_qwen3.py (embedding and lm_head shared; the
    10-step run the script's own tests read, conftest.SHARED_RUNS);
  - odd dense: a seeded transformers Qwen3 with head_dim (24) != hidden / heads (16), one KV head,
    untied embeddings, RoPE theta 5e5 and RMSNorm eps 1e-5, trained with --hf_checkpoint on a folder of JSON lines
    (--dataset); its export holds exactly the source's tensors, each of its shape;
  - reduced MoE: train_moe_nki.py at the AWS guide's reduced routing (4 layers, 64 experts, top-4) with a
    small hidden size.
For each: the safetensors headers (no zero-length or empty entry, offsets inside the file), the index
(covers every stored key, names only files that exist, and every file is named), config.json and the
tokenizer files, then `AutoModelForCausalLM.from_pretrained` in a fresh process: float32 logits
within 1e-5 of the trained model's (OUT_DIR/export_reference.safetensors, written by the script
from the trained torchtitan model before the export)."""
from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import pytest

from conftest import ROOT, read_results, run_example, run_python, script_env

TOL = 1e-5  # float32 on both sides
NAMES = ("tied_dense", "odd_dense", "reduced_moe")
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
ODD = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 24, "num_key_value_heads": 1,
       "intermediate_size": 96, "num_hidden_layers": 2, "rope_theta": 5e5, "rms_norm_eps": 1e-5,
       "tie_word_embeddings": False}


def _save_odd_qwen3(folder: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from common import paths

    cfg = Qwen3Config(vocab_size=151936, max_position_embeddings=1024,
                      rope_parameters={"rope_type": "default", "rope_theta": ODD["rope_theta"]},
                      **{k: v for k, v in ODD.items() if k != "rope_theta"})
    torch.manual_seed(7)
    Qwen3ForCausalLM(cfg).float().save_pretrained(folder)
    for name in TOKENIZER:
        shutil.copy2(paths.asset_dir("tokenizer") / name, folder / name)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, prepared_assets, shared_run):
    """Training runs through the scripts' CLIs (the tied one shared, two of 2 steps), then one fresh
    process that re-reads the three exports with transformers."""
    root = tmp_path_factory.mktemp("export_matrix")
    src = root / "odd_src"
    _save_odd_qwen3(src)
    data = root / "data"  # --dataset also takes any folder of JSON lines with a text field
    data.mkdir()
    (data / "part-0.jsonl").write_text("".join(
        json.dumps({"text": f"Document {i}: the quick brown fox jumps over the lazy dog. " * 20}) + "\n"
        for i in range(20)))
    runs = {
        "odd_dense": ("train_native_qwen3.py", "--hf_checkpoint", str(src), "--dataset", str(data)),
        "reduced_moe": ("train_moe_nki.py", "--preset", "tiny", "--num_layers", "4", "--num_experts", "64",
                        "--top_k", "4"),
    }
    folders, results = {}, {}
    folders["tied_dense"], results["tied_dense"] = shared_run("native_tiny")
    for name, (script, *args) in runs.items():
        folders[name] = root / name
        run_example(script, *args, "--steps", "2", "--out_dir", str(folders[name]))
        results[name] = read_results(folders[name])
    reread = root / "reread.json"
    cmd = [sys.executable, str(Path(__file__)), str(reread), str(src), *[f"{name}={folders[name]}" for name in NAMES]]
    env = {**script_env(), "OMP_NUM_THREADS": "1"}  # a second thread only spins on a shared 2-core machine
    proc = run_python(cmd, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folders, results, json.loads(reread.read_text())


def _header(path: Path) -> dict:
    """The raw safetensors header, with the file's size."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return {"entries": header, "data_bytes": len(raw) - 8 - n}


@pytest.mark.parametrize("name", NAMES)
def test_safetensors_headers_and_index(exports, name):
    folders, _results, _reread = exports
    folder = folders[name] / "hf_export"
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert files, f"no safetensors in {folder}"
    sizes = {"F32": 4, "BF16": 2, "F16": 2}
    stored: dict[str, str] = {}
    for f in files:
        h = _header(folder / f)
        assert h["entries"], f"{f}: empty header"
        spans = []
        for key, t in h["entries"].items():
            numel = 1
            for dim in t["shape"]:
                numel *= dim
            begin, end = t["data_offsets"]
            assert numel > 0 and end > begin, f"{f}: {key} is empty ({t['shape']})"
            assert t["dtype"] == "F32", f"{f}: {key} is {t['dtype']} (float32 export expected)"
            assert end - begin == numel * sizes[t["dtype"]], f"{f}: {key} spans {end - begin} bytes"
            assert key not in stored, f"{key} stored twice ({stored.get(key)}, {f})"
            stored[key] = f
            spans.append((begin, end))
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == h["data_bytes"], f"{f}: data does not fill the file"
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), f"{f}: gaps or overlaps between tensors"
    index_files = list(folder.glob("*.safetensors.index.json"))
    assert len(index_files) == 1 or (not index_files and len(files) == 1), index_files
    if index_files:
        weight_map = json.loads(index_files[0].read_text())["weight_map"]
        assert weight_map == stored  # every stored key, in the file that holds it, and nothing else
        assert set(weight_map.values()) == set(files)  # names only existing files, and all of them


@pytest.mark.parametrize("name", NAMES)
def test_config_tokenizer_and_logits(exports, name):
    folders, results, reread = exports
    folder = folders[name] / "hf_export"
    assert results[name]["export_check"]["passed"] is True, results[name]["export_check"]
    for f in ("config.json", *TOKENIZER):
        assert (folder / f).is_file() and (folder / f).stat().st_size > 0, f
    r = reread[name]
    assert r["missing_keys"] == [] and r["unexpected_keys"] == []
    assert r["max_abs_logit_diff"] <= TOL, r
    assert r["logits_shape"][-1] == 151936 and r["logits_shape"][1] >= 8


def test_tied_export_is_tied(exports):
    _folders, _results, reread = exports
    assert reread["tied_dense"]["tied"] is True and reread["tied_dense"]["lm_head_in_file"] is False
    assert reread["odd_dense"]["tied"] is False and reread["odd_dense"]["lm_head_in_file"] is True


def test_odd_shape_survives_the_round_trip(exports):
    """Every non-default setting of the odd model is in the exported config.json, the weights moved
    in training, and the comparison can fail: the same export read with the default RoPE theta
    gives logits far outside the tolerance."""
    folders, _results, reread = exports
    cfg = json.loads((folders["odd_dense"] / "hf_export" / "config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "head_dim", "num_key_value_heads", "intermediate_size",
                "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings"):
        assert cfg[key] == ODD[key], key
    assert cfg["rope_parameters"]["rope_theta"] == ODD["rope_theta"]
    r = reread["odd_dense"]
    assert r["max_weight_change_from_source"] > 1e-4  # trained, not a copy of the source
    assert r["max_abs_logit_diff_default_rope_theta"] > 100 * TOL


def test_odd_shape_exports_exactly_the_source_tensors_after_training_on_a_folder_of_json_lines(exports):
    """The odd model trained on --dataset FOLDER (the run's record names that folder): its export holds the source's
    tensors, no more and no fewer, each of the source's shape and dtype (untied: lm_head.weight among them)."""
    from safetensors import safe_open

    folders, _results, _reread = exports
    record = json.loads((folders["odd_dense"] / "checkpoint" / "run.json").read_text())  # what a resume compares
    assert str(folders["odd_dense"].parent / "data") in record["dataset"], record["dataset"]

    def tensors(folder: Path) -> dict:
        out = {}
        for f in folder.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                out.update({k: (st.get_slice(k).get_shape(), st.get_slice(k).get_dtype()) for k in st.keys()})
        return out

    source, exported = tensors(folders["odd_dense"].parent / "odd_src"), tensors(folders["odd_dense"] / "hf_export")
    assert exported == source and "lm_head.weight" in source


def test_moe_export_routing_shape(exports):
    folders, results, reread = exports
    cfg = json.loads((folders["reduced_moe"] / "hf_export" / "config.json").read_text())
    assert (cfg["architectures"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["num_hidden_layers"]) == \
        (["Qwen3MoeForCausalLM"], 64, 4, 4)
    assert reread["reduced_moe"]["architecture"] == "Qwen3MoeForCausalLM"
    assert len(results["reduced_moe"]["expert_load"]) == 64


# ------------------------------------------------------------------ the re-read, in a fresh process
def _reread(export_dir: Path, source: Path | None = None) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    ref = load_file(str(export_dir.parent / "export_reference.safetensors"))
    model, info = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32, output_loading_info=True)
    model.eval()
    with torch.no_grad():
        logits = model(ref["input_ids"], position_ids=ref["position_ids"]).logits.float()
    stored = set()
    for f in export_dir.glob("*.safetensors"):
        stored |= set(load_file(str(f)))
    out = {"architecture": type(model).__name__,
           "missing_keys": sorted(info["missing_keys"]), "unexpected_keys": sorted(info["unexpected_keys"]),
           "max_abs_logit_diff": float((logits - ref["logits"].float()).abs().max()),
           "logits_shape": list(logits.shape), "lm_head_in_file": "lm_head.weight" in stored,
           "tied": model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()}
    if source is not None:
        src = load_file(str(source / "model.safetensors"))
        trained = {k: v for f in export_dir.glob("*.safetensors") for k, v in load_file(str(f)).items()}
        out["max_weight_change_from_source"] = max(float((trained[k] - v).abs().max()) for k, v in src.items())
        cfg = AutoConfig.from_pretrained(export_dir)
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1_000_000.0}
        wrong = AutoModelForCausalLM.from_pretrained(export_dir, config=cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            wrong_logits = wrong(ref["input_ids"], position_ids=ref["position_ids"]).logits.float()
        out["max_abs_logit_diff_default_rope_theta"] = float((wrong_logits - ref["logits"].float()).abs().max())
    return out


if __name__ == "__main__":  # python tests/test_export_matrix.py OUT.json ODD_SOURCE NAME=RUN_DIR...
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    out_json, odd_source = Path(sys.argv[1]), Path(sys.argv[2])
    run_dirs = {name: Path(d) for name, d in (a.split("=", 1) for a in sys.argv[3:])}
    checks = {name: _reread(d / "hf_export", odd_source if name == "odd_dense" else None) for name, d in run_dirs.items()}
    out_json.write_text(json.dumps(checks, indent=1))
