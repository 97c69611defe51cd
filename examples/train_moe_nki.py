# Copy with this file the core (it trains and exports):
#   common/__init__.py common/errors.py common/cli.py common/device.py common/paths.py common/results.py
#   common/checkpoint.py common/losses.py common/export.py common/torchtitan_fixes.py common/recipe.py
#   common/trainer.py common/processes.py
#   common/kernels/ (the whole folder: the RoPE and grouped-expert ops, their NKI branches, registry entries)
# and the harness, for the guards (preflight, out_dir lock, resume, stop signals, self-launch, dry run, pilot
# report, held-out eval, the export verifier):
#   common/harness/ (the whole folder)
# With the core alone, the entry is the core's: change the `run` import below to
#   from common.recipe import run_core as run
"""Train a reduced Qwen3-30B-A3B whose MoE blocks, attention and RoPE are kernel-backed replacements.

The third path of the AWS guide: Qwen3-30B-A3B cut to 4 layers and 64 experts (top_k 4) so
it fits one trn2 instance, data parallel over all ranks, tensor parallel 1, no expert parallel,
eager. Three modules are swapped through torchtitan's own override registry (one log line each):
  - routed experts -> `OpRoutedExperts` (common/kernels/moe_module.py): one custom op groups the tokens by
    expert, runs the expert MLPs and saves the routing tables and activations its backward op
    reuses; nki-library's blockwise MoE kernels on Trainium, PyTorch elsewhere;
  - FlexAttention -> `SDPADocumentAttention` (common/torchtitan_fixes.py): causal + packed-document masking;
  - CosSinRoPE -> `NKIRoPE` (common/kernels/rope_module.py): the gather-free RoPE op (nki-library rope_hf).
The expert count is a model setting (64 experts live on every rank), not a number of devices.

CPU (the default preset, `tiny`: the same structure scaled down, 2 layers, 16 experts, top_k 4,
the real 151,936-token vocabulary and Qwen3 tokenizer, offline English):
    python examples/train_moe_nki.py --steps 10 --out_dir runs/moe
    torchrun --nproc_per_node 2 examples/train_moe_nki.py --out_dir runs/moe2    # FSDP over gloo
    python examples/train_moe_nki.py --stock --out_dir runs/moe_stock              # torchtitan's own MoE and RoPE

One trn2.48xlarge (64 logical NeuronCores at LNC=2):
    python examples/train_moe_nki.py --preset qwen3_30b_a3b_reduced --nproc_per_node 64 \
        --dataset_path /path/to/torchtitan/tests/assets/c4_test

Routing and the HF export: torchtitan's load-balancing bias (`expert_bias`) steers routing but is
not part of the HF format, so an export of a model trained with it routes differently. The presets
train without it (`--load_balance_coeff 0`), so the export routes exactly as the trained model;
with it on, results.json reports the bias and the export check shows how far the logits move.

Expected (tiny, 10 steps, 2-core CPU, about a minute): loss falls from about 11.95; results.json
has `losses`, `tokens_per_s`, `replacements` (attention, RoPE and routed experts of every layer),
`expert_load` (tokens per expert, summed over layers and ranks), `export_dir`, `export_check`
with no missing or unexpected keys and max_abs_logit_diff below 1e-5 (float32 experts); loss.png.
With --stock --expert_dtype bfloat16 on both sides, the first 3 losses agree within 1e-4.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python examples/...` finds common/

from common import checkpoint, cli, device, paths  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.harness.lifecycle import run  # noqa: E402  the guarded run (the core alone: see the header)
from common.recipe import Inputs, Recipe, TrainConfig, apply_settings  # noqa: E402


# Qwen3-30B-A3B as published (config.json of Qwen/Qwen3-30B-A3B): the shape every preset cuts from.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "max_position_embeddings": 40960, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}
TINY_MOE = {**QWEN3_30B_A3B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_experts": 16, "num_experts_per_tok": 4,
            "moe_intermediate_size": 32, "max_position_embeddings": 4096}


@dataclass
class Config(TrainConfig):
    model: Literal["tiny", "qwen3_30b_a3b"] = field(
        default="tiny", metadata={"help": "shape to cut from: 'tiny' or the published Qwen3-30B-A3B"})
    num_layers: int = field(default=2, metadata={"help": "decoder layers kept", **cli.bounds(1, 256)})
    num_experts: int = field(
        default=16, metadata={"help": "routed experts per MoE layer (a model setting, not a device count)",
                              **cli.bounds(1, 1024, why="Qwen3-30B-A3B has 128")})
    top_k: int = field(default=4, metadata={"help": "experts per token", **cli.bounds(1, 1024)})
    hf_checkpoint: str | None = field(default=None, metadata={
        "help": "initial weights: an HF Qwen3-MoE folder; its config.json sets the shape (--model, --num_layers, "
                "--num_experts and --top_k are not used)"})
    out_dir: str = field(default="runs/moe_nki", metadata={"help": "results.json, loss.png, hf_export/ go here"})
    seq_len: int = field(default=128, metadata={
        "help": "tokens per sequence (a multiple of 128 x LNC on Trainium)",
        **cli.bounds(8, 2**18, multiple_of=8, why="torchtitan's chunked loss splits each sequence into 8")})
    expert_dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata={
        "help": "expert matmul dtype in the grouped-expert op (torchtitan's stock experts: bfloat16)"})
    stock: bool = field(default=False, metadata={
        "help": "keep torchtitan's own MoE and RoPE (attention stays SDPA off CUDA): the baseline"})
    rope_layers: str = field(default="*", metadata={
        "help": "fnmatch glob of the RoPE modules to replace ('*layers.1.*': layer 1 only)"})
    load_balance_coeff: float = field(default=0.0, metadata={
        "help": "torchtitan's bias-based load balancing (0: off, so the HF export routes identically)",
        **cli.bounds(0.0, 1.0)})
    hf_assets: str | None = field(
        default=None, metadata={"help": "HF folder with the tokenizer (default: the Qwen3 tokenizer from set-up)"})

    def validate(self) -> None:
        if self.export_tolerance is None and self.dtype == "float32" and (self.stock or self.expert_dtype != "float32"):
            self.export_tolerance = 1e-3  # bfloat16 expert matmuls against transformers' float32: measured 1.1e-4
        super().validate()
        if self.top_k > self.num_experts:
            raise UserError(f"--top_k {self.top_k} is larger than --num_experts {self.num_experts}")


def tiny() -> Config:
    """CPU default: 2 layers, 16 experts, top_k 4, real vocabulary, offline English, float32."""
    return Config()


def qwen3_30b_a3b_reduced() -> Config:
    """trn2.48xlarge as in the AWS guide: Qwen3-30B-A3B dimensions, 4 layers, 64 experts, top_k 4, DP over all ranks."""
    return replace(Config(), model="qwen3_30b_a3b", num_layers=4, num_experts=64, top_k=4, device="neuron",
                   dtype="bfloat16", expert_dtype="bfloat16", local_batch_size=1, seq_len=4096, lr=8e-4,
                   dataset="c4_test", hf_assets="assets/hf/Qwen3-30B-A3B")


def qwen3_30b_a3b_reduced_stock_tp4() -> Config:
    """The reduced preset as Neuron 2.34's MoE recipes run: torchtitan's own MoE (torch._grouped_mm) and attention at
    tensor parallel 4 x FSDP 16 (the torch-neuronx v2.34.0 release notes, github.com/aws-neuron/torch-neuronx/releases/
    tag/v2.34.0); on the 2.34 stack (requirements-trn2-2.34.txt)."""
    return replace(qwen3_30b_a3b_reduced(), stock=True, tensor_parallel_degree=4)


PRESETS = {"tiny": tiny, "qwen3_30b_a3b_reduced": qwen3_30b_a3b_reduced,
           "qwen3_30b_a3b_reduced_stock_tp4": qwen3_30b_a3b_reduced_stock_tp4}
HF_MODEL_ID = {"qwen3_30b_a3b_reduced": "Qwen/Qwen3-30B-A3B",  # its tokenizer goes into hf_assets on trn2
               "qwen3_30b_a3b_reduced_stock_tp4": "Qwen/Qwen3-30B-A3B"}
PUBLISHED_PARAMS = 30.5e9  # Qwen3-30B-A3B model card: 30.5 B parameters in total (3.3 B activated)


def model_shape(cfg: Config) -> dict:
    """The config.json of the model this run trains: the checkpoint's, or the base shape cut."""
    if cfg.hf_checkpoint:
        return checkpoint.read_hf_config(cfg.hf_checkpoint)
    base = TINY_MOE if cfg.model == "tiny" else QWEN3_30B_A3B
    return {**base, "num_hidden_layers": cfg.num_layers, "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.top_k}


def replacement_imports(cfg: Config, dev) -> list:
    """torchtitan `override.imports`: what the trainer swaps before it builds the model."""
    from common.kernels import rope_module

    # FlexAttention has no backward off CUDA
    imports = [("common.torchtitan_fixes.sdpa_document_attention", {"document_mask": cfg.document_mask})]
    if not cfg.stock:
        imports += [
            ("common.kernels.moe_module.grouped_experts_op", {"compute_dtype": cfg.expert_dtype}),
            (rope_module.register(cfg.rope_layers),
             {"lnc": cfg.lnc, "check_kernel_shape": dev.device_type == "neuron"}),
        ]
    return imports



def check_inputs(cfg: Config) -> Inputs:
    """The tokenizer, the HF checkpoint to start from, and on Trainium the kernels' shape rules: seconds, before
    any runtime starts."""
    shape = model_shape(cfg)
    if not cfg.stock and device.resolve_device_type(cfg.device) == "neuron":
        import torch
        from common.kernels import moe_nki

        moe_nki.check_training_shapes(seq_len=cfg.seq_len, head_dim=shape["head_dim"], hidden=shape["hidden_size"],
                                      # tensor parallel: each rank's experts hold a slice of the intermediate size
                                      inter=shape["moe_intermediate_size"] // cfg.tensor_parallel_degree,
                                      lnc=cfg.lnc, compute_dtype=getattr(torch, cfg.expert_dtype))
    hint = f" (download {HF_MODEL_ID[cfg.preset]} there first)" if cfg.preset in HF_MODEL_ID else ""
    found = Inputs(tokenizer_dir=checkpoint.check_tokenizer(cfg.hf_assets or paths.asset_dir("tokenizer"), hint),
                   shape=shape)
    if cfg.hf_checkpoint:
        checkpoint.validate_hf_checkpoint(cfg.hf_checkpoint, checkpoint.QWEN3_MOE)
        found.hf_folder = found.initial_hf = Path(cfg.hf_checkpoint).resolve()
    return found


def stack_options(cfg: Config) -> dict:
    """The preflight checks the kernel launch this torch-neuronx needs."""
    from common.kernels.rope_op import NKI_LAUNCH

    return {"wrap_nki": NKI_LAUNCH == "wrap_nki"}


def trainer_config(cfg: Config, dev, out_dir: Path, found: Inputs):
    """The AWS guide's recipe: torchtitan's qwen3_30b_a3b builder, the model cut, replacements registered."""
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.qwen3.config_registry import qwen3_30b_a3b

    tc = qwen3_30b_a3b()
    tc.model_spec = checkpoint.qwen3_spec_from_hf(model_shape(cfg),
                                                  where=cfg.hf_checkpoint or f"{cfg.preset} preset")
    for layer in tc.model_spec.model.layers:
        layer.moe.load_balance_coeff = cfg.load_balance_coeff or None
    tc.loss.loss_fn.global_vocab_size = decoder_vocab_size(tc.model_spec)
    tc.override.imports = replacement_imports(cfg, dev)
    # No expert parallel, eager (the builder's defaults); tensor parallel as --tensor_parallel_degree (--stock).
    tc.parallelism.expert_parallel_degree = 1
    return tc, apply_settings(tc, cfg, dev, out_dir, found)  # files, data, batch, AdamW, checkpointer, fixes


def replaced_modules(tc) -> list[str]:
    """FQNs of the modules the registry swapped, read back from the config tree."""
    from common.kernels.moe_module import OpRoutedExperts
    from common.kernels.rope_module import NKIRoPE
    from common.torchtitan_fixes import SDPADocumentAttention

    return sorted(fqn for cls in (SDPADocumentAttention.Config, OpRoutedExperts.Config, NKIRoPE.Config)
                  for fqn, node, _p, _a in tc.traverse(cls) if type(node) is cls)


def after_build(cfg: Config, trainer, tc, found: Inputs, log) -> dict:
    replacements = replaced_modules(tc)
    log(f"[replacements] {len(replacements)} modules: " + ", ".join(replacements))
    return {"model_shape": model_shape(cfg), "replacements": replacements}


def after_train(cfg: Config, trainer, found: Inputs) -> dict:
    """Tokens per expert (summed over layers and ranks) and the load-balancing bias the HF export leaves out."""
    import torch
    from common.kernels import moe_module

    load = torch.tensor(moe_module.expert_load(trainer.model_parts[0]) or [0], dtype=torch.int64)
    torch.distributed.all_reduce(load)  # every rank routed its own tokens
    bias = [layer.moe.expert_bias_E for layer in trainer.model_parts[0].layers.values()
            if getattr(layer.moe, "expert_bias_E", None) is not None]
    return {"expert_load": load.tolist() if not cfg.stock else None,
            "routing_bias": {"load_balance_coeff": cfg.load_balance_coeff or None, "exported": False,
                             "expert_bias_max_abs": max((float(b.abs().max()) for b in bias), default=0.0)}}


def describe(cfg: Config, shape: dict) -> tuple[str, float | None]:
    """--dry_run's label, and the published size it must match (the full model only)."""
    return (f"{cfg.preset} ({shape['num_hidden_layers']} layers, {shape['num_experts']} experts, "
            f"top_k {shape['num_experts_per_tok']})", PUBLISHED_PARAMS if shape == QWEN3_30B_A3B else None)


# A reduced Qwen3-30B-A3B on torchtitan's qwen3_30b_a3b builder, its modules replaced by kernel-backed ones.
RECIPE = Recipe("train_moe_nki.py", __doc__, Config, PRESETS, check_inputs, trainer_config,
                model_shape=lambda cfg, tc, found: model_shape(cfg), after_build=after_build, after_train=after_train,
                describe=describe, stack="moe", stack_options=stack_options)

if __name__ == "__main__":
    sys.exit(run(RECIPE))
