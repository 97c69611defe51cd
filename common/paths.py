"""Where the offline assets prepared by `make setup` are, and the training scripts' dataset choice.

The assets (a Qwen3 tokenizer, an English corpus, small HF models) are built by `python -m tools.prepare_assets
prepare` (run by `make setup`) into CACHE_DIR, one folder each with a manifest.json listing every file's size and
sha256. This module only finds them and checks them against their manifest; it never builds anything. On trn2 the
presets read real Hub folders instead, and none of this is used.

The training data (`--dataset`): the corpus, torchtitan's c4_test folder (`--dataset c4_test --dataset_path D`), or
the user's own JSON lines, a folder or one .jsonl file. Own data without a validation split (a validation*.jsonl file
beside the training files) keeps its held-out share out of training, with or without --eval_every, so that the
training data never depends on whether the run evaluates: every HELD_OUT_EVERY-th document (documents 100, 200, ...
in the order `datasets` reads the files: sorted file names, then lines). --eval_every evaluates on that share
(common/harness/evaluation.py).
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


# torchtitan's DATASETS name (register_own_data) of the user's own data without a validation split: its training
# documents, the held-out share left out
OWN_DATA = "own_data"
HELD_OUT_EVERY = 100  # of own data without a validation split, every 100th document is held out (1%)
JSON_LINES = (".jsonl", ".json")  # a one-file dataset: `datasets`' json builder reads JSON lines under both


def training_dataset(dataset: str, dataset_path: str | None) -> tuple[str, str]:
    """The training scripts' `--dataset`/`--dataset_path` as (torchtitan dataset name, folder or file).
    Everything loads as torchtitan's c4_test does, `load_dataset(folder, split="train")` over JSON lines with a
    `text` field: 'corpus' (the offline English corpus from set-up, its validation.jsonl held out) and c4_test
    (--dataset_path, read whole) under c4_test's own name, as does a folder of the user's with a validation split;
    the user's data without one (a folder, or one .jsonl file) under OWN_DATA, its held-out share left out. The data
    is read here until a non-empty text turns up: no data, no `text` field, or only empty texts is one UserError
    (the trainer would otherwise fail late or wait forever for a token)."""
    if dataset_path and dataset != "c4_test":  # it names c4_test's folder; with any other dataset it was ignored
        raise UserError(f"--dataset_path {dataset_path} is read only with --dataset c4_test (torchtitan's test "
                        f"folder); to train on your own data give it as --dataset (a folder or a .jsonl file)")
    from common.results import not_a_file

    if dataset == "corpus":
        return "c4_test", str(asset_dir("corpus"))
    path = Path((dataset_path if dataset == "c4_test" else dataset) or "tests/assets/c4_test")
    kind = not_a_file(path)
    if kind is not None and kind != "a folder":
        raise UserError(f"--dataset {path} is {kind}: give a folder of JSON lines or a .jsonl file")
    if path.is_file() and dataset == "c4_test":
        raise UserError(f"--dataset_path {path} is a file: give c4_test's folder (a torchtitan checkout's "
                        "tests/assets/c4_test); a .jsonl file of your own is --dataset FILE")
    if path.is_file():
        if path.suffix not in JSON_LINES:
            raise UserError(f"--dataset {path} is a file but not JSON lines (.jsonl): give a .jsonl file with a "
                            "'text' field a line, or a folder of them")
        if path.stat().st_size == 0:  # datasets' json builder stops before a first row with no error of its own
            raise UserError(f"dataset file {path} holds no non-empty 'text': there is nothing to train on")
        read_until_text(path, "train", f"dataset file {path}", "there is nothing to train on")
    elif path.is_dir():
        read_until_text(path, "train", f"dataset folder {path}", "there is nothing to train on")
    else:
        raise UserError(f"dataset folder {path} does not exist (for c4_test pass --dataset_path "
                        "pointing at a torchtitan checkout's tests/assets/c4_test)")
    if dataset == "c4_test" or has_validation_split(path):
        return "c4_test", str(path.resolve())
    return OWN_DATA, str(path.resolve())  # torchtitan learns the name from register_own_data, after device setup


def has_validation_split(path: str | os.PathLike) -> bool:
    """Whether `datasets` finds a validation split among a folder's files (by their names); a file has none."""
    from datasets.data_files import get_data_patterns

    if not Path(path).is_dir():
        return False
    try:
        return "validation" in get_data_patterns(str(Path(path).resolve()))
    except Exception:  # datasets raises EmptyDatasetError and others for a folder with no data files
        return False


def load_rows(path: str | os.PathLike, split: str = "train", streaming: bool = False):
    """A folder's `split` as torchtitan's c4_test loads it (`load_dataset(folder, split=...)`), or a .jsonl file's
    rows as its train split (`datasets` resolves only folders and Hub names by path: a file needs the json builder)."""
    import datasets

    if Path(path).is_file():
        return datasets.load_dataset("json", data_files={"train": str(path)}, split=split, streaming=streaming)
    return datasets.load_dataset(str(path), split=split, streaming=streaming)


def own_rows(path: str, held_out: bool = False):
    """The user's own data without a validation split: its training documents (held_out=False) or its held-out
    share, every HELD_OUT_EVERY-th document. Both are index selections of one map-style load (as c4_test's),
    disjoint by construction."""
    import numpy as np

    rows = load_rows(path)
    index = np.arange(len(rows))
    return rows.select(index[(index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held_out])


def register_own_data() -> None:
    """Add OWN_DATA to torchtitan's DATASETS: the training documents of own_rows, the `text` field (c4_test's sample
    processor). Called where the trainer's config is made, after common.device.setup (torchtitan binds its device
    at import, so nothing imports it earlier), by every process that builds a trainer."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets

    if OWN_DATA not in text_datasets.DATASETS:
        text_datasets.DATASETS[OWN_DATA] = DatasetConfig(path="", loader=own_rows,
                                                         sample_processor=text_datasets._process_c4_text)


def refuse_special_files(folder: str | Path, what: str) -> None:
    """A FIFO, socket or device in a data folder is one UserError starting with `what`: `datasets` would not list
    it as data, or would block reading it."""
    from common.results import not_a_file

    if not Path(folder).is_dir():  # a one-file dataset: training_dataset checked the file itself
        return
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
        found, field, rows = None, False, 0
        for row in load_rows(folder, split, streaming=True):
            rows, field = rows + 1, field or "text" in row
            if isinstance(row.get("text"), str) and row["text"].strip():
                found = row
                break
    except Exception as e:  # datasets raises many types (no files, bad JSON, binary data, schema)
        raise UserError(f"{what} cannot be read as JSON lines with a 'text' field: "
                        f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None
    if rows and not field:  # JSON lines of other fields (a folder's load names the missing column itself)
        raise UserError(f"{what} cannot be read as JSON lines with a 'text' field: no line has one")
    if found is None:
        raise UserError(f"{what} holds no non-empty 'text': {empty}")
