"""HF checkpoints in and out of torchtitan: validation before a load (headers, keys, shapes,
architecture, no remote code) and config.json both ways (torchtitan model specs for dense and MoE
Qwen3 built from it, and written back from them).

A folder on its own:
    python -m common.checkpoint validate CKPT_DIR [--arch Qwen3ForCausalLM]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

from common.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja")


# --------------------------------------------------------------------------- reading, validating
def read_hf_config(ckpt_dir: str | os.PathLike) -> dict:
    """config.json of an HF checkpoint folder, with a clear error for each way it can be wrong."""
    path = Path(ckpt_dir)
    if not path.exists():
        raise UserError(f"checkpoint folder {path} does not exist")
    if not path.is_dir():
        raise UserError(f"checkpoint path {path} is not a folder")
    if not any(path.iterdir()):
        raise UserError(f"checkpoint folder {path} is empty (expected config.json and *.safetensors)")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"checkpoint folder {path} has no config.json")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_path} is not valid JSON: {e}") from None


def require_architecture(hf_config: dict, expected: tuple[str, ...], where: str | os.PathLike) -> None:
    archs = hf_config.get("architectures") or [hf_config.get("model_type", "unknown")]
    if not set(archs) & set(expected):
        raise UserError(
            f"{where}/config.json describes {', '.join(map(str, archs))}, but this script trains "
            f"{' or '.join(expected)}"
        )
    if hf_config.get("auto_map"):
        raise UserError(f"{where}/config.json needs remote code (auto_map); it is not loaded")


def safetensors_header(path: Path) -> dict:
    """The header of one .safetensors file, checked against the file's size (catches truncation)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise UserError(f"{path} is truncated ({size} bytes): not a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100_000_000:
            raise UserError(f"{path} is truncated or corrupt: header of {n} bytes in a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path} is corrupt: its header is not JSON") from None
    header.pop("__metadata__", None)
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end > size:
        raise UserError(f"{path} is truncated: {size} bytes on disk, its header needs {8 + n + end}")
    return header


