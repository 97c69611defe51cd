"""examples/generate_compat_check.py --task train: a few steps of examples/train_hf_backend.py per model, as rows of
the same Parquet file as the check's other rows. The training check runs as a subprocess (it starts a training
process per model); the check of another task (nothing loaded) and the lookup run in the test's process; the test
reads the rows.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from tools import prepare_assets as assets
from conftest import run_example, run_in_process

SCRIPT = "generate_compat_check.py"


@pytest.fixture(scope="module")
def model_assets(prepared_assets):
    return assets.prepare(["tiny_qwen3", "tiny_qwen3_moe", "smollm2"])


def tiny_llama(smollm2: Path, dest: Path) -> Path:
    """A random Llama of SmolLM2-135M-Instruct's configuration and tokenizer at the tiny Qwen3's size (2 layers,
    hidden 64, tied embeddings as SmolLM2 has them): LlamaForCausalLM, as the recipes and the check see SmolLM2,
    in seconds instead of minutes."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(smollm2)
    cfg.update({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(smollm2 / name, dest / name)
    return dest


TRAIN_STEPS = 2  # the fewest that show a falling loss


@pytest.mark.extended
def test_training_rows_beside_generation_rows(tmp_path, model_assets):
    """--task train: a few steps (--train_steps 2) of the HF-backend recipe per model, written to the same Parquet
    file as the model's rows of another task (which stay, and do not make the training skip) and found by the
    lookup. The recipe trains a Llama (a tiny random Llama of SmolLM2's configuration: a PASS row, its loss falling,
    its export re-read); a Qwen3-MoE is a FAIL with the reason. (The recipe training Qwen3 itself, a PASS row's
    other architecture: tests/test_train_hf_backend.py and the shared hf_tiny run; each row is one train_hf_backend.py
    process of the same code path, so one PASS row and one FAIL row cover the check's two outcomes.)"""
    llama = tiny_llama(model_assets["smollm2"], tmp_path / "tiny-llama")
    models = ["tiny-qwen3-moe", str(llama)]
    out = tmp_path / "out"
    # The same models checked for image-text-to-text first: text models, so each gets its row at once (EXCLUDED,
    # nothing loaded, nothing launched: in this process).
    other_task = run_in_process(SCRIPT, "--task", "image-text-to-text", "--models", ",".join(models), "--out_dir",
                                str(out))
    assert other_task.returncode == 0, other_task.stdout[-2000:] + other_task.stderr[-3000:]
    trained = run_example(SCRIPT, "--task", "train", "--models", ",".join(models), "--train_steps", str(TRAIN_STEPS),
                          "--out_dir", str(out))
    files = sorted(out.glob("*.parquet"))
    assert len(files) == 1, files
    df = pd.read_parquet(files[0])
    train = {r["model_id"]: r for r in df[df["task"] == "train"].to_dict("records")}
    other = df[df["task"] != "train"]
    assert set(train) == set(models) and sorted(other["model_id"]) == sorted(models)
    assert set(other["task"]) == {"image-text-to-text"} and set(other["result"]) == {"EXCLUDED"}
    r = train[str(llama)]  # the HF-backend recipe trains Llama
    losses = json.loads(r["train_losses"])
    assert r["result"] == "PASS" and len(losses) == TRAIN_STEPS and losses[-1] < losses[0], r["notes"]
    assert r["export_max_abs_logit_diff"] <= 1e-4 and "train_hf_backend.py" in r["run_py"]
    moe = train["tiny-qwen3-moe"]  # an architecture the recipe does not train: FAIL, with the reason
    assert moe["result"] == "FAIL" and "Qwen3MoeForCausalLM" in moe["error"]
    assert not moe["error"].startswith("error") and "error: error:" not in trained.stdout + trained.stderr, moe["error"]
    proc = run_in_process(SCRIPT, "lookup", str(out), "--task", "train")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "2 row(s): 1 PASS, 1 FAIL, 0 EXCLUDED (not failures)"
    assert "train_hf_backend" in proc.stdout
