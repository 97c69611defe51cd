"""HF checkpoints in and out of torchtitan: validation before a load (headers, keys, shapes,
architecture, no remote code) and config.json both ways (torchtitan model specs for dense and MoE
Qwen3 built from it, and written back from them).

A folder on its own: `python -m common.harness.checks validate CKPT_DIR` (common/harness/).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import struct
from pathlib import Path

from common.errors import UserError
from common.paths import CACHE_DIR
from common.results import not_a_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja")


# --------------------------------------------------------------------------- reading, validating
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")  # the Hub's owner/name


def hub_id_hint(text: str) -> str:
    """For a missing folder named like a Hub model id (owner/name): the scripts never download, so the hint to fetch
    it first, as a command (the id quoted), else ''."""
    if not HUB_ID.fullmatch(text) or text.startswith(".") or ".." in text:
        return ""
    folder = f"assets/hf/{text.split('/')[1]}"
    return (f": these scripts read a local folder and never download; if {text} is a Hub model id, download it "
            f"first (hf download {shlex.quote(text)} --local-dir {shlex.quote(folder)}) and give that folder")


def read_hf_config(ckpt_dir: str | os.PathLike) -> dict:
    """config.json of an HF checkpoint folder, with a clear error for each way it can be wrong."""
    path = Path(ckpt_dir)
    if not path.exists():
        raise UserError(f"checkpoint folder {path} does not exist{hub_id_hint(str(ckpt_dir))}")
    if not path.is_dir():
        raise UserError(f"checkpoint path {path} is not a folder")
    if not any(path.iterdir()):
        raise UserError(f"checkpoint folder {path} is empty (expected config.json and *.safetensors)")
    cfg_path = path / "config.json"
    require_regular_file(cfg_path)
    if not cfg_path.is_file():
        raise UserError(f"checkpoint folder {path} has no config.json")
    try:
        cfg = json.loads(cfg_path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{cfg_path} is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{cfg_path} holds a JSON {type(cfg).__name__}, not an object of settings")
    return cfg


def config_value(hf_config: dict, key: str, kind: type, where, default=None, positive: bool = True):
    """One setting of config.json with its type checked: a wrong type is a UserError, not a traceback."""
    value = hf_config.get(key, default)
    if value is None:
        raise UserError(f"{where}: config.json lacks {key}")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and kind is int:
        ok = float(value).is_integer()
    if not ok or (positive and value <= 0):
        raise UserError(f"{where}: config.json {key}={value!r} is not a {'positive ' if positive else ''}{kind.__name__}")
    return kind(value)


def require_regular_file(path: Path) -> None:
    """A file a checkpoint is read from must be a regular file (or a link to one): a FIFO of that name would block
    the read forever, a folder fail in the middle of it. Checked before anything is opened; absent is fine here
    (the caller says what is missing)."""
    kind = not_a_file(path)
    if kind is not None:
        raise UserError(f"{path} is {kind}, not a regular file: only regular files (or links to them) are read")


def require_architecture(hf_config: dict, expected: tuple[str, ...], where: str | os.PathLike) -> None:
    archs = hf_config.get("architectures") or [hf_config.get("model_type", "unknown")]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise UserError(f"{where}/config.json: architectures must be a list of class names, got {archs!r}")
    if not set(archs) & set(expected):
        raise UserError(f"{where}/config.json describes {', '.join(archs)}, but this script trains {' or '.join(expected)}")
    if hf_config.get("auto_map"):
        raise UserError(f"{where}/config.json needs remote code (auto_map); it is not loaded")


def safetensors_header(path: Path) -> dict:
    """The header of one .safetensors file, checked entry by entry and against the file's size
    (catches truncation, zero-length entries and headers of the wrong shape)."""
    require_regular_file(path)
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
    if not isinstance(header, dict):
        raise UserError(f"{path} is corrupt: its header is not a JSON object")
    header.pop("__metadata__", None)
    end = 0
    for key, t in header.items():
        try:
            dtype, shape, (a, b) = t["dtype"], t["shape"], t["data_offsets"]
            good = (isinstance(dtype, str) and all(isinstance(d, int) and d >= 0 for d in shape)
                    and isinstance(a, int) and isinstance(b, int) and 0 <= a <= b)
        except (TypeError, KeyError, ValueError):
            good = False
        if not good:
            raise UserError(f"{path} is corrupt: the header entry of {key} is malformed")
        if b == a and math.prod(shape) > 0:
            raise UserError(f"{path}: {key} is an empty entry (0 bytes for shape {shape})")
        end = max(end, b)
    if 8 + n + end > size:
        raise UserError(f"{path} is truncated: {size} bytes on disk, its header needs {8 + n + end}")
    return header


def _index_files(folder: Path) -> tuple[list[Path], dict] | None:
    """The shards a *.safetensors.index.json names, cross-checked: every named file exists; None without an index."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if not indexes:
        return None
    require_regular_file(indexes[0])
    try:
        weight_map = json.loads(indexes[0].read_bytes().decode("utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{indexes[0]} is not a safetensors index (a JSON object with a weight_map)") from None
    names = sorted(set(weight_map.values()))
    for name in names:
        if Path(name).name == name:
            require_regular_file(folder / name)
    missing = [name for name in names if not (folder / Path(name).name).is_file() or Path(name).name != name]
    if missing:
        raise UserError(f"{indexes[0]} names shard files that are not in {folder}: {_short(missing)}")
    return [folder / name for name in names], weight_map


def checkpoint_tensors(ckpt_dir: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, dtype)} over every safetensors file of a folder, without loading tensors.
    With an index, every key it maps must be in the shard it names, and every stored key indexed."""
    folder = Path(ckpt_dir)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"checkpoint folder {ckpt_dir} has no *.safetensors files "
                        "(weights are read only from safetensors, never from pickles)")
    for f in files:  # before any is opened: a FIFO among them would block the first read
        require_regular_file(f)
    indexed = _index_files(folder)
    out, where = {}, {}
    for f in files:
        for k, t in safetensors_header(f).items():
            out[k], where[k] = (tuple(t["shape"]), t["dtype"]), f.name
    if indexed is not None:
        weight_map = indexed[1]
        wrong = sorted(k for k, name in weight_map.items() if where.get(k) != name)
        unindexed = sorted(set(out) - set(weight_map))
        if wrong or unindexed:
            raise UserError(f"the index of {ckpt_dir} does not match its shards: "
                            + "; ".join(s for s in (wrong and f"keys not in the shard it names {_short(wrong)}",
                                                    unindexed and f"stored keys missing from it {_short(unindexed)}") if s))
    return out


def nonfinite_tensors(ckpt_dir: str | os.PathLike) -> list[str]:
    """Keys of the float tensors that hold NaN or Inf (one tensor in memory at a time)."""
    import torch
    from safetensors import safe_open

    bad = []
    for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                t = st.get_tensor(key)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    bad.append(key)
    return bad


def expected_tensors(hf_config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, dtype)} the transformers model of this config holds, built on the meta device
    (no memory). A tied lm_head is left out: checkpoints do not store it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        cfg = AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "transformers_version"})
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise UserError(f"transformers cannot build the model config.json describes: {e}") from None
    tied = getattr(cfg, "tie_word_embeddings", False)
    out = {}
    for k, v in model.state_dict().items():
        shape, dtype = tuple(v.shape), str(v.dtype).removeprefix("torch.")
        if tied and k == "lm_head.weight":
            continue
        # transformers 5 fuses MoE experts in memory; checkpoints store one matrix per expert and projection
        if k.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H] -> gate_proj, up_proj [I, H] each
            for e in range(shape[0]):
                for proj in ("gate_proj", "up_proj"):
                    out[f"{k[:-len('gate_up_proj')]}{e}.{proj}.weight"] = ((shape[1] // 2, shape[2]), dtype)
        elif k.endswith(".mlp.experts.down_proj"):  # [E, H, I] -> down_proj [H, I]
            for e in range(shape[0]):
                out[f"{k[:-len('down_proj')]}{e}.down_proj.weight"] = (shape[1:], dtype)
        else:
            out[k] = (shape, dtype)
    return out


def validate_hf_checkpoint(ckpt_dir: str | os.PathLike, architectures: tuple[str, ...], *,
                           hf_config: dict | None = None, found: dict | None = None) -> dict:
    """Everything that can be checked before a load: config, architecture, files, index, keys, shapes, finite
    values. Returns the HF config; one UserError names every problem found. `hf_config`, `found`: config.json
    and `checkpoint_tensors` of the folder, when the caller has read them already."""
    hf_config = read_hf_config(ckpt_dir) if hf_config is None else hf_config
    require_architecture(hf_config, architectures, ckpt_dir)
    found = checkpoint_tensors(ckpt_dir) if found is None else dict(found)
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
    problems = [f"{what} {_short(items)}" for what, items in (
        ("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", wrong_shape),
        ("non-float weights", wrong_dtype)) if items]
    if not problems:
        nonfinite = nonfinite_tensors(ckpt_dir)
        if nonfinite:
            problems.append(f"NaN or Inf in {_short(nonfinite)}")
    if problems:
        raise UserError(f"checkpoint {ckpt_dir} does not match its config.json: " + "; ".join(problems))
    return hf_config


def _short(items: list[str], n: int = 5) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return "[" + ", ".join(items[:n]) + "]" + more


ROUND_TRIP = "Qwen3 trains on Trainium: 4096 tokens, 8 steps."  # a text every language-model tokenizer keeps


def check_tokenizer(folder: str | os.PathLike, hint: str = "") -> Path:
    """The folder's tokenizer.json, read as the trainer will read it, and able to do what training needs: a text
    encoded into several distinct tokens decodes back to itself. Missing, malformed or degenerate (a one-entry
    vocabulary trains on token 0) is one UserError. The verdict on bytes read once is kept by their sha256 (with the
    tokenizers version) in the cache folder, with the vocabulary size: 0.4 s of parsing a run saved."""
    path = Path(folder) / "tokenizer.json"
    require_regular_file(path)
    if not path.is_file():
        raise UserError(f"no tokenizer.json in {folder}{hint}")
    _tokenizer_facts(path)
    return Path(folder).resolve()


def tokenizer_vocab_size(folder: str | os.PathLike) -> int:
    """The number of token ids a checked tokenizer (check_tokenizer) can produce, added tokens included."""
    return _tokenizer_facts(Path(folder) / "tokenizer.json")["vocab_size"]


def check_vocab_fits(folder: str | os.PathLike, model_vocab: int, where: str) -> None:
    """Every id the tokenizer produces must be a row of the model's embedding: a larger vocabulary would index past
    it (on CPU an error at step 1, on a device possibly garbage)."""
    have = tokenizer_vocab_size(folder)
    if have > model_vocab:
        raise UserError(f"the tokenizer in {folder} has {have} tokens and the model ({where}) only {model_vocab} "
                        "embedding rows: use the model's own tokenizer (--hf_assets)")


def _tokenizer_facts(path: Path) -> dict:
    import hashlib

    import tokenizers

    content = f"{hashlib.sha256(path.read_bytes()).hexdigest()}-{tokenizers.__version__}"
    marker = CACHE_DIR.parent / "tokenizers-read" / content
    with contextlib.suppress(OSError, ValueError):  # a regular file this check wrote, never a link followed
        if not_a_file(marker) is None and not marker.is_symlink():
            facts = json.loads(marker.read_text())
            if isinstance(facts, dict) and facts.get("round_trip") == ROUND_TRIP and \
                    isinstance(facts.get("vocab_size"), int):
                return facts
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
        ids = tok.encode(ROUND_TRIP).ids
        back = tok.decode(ids)
    except Exception as e:  # the Rust side raises plain Exceptions whose text names the defect
        raise UserError(f"{path} cannot be read as a tokenizer: {str(e).splitlines()[0][:200]}") from None
    if len(set(ids)) < 2 or back.strip() != ROUND_TRIP:
        raise UserError(f"{path} is not a language model's tokenizer: {ROUND_TRIP!r} encodes to {len(ids)} token(s) "
                        f"{ids[:8]} and decodes to {back[:80]!r}")
    facts = {"round_trip": ROUND_TRIP, "vocab_size": tok.get_vocab_size(with_added_tokens=True)}
    with contextlib.suppress(OSError):  # a cache that cannot be written: parsed again next time
        from common.results import atomic_write_text

        marker.parent.mkdir(parents=True, exist_ok=True)
        if not marker.is_symlink():
            atomic_write_text(marker, json.dumps(facts))
    return facts


# --------------------------------------------------------------------------- config.json both ways
QWEN3_DENSE = ("Qwen3ForCausalLM",)
QWEN3_MOE = ("Qwen3MoeForCausalLM",)


def rope_theta(hf_config: dict, where="config") -> float:
    """RoPE base of a config.json. transformers 5 keeps rope settings in `rope_parameters`, 4.x at
    the top level. A missing value is an error: a silent default would train another model."""
    params = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise UserError(f"{where}: config.json rope_parameters / rope_scaling must be objects")
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind not in ("default", None):
        raise UserError(f"config.json asks for rope scaling {kind!r}; torchtitan's Qwen3 implements only the default RoPE")
    return config_value({"rope_theta": params.get("rope_theta", hf_config.get("rope_theta"))}, "rope_theta", float, where)


def qwen3_spec_from_hf(hf_config: dict, *, where: str | os.PathLike = "config"):
    """A torchtitan Qwen3 ModelSpec with the shape a Qwen3 or Qwen3-MoE config.json describes,
    built with torchtitan's own layer builders, so any such checkpoint loads whatever its size.
    Every number comes from config.json (head_dim, rope theta and norm eps included), none from defaults."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3 import model_registry
    # Private in torchtitan 0.3.0 (pinned in requirements.txt): the builders its presets use.
    from torchtitan.models.qwen3 import (_EMBEDDING_INIT, _EMBEDDING_SKIP_INIT, _LINEAR_INIT,
                                         _build_qwen3_layers, _build_qwen3_moe_layers, _qwen3_norm)
    from torchtitan.models.qwen3.model import Qwen3Model

    require_architecture(hf_config, QWEN3_DENSE + QWEN3_MOE, where)
    moe = "Qwen3MoeForCausalLM" in hf_config["architectures"]
    if hf_config.get("attention_bias"):
        raise UserError(f"{where}: attention_bias=true is not supported by torchtitan's Qwen3")
    if moe and (hf_config.get("mlp_only_layers") or hf_config.get("decoder_sparse_step", 1) != 1):
        raise UserError(f"{where}: dense layers inside a MoE model (mlp_only_layers / decoder_sparse_step) "
                        "are not supported by torchtitan's Qwen3 MoE")
    value = lambda key, kind=int, default=None: config_value(hf_config, key, kind, where, default)  # noqa: E731
    dim, n_heads, n_layers, vocab = (value(k) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                                                       "vocab_size"))
    head_dim = value("head_dim")  # Qwen3 sets it apart from hidden/heads; never derived
    tied = bool(hf_config.get("tie_word_embeddings", False))
    shape = dict(n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=value("num_key_value_heads", int, n_heads),
                 head_dim=head_dim, attn_backend="flex",
                 rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=value("max_position_embeddings"),
                                        theta=rope_theta(hf_config, where)))
    if moe:  # transformers 5 writes num_experts as num_local_experts
        experts = value("num_experts", int, hf_config.get("num_local_experts"))
        layers = _build_qwen3_moe_layers(**shape, moe_hidden_dim=value("moe_intermediate_size"),
                                         num_experts=experts, top_k=value("num_experts_per_tok"),
                                         moe_comm_backend="standard")
    else:
        layers = _build_qwen3_layers(**shape, hidden_dim=value("intermediate_size"))
    model = Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim), enable_weight_tying=tied, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_SKIP_INIT if tied else _EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT))
    for _fqn, norm, _p, _a in model.traverse(RMSNorm.Config):
        norm.eps = value("rms_norm_eps", float)
    for layer in model.layers if moe else ():
        layer.moe.router.route_norm = bool(hf_config.get("norm_topk_prob", True))
    # parallelize/pipeline/adapter (and for MoE load-balancing) functions shared by every model of the family
    spec = model_registry("30B-A3B" if moe else "0.6B")
    spec.flavor = f"hf:{n_layers}x{dim}" + (f"x{experts}e" if moe else "")
    spec.model = model
    return spec