def checkpoint_tensors(ckpt_dir: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, dtype)} over every safetensors file of a folder, without loading tensors."""
    files = sorted(Path(ckpt_dir).glob("*.safetensors"))
    if not files:
        raise UserError(f"checkpoint folder {ckpt_dir} has no *.safetensors files "
                        "(weights are read only from safetensors, never from pickles)")
    out = {}
    for f in files:
        for k, t in safetensors_header(f).items():
            out[k] = (tuple(t["shape"]), t["dtype"])
    return out


def expected_tensors(hf_config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, dtype)} the transformers model of this config holds, built on the meta device
    (no memory). A tied lm_head is left out: checkpoints do not store it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "transformers_version"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    sd = model.state_dict()
    tied = getattr(cfg, "tie_word_embeddings", False)
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in sd.items() if not (tied and k == "lm_head.weight")}


def validate_hf_checkpoint(ckpt_dir: str | os.PathLike, architectures: tuple[str, ...]) -> dict:
    """Everything that can be checked before a load: config, architecture, files, keys, shapes.
    Returns the HF config. Raises one UserError naming every problem found."""
    hf_config = read_hf_config(ckpt_dir)
    require_architecture(hf_config, architectures, ckpt_dir)
    found = checkpoint_tensors(ckpt_dir)
    expected = expected_tensors(hf_config)
    # A tied checkpoint may still carry lm_head.weight (transformers writes it sometimes).
    if hf_config.get("tie_word_embeddings") and "lm_head.weight" in found:
        found.pop("lm_head.weight")
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(k for k in set(found) - set(expected) if not k.endswith("rotary_emb.inv_freq"))
    wrong_shape = [f"{k}: {list(found[k][0])} (config implies {list(expected[k][0])})"
                   for k in sorted(set(found) & set(expected)) if found[k][0] != expected[k][0]]
    float_types = {"F32", "F16", "BF16", "F64"}
    wrong_dtype = [f"{k}: {found[k][1]}" for k in sorted(set(found) & set(expected))
                   if found[k][1] not in float_types]
    problems = []
    if missing:
        problems.append(f"missing keys {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_short(unexpected)}")
    if wrong_shape:
        problems.append(f"wrong shapes {_short(wrong_shape)}")
    if wrong_dtype:
        problems.append(f"non-float weights {_short(wrong_dtype)}")
    if problems:
        raise UserError(f"checkpoint {ckpt_dir} does not match its config.json: " + "; ".join(problems))
    return hf_config


def _short(items: list[str], n: int = 5) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return "[" + ", ".join(items[:n]) + "]" + more


# --------------------------------------------------------------------------- config.json both ways
QWEN3_DENSE = ("Qwen3ForCausalLM",)


def _rope_theta(hf_config: dict) -> float:
    # transformers 5 keeps rope settings in `rope_parameters`; 4.x used top-level keys.
    params = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind not in ("default", None):
        raise UserError(f"config.json asks for rope scaling {kind!r}; torchtitan's Qwen3 implements only the default RoPE")
    return float(params.get("rope_theta", hf_config.get("rope_theta", 1_000_000.0)))


def qwen3_spec_from_hf(hf_config: dict, *, where: str | os.PathLike = "config"):
    """A torchtitan Qwen3 ModelSpec with the shape a dense Qwen3 config.json describes, built
    with torchtitan's own Qwen3 layer builder, so any dense Qwen3 checkpoint loads whatever its size."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3 import model_registry
    # Private in torchtitan 0.3.0 (pinned in requirements.txt): the builder its presets use.
    from torchtitan.models.qwen3 import (_EMBEDDING_INIT, _EMBEDDING_SKIP_INIT, _LINEAR_INIT,
                                         _build_qwen3_layers, _qwen3_norm)
    from torchtitan.models.qwen3.model import Qwen3Model

    require_architecture(hf_config, QWEN3_DENSE, where)
    for key in ("attention_bias",):
        if hf_config.get(key):
            raise UserError(f"{where}: {key}=true is not supported by torchtitan's Qwen3")
    try:
        dim = int(hf_config["hidden_size"])
        n_heads = int(hf_config["num_attention_heads"])
        n_layers = int(hf_config["num_hidden_layers"])
        vocab = int(hf_config["vocab_size"])
        hidden = int(hf_config["intermediate_size"])
    except KeyError as e:
        raise UserError(f"{where}: config.json lacks {e.args[0]}") from None
    n_kv = int(hf_config.get("num_key_value_heads") or n_heads)
    head_dim = int(hf_config.get("head_dim") or dim // n_heads)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    eps = float(hf_config.get("rms_norm_eps", 1e-6))
    model = Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim), enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_SKIP_INIT if tied else _EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=_build_qwen3_layers(
            n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            hidden_dim=hidden, attn_backend="flex",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=int(hf_config.get("max_position_embeddings", 40960)),
                                   theta=_rope_theta(hf_config))),
    )
    for _fqn, norm, _p, _a in model.traverse(RMSNorm.Config):
        norm.eps = eps
    spec = model_registry("0.6B")  # parallelize/pipeline/adapter functions shared by every dense Qwen3
    spec.flavor = f"hf:{n_layers}x{dim}"
    spec.model = model
    return spec


def hf_config_from_qwen3(model_config, *, dtype: str = "float32") -> dict:
    """The config.json transformers needs to open a torchtitan Qwen3 export as Qwen3ForCausalLM."""
    return {**hf_config_from_qwen3_dense_part(model_config, dtype=dtype),
            "intermediate_size": model_config.layers[0].feed_forward.w1.out_features}


def hf_config_from_qwen3_dense_part(model_config, *, dtype: str = "float32") -> dict:
    """The config.json fields shared by Qwen3 and Qwen3-MoE (all but the MLP's)."""
    attn = model_config.layers[0].attention
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": model_config.vocab_size,
        "hidden_size": model_config.dim,
        "num_hidden_layers": len(model_config.layers),
        "num_attention_heads": attn.n_heads,
        "num_key_value_heads": attn.n_kv_heads,
        "head_dim": attn.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": attn.rope.max_seq_len,
        "rms_norm_eps": model_config.norm.eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": attn.rope.theta},
        "tie_word_embeddings": bool(model_config.enable_weight_tying),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "dtype": dtype,
    }


