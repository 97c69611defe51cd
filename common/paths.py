"""Where the offline assets prepared by `make setup` are, and the training scripts' dataset choice.

The assets (a Qwen3 tokenizer, an English corpus, small HF models) are built by `python -m tools.prepare_assets
prepare` (run by `make setup`) into CACHE_DIR, one folder each with a manifest.json listing every file's size and
sha256. This module only finds them and checks them against their manifest; it never builds anything. On trn2 the
presets read real Hub folders instead, and none of this is used.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from common.errors import UserError

CACHE_DIR = Path(os.environ.get("QWEN3_RECIPES_CACHE", Path.home() / ".cache" / "qwen3-trainium-recipes")) / "assets"
MANIFEST = "manifest.json"
# asset name -> its folder under CACHE_DIR
FOLDERS = {"tokenizer": "qwen3-tokenizer", "corpus": "corpus-en", "smollm2": "smollm2-135m-instruct",
           "tiny_qwen3": "tiny-qwen3", "tiny_qwen3_moe": "tiny-qwen3-moe", "tiny_qwen_vl": "tiny-qwen-vl"}


def prepare_hint(name: str, force: bool = False) -> str:
    return f"`python -m tools.prepare_assets prepare --only {name}{' --force' if force else ''}`"


def asset_files(folder: Path) -> list[str]:
    """The files of an asset folder, relative to it, its manifest left out."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p != folder / MANIFEST)


def verify_dir(folder: Path) -> dict:
    """Check an asset folder against its manifest.json (every listed file there with its recorded size, no
    unlisted file) and return the manifest; a UserError names the first bad file. `python -m
    tools.prepare_assets verify --deep` also recomputes every sha256."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files: dict[str, dict] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{folder / MANIFEST} is missing or unreadable ({e}): the folder is not a finished asset; "
                        "run `make setup`") from None
    fix = f"rebuild it with {prepare_hint(manifest.get('asset', 'NAME'), force=True)}"
    unlisted = sorted(set(asset_files(folder)) - set(files))
    if unlisted:
        raise UserError(f"{folder / unlisted[0]} is not in {MANIFEST} (a stray or leftover file): remove it or {fix}")
    for rel, record in files.items():
        path = folder / rel
        if not path.is_file():
            raise UserError(f"{path} is missing ({MANIFEST} lists it): {fix}")
        if path.stat().st_size != record["size"]:
            raise UserError(f"{path} is {path.stat().st_size:,} bytes but {MANIFEST} records {record['size']:,}: {fix}")
    return manifest


def asset_dir(name: str, check: bool = True) -> Path:
    """The folder of a prepared asset (a key of `FOLDERS`), checked against its manifest unless check=False:
    tokenizer (the Qwen3 tokenizer files), corpus (English JSON lines), smollm2 (SmolLM2-135M-Instruct),
    tiny_qwen3 / tiny_qwen3_moe (2-layer seeded random Qwen3 and Qwen3-MoE with the real vocabulary),
    tiny_qwen_vl (a seeded random Qwen vision-language model and a test photograph)."""
    folder = CACHE_DIR / FOLDERS[name]
    if check:
        if not (folder / MANIFEST).is_file():
            raise UserError(f"{name} assets not prepared in {folder}: run `make setup` or {prepare_hint(name)}")
        verify_dir(folder)
    return folder


def training_dataset(dataset: str, dataset_path: str | None) -> tuple[str, str]:
    """The training scripts' `--dataset`/`--dataset_path` as (torchtitan dataset name, folder).
    Everything loads as torchtitan's c4_test does: `load_dataset(folder, split="train")` over JSON
    lines with a `text` field. 'corpus' is the offline English corpus from set-up. The folder is
    read here until a non-empty text turns up: no data, no `text` field, or only empty texts is
    one UserError (the trainer would otherwise fail late or wait forever for a token)."""
    if dataset == "corpus":
        return "c4_test", str(asset_dir("corpus"))
    folder = (dataset_path if dataset == "c4_test" else dataset) or "tests/assets/c4_test"
    if Path(folder).is_file():
        raise UserError(f"--dataset takes a folder of JSON lines, and {folder} is a file: pass its folder "
                        f"({Path(folder).parent}), where the training files are named train*.jsonl")
    if not Path(folder).is_dir():
        raise UserError(f"dataset folder {folder} does not exist (for c4_test pass --dataset_path "
                        "pointing at a torchtitan checkout's tests/assets/c4_test)")
    read_until_text(folder, "train", f"dataset folder {folder}", "there is nothing to train on")
    return "c4_test", str(Path(folder).resolve())


def refuse_special_files(folder: str | Path, what: str) -> None:
    """A FIFO, socket or device in a data folder is one UserError starting with `what`: `datasets` would not list
    it as data, or would block reading it."""
    from common.results import not_a_file

    for entry in sorted(Path(folder).iterdir()):
        kind = not_a_file(entry)
        if kind is not None and kind != "a folder":
            raise UserError(f"{what}: {entry.name} is {kind}, not a file of JSON lines: move it out of the folder")


def read_until_text(folder: str | Path, split: str, what: str, empty: str) -> None:
    """Read the `split` of a folder of JSON lines as torchtitan will (`datasets`, streaming) until a non-empty
    `text` turns up. A file there that is not a regular file (a FIFO would block the read forever), data that is
    not JSON lines with a `text` field, or only empty texts is one UserError starting with `what` (`empty`: what
    having none means)."""
    refuse_special_files(folder, what)
    import datasets

    datasets.disable_progress_bars()
    try:
        rows = datasets.load_dataset(str(folder), split=split, streaming=True)
        found = next((r for r in rows if isinstance(r.get("text"), str) and r["text"].strip()), None)
    except Exception as e:  # datasets raises many types (no files, bad JSON, binary data, schema)
        raise UserError(f"{what} cannot be read as JSON lines with a 'text' field: "
                        f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None
    if found is None:
        raise UserError(f"{what} holds no non-empty 'text': {empty}")