def hf_config_from_qwen3(model_config, *, dtype: str = "float32") -> dict:
    """The config.json transformers needs to open a torchtitan Qwen3 (or Qwen3 MoE) export as
    Qwen3ForCausalLM (Qwen3MoeForCausalLM)."""
    layer, attn = model_config.layers[0], model_config.layers[0].attention
    cfg = {
        "architectures": list(QWEN3_DENSE), "model_type": "qwen3",
        "vocab_size": model_config.vocab_size, "hidden_size": model_config.dim,
        "num_hidden_layers": len(model_config.layers), "num_attention_heads": attn.n_heads,
        "num_key_value_heads": attn.n_kv_heads, "head_dim": attn.head_dim, "hidden_act": "silu",
        "max_position_embeddings": attn.rope.max_seq_len, "rms_norm_eps": model_config.norm.eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": attn.rope.theta},
        "tie_word_embeddings": bool(model_config.enable_weight_tying), "attention_bias": False,
        "attention_dropout": 0.0, "use_cache": True, "bos_token_id": 151643, "eos_token_id": 151645, "dtype": dtype,
    }
    moe = getattr(layer, "moe", None)
    if moe is None:
        return {**cfg, "intermediate_size": layer.feed_forward.w1.out_features}
    experts = moe.routed_experts.inner_experts
    return {**cfg, "architectures": list(QWEN3_MOE), "model_type": "qwen3_moe",
            "num_experts": experts.num_experts, "num_experts_per_tok": moe.router.top_k,
            "moe_intermediate_size": experts.hidden_dim, "intermediate_size": experts.hidden_dim * moe.router.top_k,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": bool(moe.router.route_norm),
            "output_router_logits": False, "router_aux_loss_coef": 0.001}