QWEN3_MOE = ("Qwen3MoeForCausalLM",)


def qwen3_moe_spec_from_hf(hf_config: dict, *, where: str | os.PathLike = "config"):
    """A torchtitan Qwen3 MoE ModelSpec with the shape a Qwen3-MoE config.json describes (every
    layer sparse), built with torchtitan's own MoE layer builder; spec functions from 30B-A3B."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3 import model_registry
    # Private in torchtitan 0.3.0 (pinned in requirements.txt): the builder its presets use.
    from torchtitan.models.qwen3 import (_EMBEDDING_INIT, _EMBEDDING_SKIP_INIT, _LINEAR_INIT,
                                         _build_qwen3_moe_layers, _qwen3_norm)
    from torchtitan.models.qwen3.model import Qwen3Model

    require_architecture(hf_config, QWEN3_MOE, where)
    if hf_config.get("mlp_only_layers") or int(hf_config.get("decoder_sparse_step", 1)) != 1:
        raise UserError(f"{where}: dense layers inside a MoE model (mlp_only_layers / decoder_sparse_step) "
                        "are not supported by torchtitan's Qwen3 MoE")
    try:
        dim, n_layers = int(hf_config["hidden_size"]), int(hf_config["num_hidden_layers"])
        n_heads, vocab = int(hf_config["num_attention_heads"]), int(hf_config["vocab_size"])
        experts, top_k = int(hf_config["num_experts"]), int(hf_config["num_experts_per_tok"])
        moe_hidden = int(hf_config["moe_intermediate_size"])
    except KeyError as e:
        raise UserError(f"{where}: config.json lacks {e.args[0]}") from None
    n_kv = int(hf_config.get("num_key_value_heads") or n_heads)
    head_dim = int(hf_config.get("head_dim") or dim // n_heads)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    model = Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim), enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_SKIP_INIT if tied else _EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            moe_hidden_dim=moe_hidden, num_experts=experts, top_k=top_k, attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=int(hf_config.get("max_position_embeddings", 40960)),
                                   theta=_rope_theta(hf_config))),
    )
    for _fqn, norm, _p, _a in model.traverse(RMSNorm.Config):
        norm.eps = float(hf_config.get("rms_norm_eps", 1e-6))
    for layer in model.layers:
        layer.moe.router.route_norm = bool(hf_config.get("norm_topk_prob", True))
    spec = model_registry("30B-A3B")  # parallelize/pipeline/adapter/load-balancing hooks of Qwen3 MoE
    spec.flavor = f"hf:{n_layers}x{dim}x{experts}e"
    spec.model = model
    return spec


def hf_config_from_qwen3_moe(model_config, *, dtype: str = "float32") -> dict:
    """The config.json transformers needs to open a torchtitan Qwen3 MoE export as Qwen3MoeForCausalLM."""
    moe = model_config.layers[0].moe
    experts = moe.routed_experts.inner_experts
    cfg = hf_config_from_qwen3_dense_part(model_config, dtype=dtype)
    cfg.update({
        "architectures": list(QWEN3_MOE), "model_type": "qwen3_moe",
        "num_experts": experts.num_experts, "num_experts_per_tok": moe.router.top_k,
        "moe_intermediate_size": experts.hidden_dim, "intermediate_size": experts.hidden_dim * moe.router.top_k,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": bool(moe.router.route_norm),
        "output_router_logits": False, "router_aux_loss_coef": 0.001,
    })
    return cfg


# --------------------------------------------------------------------------- export


# --------------------------------------------------------------------------- verification


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Check an HF checkpoint folder before loading it.")
    p.add_argument("cmd", choices=["validate"])
    p.add_argument("ckpt_dir", type=Path)
    p.add_argument("--arch", default="Qwen3ForCausalLM")
    args = p.parse_args(argv)
    try:
        validate_hf_checkpoint(args.ckpt_dir, (args.arch,))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.ckpt_dir}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
