# Copy with this file the core (it checks models and writes their rows):
#   common/__init__.py common/errors.py common/cli.py common/device.py common/paths.py common/results.py
#   common/checkpoint.py common/processes.py
#   examples/compat_check/__init__.py examples/compat_check/rows.py examples/compat_check/sizing.py
#   examples/compat_check/judge.py examples/compat_check/measure.py examples/compat_check/processes.py
#   examples/compat_check/training.py examples/compat_check/compile_audit.py
# and, for the subcommands `lookup` and `rankings` (and --compile_cache: common/harness/compile_cache.py):
#   examples/compat_check/subcommands.py examples/compat_check/lookup.py examples/compat_check/page.py
#   examples/compat_check/rankings.py
#   common/harness/__init__.py common/harness/compile_cache.py
# and, for the Neuron stack's preflight before a Trainium run, from the harness:
#   common/harness/__init__.py common/harness/preflight.py
# --task train also runs examples/train_hf_backend.py: copy it and the files its own header lists.
# In the same layout: compat_check/ beside this script, common/ beside it or one folder up.
"""The Trainium model-compatibility protocol: a short, reproducible generation run per model, kept in Parquet.

It mirrors the protocol behind the public dataset aws-neuron/torch-neuronx-model-support, for both its tasks:
text-generation, and image-text-to-text (the model's processor, one image, a short prompt). The weight size,
read from the safetensors headers, gives the fewest cores that hold a model (`--core_memory_gib` each, 24 GiB
for an LNC=2 Trainium2 core; at most `--max_cores`); it is sharded tensor-parallel when it has a TP plan,
expert-parallel alone when it is a mixture of experts without one, else excluded. The run self-launches one
process per core (no torchrun; spawned, or forked on the CPU), loads with `from_pretrained`, compiles the forward
(neuron backend on Trainium, inductor elsewhere) and generates 32 greedy tokens with a static cache, where the model
allows static cache and compile (the row says when it does not). Verdicts: a single-core run must equal, token for
token, the same checkpoint in eager mode on CPU (`cpu_match`); a sharded run must read as English to a small judge
model (`english`); NaN or Inf in the weights or logits is a FAIL whatever the tokens. A PASS says nothing about
throughput or long outputs. A verdict is always the model's, never the command line's: flags are checked before any
row (an --image Pillow cannot read, more --cores than the machine has, or a --cores/--sharding that a model's heads
or experts cannot be split over are one `error:` line, exit 2, nothing stored).

Each model becomes one row of `<out_dir>/neuronx-cc-<v>__transformers-<v>.parquet`, written atomically: the
public columns plus task, timings, the compile cache, the flags that rerun it; `run_py` holds this file's exact
source, to read, never to run. PASS, FAIL (`error` says why: verdict, crash, `--timeout_s`, NaN), or EXCLUDED
with the reason; a model that could not be fetched is EXCLUDED with `unavailable` true, no verdict, and is tried
again on the next run. A rerun skips what is recorded for the same version stack (`--redo` runs it again).
Checks may share an --out_dir, at the same time too: the Parquet file and results.json are read, changed and
replaced under a lock file beside each, so no row is lost, and results.json lists the models of every run into it.
SIGTERM, SIGHUP or SIGINT stops every process the check started (workers, a training subprocess, and what they
started), prints one `error: interrupted by SIG...` line and exits 128 + the signal's number; the workers and the
training subprocess also die with the check if it is SIGKILLed (PR_SET_PDEATHSIG).
`--task train` runs a few steps of examples/train_hf_backend.py per model instead. Every compiled row (and with
--compile_audit every row) carries a compile audit: the same generation under Dynamo with a backend that only counts
(seconds on CPU) gives the graphs the compiler gets (neuronx-cc on Trainium, minutes each), the recompiles after the
first decode step and the graph breaks, each with its reasons; a decode that recompiles per token says what that
costs on Trainium. `--compile_cache URL` shares the compiled graphs across hosts (common/harness/compile_cache.py):
this compiler's graphs pulled from the store before the first model, this host's pushed by the check (not each rank)
after each compiled row, whose `compile_cache_url` then names the store for lookup's pull command; a store this host
cannot reach is one `error:` line before any model, a failed push a warning (the row stands, with no URL).
docs/compatibility-check.md has the details.

This file is the one entry point; its two subcommands live in examples/compat_check/subcommands.py: `lookup` searches
the rows (ours and files in the public schema), prints a row's run_py or writes the lookup page, and `rankings` writes
the Hub's most downloaded and trending models per task, which `lookup --rankings` shows in that order.

CPU (preset `offline`: tiny Qwen3, tiny Qwen3-MoE, SmolLM2-135M-Instruct, a tiny Qwen3-VL and a photograph,
all from `make setup`; `--task auto` picks each model's task from its config):
    python examples/generate_compat_check.py --no_compile --out_dir runs/compat
    python examples/generate_compat_check.py --task train --out_dir runs/compat          # training rows
    python examples/generate_compat_check.py --models smollm2-135m-instruct --core_memory_gib 0.3 --no_compile \\
        --out_dir runs/compat_tp               # sharded: 2 cores of 0.3 GiB -> 3 gloo processes, judged for English
    python examples/generate_compat_check.py --no_compile --compile_audit --out_dir runs/compat  # with the audit
    python examples/generate_compat_check.py lookup runs/compat --name qwen3 [--html runs/compat/page.html]
One trn2.48xlarge (Neuron DLAMI with the AWS guide's stack; models from the Hub):
    python examples/generate_compat_check.py --preset trn2_selected --out_dir runs/compat_trn2

Expected (offline, --no_compile, idle 2-core CPU, about 1 minute): four rows, all PASS with cpu_match true
on 1 core (tiny-qwen-vl as image-text-to-text); the judge, run on single-core rows too in this preset, calls
SmolLM2's text English and not the random tiny models'. Compiling with inductor on CPU costs 1.5-3 minutes per
model the first time (tiny Qwen3-VL: 170 s of a 180 s wall time), seconds from inductor's cache. The compile audit
(static cache, 32 tokens): 2 graphs (prefill, decode), no recompile, no graph break for the three text models; tiny
Qwen3-VL 34 graphs (its vision tower split by 27 graph breaks), no recompile; 2-11 s a model on CPU.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shlex
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python examples/...` finds common/

from common import cli, device, paths  # noqa: E402
from common.errors import UserError, one_line  # noqa: E402
from common.processes import die_with_parent  # noqa: E402
from common.results import versions, write_results  # noqa: E402
if importlib.util.find_spec("compat_check") is None:  # a copy without the folder beside the script
    print("error: compat_check not found: put the folder compat_check/ (examples/compat_check/ in the repository) in "
          f"the folder of this script, {Path(__file__).resolve().parent}", file=sys.stderr)
    sys.exit(2)
from compat_check import compile_audit, judge as judging, measure, processes, rows, sizing, training  # noqa: E402

# The installed stack's check before a Trainium run, where common/harness/ was copied with common/.
if importlib.util.find_spec("common.harness"):
    from common.harness import preflight
else:  # copied with the core alone: no stack check before the models load
    preflight = None

TASK_HELP = ("auto: image-text-to-text for a vision-language model, text-generation otherwise; "
             "train: a few steps of the HF-backend training recipe per model")


@dataclass
class Config:
    preset: str = "offline"
    models: str = field(default="tiny-qwen3,tiny-qwen3-moe,smollm2-135m-instruct,tiny-qwen-vl",
                        metadata={"help": "comma-separated: offline asset names, local HF folders, or Hub ids"})
    out_dir: str = field(default="runs/compat", metadata={"help": "Parquet results and results.json go here"})
    task: Literal["auto", "text-generation", "image-text-to-text", "train"] = field(
        default="auto", metadata={"help": TASK_HELP})
    device: Literal["auto", "cpu", "cuda", "neuron"] = field(default="auto", metadata={
        "help": "auto: neuron, then cuda, then cpu"})
    core_memory_gib: float = field(default=24.0, metadata={
        "help": "memory of one core (24 GiB: an LNC=2 trn2 core)", **cli.bounds(above=0, high=4096.0)})
    max_cores: int = field(default=16, metadata={
        "help": "most cores a model may use (16 = 4 Trainium2 chips)",
        **cli.bounds(1, 128, why="trn2.48xlarge's physical cores at LNC=1")})
    cores: int = field(default=0, metadata={"help": "0: the fewest that hold the weights; N: force N cores",
                                            **cli.bounds(0, 128)})
    sharding: Literal["auto", "tp", "ep"] = field(default="auto", metadata={
        "help": "auto: TP if the model has a plan, else EP for MoE; tp/ep: force one (runs on more than one core)"})
    dtype: Literal["auto", "float32", "bfloat16"] = field(default="auto", metadata={"help": "auto: the checkpoint's"})
    no_compile: bool = field(default=False, metadata={
        "help": "skip torch.compile (by default the forward is compiled: neuron on Trainium, inductor elsewhere)"})
    fullgraph: bool = field(default=False, metadata={"help": "torch.compile(fullgraph=True). Off by default: "
                            "transformers 5.16's TP plans hook q_norm/k_norm, which Dynamo cannot trace in one graph"})
    compile_audit: bool = field(default=False, metadata={
        "help": "audit --no_compile rows too (every compiled row is audited): the graphs Dynamo hands the compiler "
                "over the generation, recompiles and graph breaks, with a counting backend (seconds on CPU)"})
    cache: Literal["auto", "dynamic"] = field(default="auto", metadata={
        "help": "auto: static cache (and compile) where the model supports them; dynamic: the dynamic cache and "
                "eager, as for a model that does not (with --compile_audit: what compiling that would recompile)"})
    new_tokens: int = field(default=32, metadata={"help": "greedy tokens generated per model", **cli.bounds(1, 4096)})
    prompt: str = field(default="Once upon a time, in a small village by the sea,",
                        metadata={"help": "text-generation prompt"})
    image_prompt: str = field(default="Describe this photograph.", metadata={"help": "image-text-to-text prompt"})
    image: str | None = field(default=None, metadata={
        "help": "image-text-to-text: an image file (default: the photograph of the tiny-qwen-vl asset)"})
    timeout_s: int = field(default=1800, metadata={
        "help": "per-model limit (load, compile, generate); past it every process of the run is killed, a FAIL row",
        **cli.bounds(1, 7 * 24 * 3600)})
    judge_model: str | None = field(default=None, metadata={
        "help": "English judge: folder or Hub id (default: SmolLM2-135M-Instruct from set-up)"})
    judge_max_perplexity: float = field(default=judging.JudgeLimits.max_perplexity, metadata={
        "help": "highest judge perplexity counted as fluent", **cli.bounds(above=0, high=1e9)})
    judge_single_core: bool = field(default=False, metadata={
        "help": "also judge single-core runs for English (recorded, not part of their verdict)"})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "allow checkpoints that ship their own model code (refused by default)"})
    train_steps: int = field(default=4, metadata={"help": "--task train: steps per model", **cli.bounds(1, 10_000)})
    train_lr: float = field(default=3e-4, metadata={"help": "--task train: peak learning rate",
                                                    **cli.bounds(above=0, high=1.0)})
    redo: bool = field(default=False, metadata={"help": "run models already recorded for this version stack again"})
    lnc: int = field(default=2, metadata={"help": "Trainium logical NeuronCore size (NEURON_LOGICAL_NC_CONFIG)",
                                          **cli.bounds(1, 2)})
    compile_cache: str | None = field(default=None, metadata={
        "help": "a compile cache shared across hosts: a folder on shared storage (FSx, EFS), file:// or an fsspec URL "
                "(s3://bucket/prefix with s3fs installed). Before the first model the check pulls the graphs this "
                "compiler made elsewhere into this host's cache (the NEFF cache on Trainium, inductor's elsewhere); "
                "after each compiled row it pushes the new ones under a key of the compiler's versions, and the row "
                "records the URL (compile_cache_url, without a user name or password) for lookup's pull command "
                "(docs/compile.md). Unused with --no_compile and --task train", "metavar": "URL"})

    def validate(self) -> None:
        """What the flags' bounds (cli.bounds, checked first by cli.parse_config: every number finite and in its
        range) cannot say alone, checked before anything runs: a bad flag must never become a stored verdict."""
        if not 0 <= self.cores <= self.max_cores:
            raise UserError(f"--cores must be between 0 (automatic) and --max_cores {self.max_cores}, got {self.cores}")
        for name in ("prompt", "image_prompt"):
            if not getattr(self, name).strip() or len(getattr(self, name)) > 10_000:
                raise UserError(f"--{name} must hold some text (at most 10,000 characters)")
        if self.image is not None:
            check_image(self.image)
        if not model_specs(self.models):
            raise UserError("--models is empty")


def check_image(path: str) -> None:
    """--image must be a file that Pillow opens and decodes, as the processor will be given it: anything else is
    the command line's mistake, refused before any row, never a model's FAIL."""
    if not Path(path).is_file():
        raise UserError(f"--image {path} is not a file")
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.verify()  # the file's own checks (a truncated PNG, a bad CRC)
        with Image.open(path) as image:
            image.convert("RGB")  # and every pixel decodes
    except Exception as e:  # noqa: BLE001  Pillow raises many types (UnidentifiedImageError, OSError, SyntaxError)
        raise UserError(f"--image {path} is not an image Pillow can read ({type(e).__name__}: "
                        f"{str(e).strip()[:200]}): give a PNG or JPEG file") from None


def offline() -> Config:
    """CPU default: tiny Qwen3, tiny Qwen3-MoE, SmolLM2-135M-Instruct, tiny Qwen3-VL, from set-up; judge every row."""
    return Config(judge_single_core=True)


def trn2_selected() -> Config:
    """trn2.48xlarge: popular text-generation and vision-language models from the Hub, bfloat16, neuron backend."""
    return replace(Config(), device="neuron", dtype="bfloat16", out_dir="runs/compat_trn2",
                   judge_model="HuggingFaceTB/SmolLM2-135M-Instruct", models=",".join((
        "Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-8B", "Qwen/Qwen3-14B",
        "Qwen/Qwen3-32B", "Qwen/Qwen3-30B-A3B-Instruct-2507", "meta-llama/Llama-3.2-1B-Instruct",
        "meta-llama/Llama-3.1-8B-Instruct", "mistralai/Mistral-7B-Instruct-v0.3", "google/gemma-3-1b-it",
        "microsoft/Phi-4-mini-instruct", "HuggingFaceTB/SmolLM2-1.7B-Instruct", "openai/gpt-oss-20b",
        "Qwen/Qwen3-VL-2B-Instruct", "Qwen/Qwen3-VL-8B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct",
        "google/gemma-3-4b-it")))


PRESETS = {"offline": offline, "trn2_selected": trn2_selected}
OFFLINE_MODELS = {"tiny-qwen3": "tiny_qwen3", "tiny-qwen3-moe": "tiny_qwen3_moe",  # name -> asset (paths.FOLDERS)
                  "smollm2-135m-instruct": "smollm2", "tiny-qwen-vl": "tiny_qwen_vl"}
OFFLINE_IMAGE = "photograph.png"  # in the tiny-qwen-vl asset: Chelsea the cat (CC0), from scikit-image
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]  # never pickles


# ------------------------------------------------------------------------------------------ the check
def main(cfg: Config) -> dict:
    """The check: its outputs, models and flags checked before any model runs, then each model in turn (skipped where
    its verdict is recorded for this stack), its row written as soon as it is known, results.json after each."""
    from tqdm import tqdm

    out_dir = cli.check_out_dir(cfg.out_dir).resolve()
    check_results_json(out_dir, cfg.out_dir)
    stack = rows.stack_versions()
    path = rows.results_file(out_dir, stack)
    for output in (path, out_dir / "results.json"):  # each replaced under its lock file: a bad one is refused now,
        rows.check_lock(output)                       # not once a model has been measured
    specs = model_specs(cfg.models)
    check_specs(specs)
    if preflight is not None and preflight.wants_neuron(cfg.device):  # the installed Neuron stack: seconds
        preflight.require_stack("trn2", "compat")
    dev_type = device.resolve_device_type(cfg.device)
    most = sizing.machine_cores(dev_type, cfg.lnc)
    if cfg.cores and most is not None and cfg.cores > most and cfg.task != "train":
        raise UserError(f"--cores {cfg.cores}: this machine has {most} {dev_type} core(s); give at most {most}, or "
                        "0 for the fewest that hold each model")
    shared, shown = shared_cache(cfg, dev_type)  # a store this host cannot reach: one line now, before any model
    run_py = Path(__file__).read_text()  # the exact source that runs: stored with every row, never executed
    if cfg.task == "train":  # the training script runs too: keep its source beside this one
        script = training.TRAIN_SCRIPT
        run_py += f"\n# ---- {script.name}, run as a subprocess by --task train ----\n" + script.read_text()
    tasks = ("text-generation", "image-text-to-text") if cfg.task == "auto" else (cfg.task,)
    check_flags_fit(cfg, specs, path, stack, tasks)
    print(one_line(f"[config] {cli.format_config(shown)}"), flush=True)  # paths and ids: one printable line
    print(one_line(f"[stack] {json.dumps(stack)} -> {path}"), flush=True)
    if shared is not None:  # the graphs this compiler made on other hosts: the models compile less here
        print(one_line(f"[compile cache] {shared.pull()} entries pulled from {shared.summary()['url']} "
                       f"({shared.key}) into {shared.local_dir}"), flush=True)

    judge_cache = []

    def judge():
        if not judge_cache:
            folder = resolve_model(cfg.judge_model or "smollm2-135m-instruct")  # not fetched: no verdict either
            limits = judging.JudgeLimits(max_perplexity=cfg.judge_max_perplexity)
            judge_cache.append(judging.EnglishJudge(folder, limits))
        return judge_cache[0]

    summary, results = [], {"script": "generate_compat_check.py", "config": shown, "versions": versions(),
                            "stack": stack, "files": [str(path)], "models": []}
    bar = tqdm(specs, desc="models", unit="model", file=sys.stdout)
    for spec in bar:
        bar.set_postfix_str(one_line(spec))
        old = rows.recorded(path, spec, stack, tasks)
        if old is not None and not cfg.redo:
            summary.append({"model_id": spec, "skipped": True, "task": old["task"], "result": old["result"]})
            tqdm.write(one_line(f"[skip] {spec}: already recorded for this stack ({old['result']}); "
                                        "--redo to run again"))
            continue
        t0 = time.perf_counter()
        base = {"model_id": spec, "device": dev_type, "task": tasks[0]}
        try:
            row = train_row(cfg, spec, base, out_dir) if cfg.task == "train" else \
                check_model(cfg, spec, dev_type, judge, shared)
        except FlagsMisfit:  # the command line's mistake, not the model's: no row; the rows before it stay
            raise
        except Unavailable as e:  # not a compatibility verdict: say why, and try again next time
            row = dict(base, result="EXCLUDED", unavailable=True, exclusion=f"not fetched (no verdict; a rerun "
                       f"tries again): {e}")
        except Exception as e:  # noqa: BLE001  one model's failure is its row; the next model still runs
            row = dict(base, result="FAIL", error=f"{type(e).__name__}: {e}"[:4000])
        row.update(stack, run_py=run_py, packages=json.dumps(rows.other_packages(row["task"])),
                   run_args=rerun_args(cfg, row), timings=json.dumps(row["timings"]) if row.get("timings") else None)
        if row.get("unavailable") and old is not None:
            tqdm.write(one_line(f"[keep] {spec}: not fetched this time; its recorded {old['result']} row "
                                        "stays"))
        else:
            rows.write_row(path, row)
        keys = ("task", "result", "tp", "runner", "cpu_match", "english", "wall_s", "compile_s", "hbm_peak_gb",
                "train_losses", "exclusion", "error", "unavailable", "compile_graphs", "compile_recompiles",
                "compile_graph_breaks")
        summary.append({"model_id": spec, "skipped": False, **{k: row.get(k) for k in keys}})
        tqdm.write(one_line(
            f"[model] {spec} ({row['task']}): {row['result']} cores={row.get('tp')} cpu_match="
            f"{row.get('cpu_match')} english={row.get('english')} wall={row.get('wall_s') or 0:.1f}s "
            f"compile={row.get('compile_s') or 0:.1f}s ({time.perf_counter() - t0:.0f} s in all)"
            + (f" graphs={row['compile_graphs']} recompiles={row['compile_recompiles']} graph_breaks="
               f"{row['compile_graph_breaks']}" if row.get("compile_graphs") is not None else "")
            + (f" error: {str(row['error']).strip().splitlines()[0][:200]}" if row.get("error") else "")
            + (f" excluded: {row['exclusion']}" if row.get("exclusion") else "")))
        results["models"] = summary
        save_results(out_dir, results)
    results["models"] = summary
    save_results(out_dir, results)
    print(one_line(f"[done] {len(summary)} model(s); rows in {path}"), flush=True)
    return results


# ------------------------------------------------------------------------------------------ before any model
def model_specs(text: str) -> list[str]:
    return [s.strip().rstrip("/") for s in text.split(",") if s.strip()]


def check_specs(specs: list[str]) -> None:
    """Paths must exist before anything runs; Hub ids are resolved per model."""
    for spec in specs:
        if spec.startswith(("/", "./", "../", "~")) and not Path(spec).expanduser().is_dir():
            raise UserError(f"--models: {spec} is not a folder (give an HF folder, an offline asset "
                            f"name ({', '.join(OFFLINE_MODELS)}) or a Hub id)")


def check_results_json(out_dir: Path, given: str) -> None:
    """results.json is rewritten after every model: never over one that another script wrote."""
    path = out_dir / "results.json"
    if not path.exists():
        return
    try:
        script = json.loads(path.read_text()).get("script")
    except (OSError, ValueError, AttributeError):  # not readable, not JSON, not an object
        script = None
    if script != Path(__file__).name:
        raise UserError(f"--out_dir {given} holds a results.json that this script did not write "
                        f"({'written by ' + str(script) if script else 'not one of its files'}): choose another "
                        "--out_dir")


def check_flags_fit(cfg: Config, specs: list[str], path: Path, stack: dict, tasks: tuple[str, ...]) -> None:
    """Before any row: --cores/--sharding that a model already on this machine (a folder, an offline asset) cannot
    be split over is one error line (FlagsMisfit). A Hub model is checked the same way once fetched, before its
    row. Models a rerun skips are not looked at."""
    if cfg.task == "train" or (not cfg.cores and cfg.sharding == "auto"):
        return
    for spec in specs:
        if not (Path(spec).expanduser().is_dir() or spec in OFFLINE_MODELS):
            continue
        if not cfg.redo and rows.recorded(path, spec, stack, tasks) is not None:
            continue
        try:
            folder = resolve_model(spec)
        except Unavailable:
            continue
        task, vision = model_task(cfg, folder)
        if not_run(cfg, folder, task, vision) is None:
            model_plan(cfg, spec, folder)


class FlagsMisfit(UserError):
    """--cores/--sharding ask for a split the model cannot have: the command line's mistake, never a row."""


def flags_misfit(cfg: Config, spec: str, plan: sizing.Plan) -> FlagsMisfit:
    flags = [f"--cores {cfg.cores}"] * bool(cfg.cores) + [f"--sharding {cfg.sharding}"] * (cfg.sharding != "auto")
    return FlagsMisfit(f"{' '.join(flags)} cannot run {spec}: {plan.exclusion}; nothing was recorded for it (a "
                       f"choice of the command line, not a verdict on the model): leave {' and '.join(flags)} out "
                       "(the fewest cores that hold the weights) or give a count its heads or experts divide")


def shared_cache(cfg: Config, dev_type: str):
    """--compile_cache: (the store of this compiler's key, common/harness/compile_cache.py's SharedCache with this
    host's compile cache as its local folder, or None where nothing is given or compiled; the config as printed and
    stored, the URL without a user name or password). A store this host cannot reach is one UserError, before any
    model runs."""
    if not cfg.compile_cache:
        return None, cfg
    try:
        from common.harness import compile_cache
    except ModuleNotFoundError as missing:
        if not (missing.name or "").startswith("common.harness"):
            raise
        raise UserError(f"--compile_cache needs common/harness/__init__.py and compile_cache.py beside common/ "
                        f"({one_line(str(missing))}): copy them too (this file's header)") from None
    where = compile_cache.compile_cache_folder(dev_type, compiled=True)
    shared = compile_cache.SharedCache(cfg.compile_cache, compile_cache.cache_key(dev_type), where["dir"],
                                       kind=where["kind"])
    shared.reachable()
    shown = replace(cfg, compile_cache=compile_cache.shown_url(cfg.compile_cache))
    if cfg.no_compile or cfg.task == "train":
        why = "--no_compile" if cfg.no_compile else "--task train (train_hf_backend.py's own --compile_cache shares " \
            "a training run's graphs)"
        print(one_line(f"[compile cache] unused with {why}: nothing is pulled or pushed, the rows record none"),
              flush=True)
        return None, shown
    return shared, shown


def push_graphs(shared, row: dict) -> None:
    """After a compiled run: this host's compiled graphs that the shared store lacks pushed under this compiler's key,
    by the check itself (one process, not each rank), and the row's `compile_cache_url` the store's URL (without a
    user name or password), from which lookup and the page give its pull command. A push that fails is a warning line
    on stderr: the row, its result its own, then records no shared compile cache."""
    start = time.perf_counter()
    try:
        pushed = shared.push()
    except Exception as e:  # noqa: BLE001  the store's UserError, a local file unreadable: never the model's verdict
        print(one_line(f"[compile cache] warning: {row['model_id']}: the push failed, its row records no shared "
                       f"compile cache: {e}"), file=sys.stderr, flush=True)
        return
    row["compile_cache_url"] = shared.summary()["url"]
    row["timings"]["compile_cache_push_s"] = time.perf_counter() - start
    row["notes"] += f"; {pushed} new compile cache entries pushed to {row['compile_cache_url']} ({shared.key})"


# ------------------------------------------------------------------------------------------ one model
def check_model(cfg: Config, spec: str, dev_type: str, judge, shared=None) -> dict:
    """Everything for one model: task, plan, run, verdicts. Returns the row (without versions and run_py). `shared`:
    --compile_cache's store (shared_cache), pushed to after a compiled run."""
    folder = resolve_model(spec, with_code=cfg.trust_remote_code)
    task, vision = model_task(cfg, folder)
    row = {"model_id": spec, "device": dev_type, "task": task}
    if why := not_run(cfg, folder, task, vision):
        return dict(row, result="EXCLUDED", exclusion=why)
    size, need, plan = model_plan(cfg, spec, folder)
    prompt = cfg.image_prompt if vision else cfg.prompt
    row.update(tp=plan.cores, runner=plan.runner, hbm_capacity_gb=plan.cores * cfg.core_memory_gib, prompt=prompt,
               notes=f"weights {size / device.GIB:.3f} GiB need {need} core(s) of {cfg.core_memory_gib:g} GiB")
    if plan.runner is None:
        return dict(row, result="EXCLUDED", exclusion=plan.exclusion)
    job = {"folder": str(folder), "cores": plan.cores, "runner": plan.runner, "device": dev_type, "task": task,
           "dtype": cfg.dtype, "compile": not cfg.no_compile, "fullgraph": cfg.fullgraph, "prompt": prompt,
           "new_tokens": cfg.new_tokens, "timeout_s": cfg.timeout_s, "lnc": cfg.lnc,
           "trust_remote_code": cfg.trust_remote_code, "compile_audit": cfg.compile_audit, "cache": cfg.cache}
    if vision:
        job["image"] = str(image_file(cfg))
        row["image"] = f"{job['image']} (sha256 {hashlib.sha256(Path(job['image']).read_bytes()).hexdigest()})"
    try:
        rep = processes.run_ranks(worker, job, job["cores"], job["timeout_s"])
    except (TimeoutError, RuntimeError) as e:
        return dict(row, result="FAIL", error=str(e))
    row.update(wall_s=rep["wall_s"], compile_s=rep["compile_s"], hbm_peak_gb=rep["peak_bytes"] / device.GIB,
               generated_text=rep["text"], timings=rep["timings"],
               compile_cache=rep["compile_cache"] or "nothing compiled: eager run")
    how = f"compiled ({'neuron' if dev_type == 'neuron' else 'inductor'})" if rep["compiled"] else "eager"
    cache = "static cache" if rep["static"] else "dynamic cache (--cache dynamic)" if cfg.cache == "dynamic" else \
        "dynamic cache: the model does not support static cache and compile (_can_compile_fullgraph is False)"
    row["notes"] += f"; {plan.runner} on {plan.cores} {dev_type} process(es), {how}, {cache}"
    if rep.get("audit"):
        row.update(compile_audit.row_columns(rep["audit"]))
        row["notes"] += "; " + compile_audit.note(rep["audit"])
    if dev_type == "cpu":
        row["notes"] += "; hbm_peak_gb is the peak resident memory of a process (CPU has no HBM)"
    if shared is not None and rep["compiled"]:  # the graphs of this run, whatever its verdict
        push_graphs(shared, row)
    if plan.runner == "single":
        row["cpu_match"] = rep["tokens"] == rep["cpu_tokens"]
        if not row["cpu_match"]:
            diverge = next((i for i, (a, b) in enumerate(zip(rep["tokens"], rep["cpu_tokens"])) if a != b),
                           min(len(rep["tokens"]), len(rep["cpu_tokens"])))
            row["notes"] += f"; tokens differ from the CPU eager reference from new token {diverge}"
    if plan.runner != "single" or cfg.judge_single_core:
        t0 = time.perf_counter()
        verdict = judge().judge(rep["text"], prompt)
        row["english"], row["judge"] = verdict["english"], json.dumps(verdict)
        row["timings"]["judge_s"] = time.perf_counter() - t0
    if rep["nonfinite"]:  # garbage in both runs can still match token for token: never a PASS
        return dict(row, result="FAIL", error=rep["nonfinite"])
    passed = row["cpu_match"] if plan.runner == "single" else row["english"]
    return dict(row, result="PASS" if passed else "FAIL")


def train_row(cfg: Config, spec: str, row: dict, out_dir: Path) -> dict:
    """--task train: a few steps of examples/train_hf_backend.py from the checkpoint (compat_check/training.py)."""
    folder = resolve_model(spec)
    if sizing.needs_remote_code(folder):
        return dict(row, task="train", result="EXCLUDED",
                    exclusion="ships its own model code (auto_map); training never runs it")
    return training.train_model(row, folder, out_dir, steps=cfg.train_steps, lr=cfg.train_lr, device=cfg.device,
                                timeout_s=cfg.timeout_s)


def model_task(cfg: Config, folder: Path) -> tuple[str, bool]:
    """(the task a model is checked for, whether it is a vision-language model)."""
    vision = sizing.is_vision_language(folder)
    return (("image-text-to-text" if vision else "text-generation") if cfg.task == "auto" else cfg.task), vision


def not_run(cfg: Config, folder: Path, task: str, vision: bool) -> str | None:
    """Why a model is EXCLUDED before its plan (model code without --trust_remote_code, not a vision-language
    model for image-text-to-text), or None."""
    if sizing.needs_remote_code(folder) and not cfg.trust_remote_code:
        return "ships its own model code (auto_map); pass --trust_remote_code"
    if task == "image-text-to-text" and not vision:
        return (f"not a vision-language model: model_type {sizing.model_type(folder)!r} has no image-text-to-text "
                "class in transformers")
    return None


def model_plan(cfg: Config, spec: str, folder: Path) -> tuple[int, int, sizing.Plan]:
    """(weight bytes, fewest cores that hold them, plan). FlagsMisfit where --cores/--sharding cannot split it."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code)
    size = sizing.weight_bytes(folder, {"auto": None, "float32": 4, "bfloat16": 2}[cfg.dtype])
    need = sizing.min_cores(size, cfg.core_memory_gib)
    plan = sizing.choose_plan(hf_config, need, cfg.max_cores, cfg.sharding, cfg.cores)
    if plan.by_flags:
        raise flags_misfit(cfg, spec, plan)
    return size, need, plan


class Unavailable(Exception):
    """What a check needs could not be had (no Hub access, a gated repository, no disk space, an asset
    not prepared): no verdict; the row says so and a rerun tries again."""


def resolve_model(spec: str, with_code: bool = False) -> Path:
    """An HF folder for a model spec: a local folder, an offline asset, or a Hub snapshot (weights as
    safetensors; the checkpoint's own *.py files only when remote code is allowed)."""
    if Path(spec).expanduser().is_dir():
        return Path(spec).expanduser()
    try:
        if spec in OFFLINE_MODELS:
            return paths.asset_dir(OFFLINE_MODELS[spec])
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        return Path(snapshot_download(spec, allow_patterns=HUB_FILES + ["*.py"] * with_code))
    except (UserError, HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:  # OSError: no space, no network
        raise Unavailable(f"{type(e).__name__}: {str(e).strip()[:500]}") from None


def image_file(cfg: Config) -> Path:
    if cfg.image:
        return Path(cfg.image)
    try:
        return paths.asset_dir("tiny_qwen_vl") / OFFLINE_IMAGE
    except UserError as e:
        raise Unavailable(f"no --image and the default photograph is missing: {e}") from None


# ------------------------------------------------------------------------------------------ one process per core
def worker(rank: int, job: dict, results) -> None:
    """One rank of a model's run (spawned, or forked on the CPU). Reports ("ok", measurements) or ("error",
    traceback). It dies with the check, however the check ends, and leaves Ctrl-C to the check (which stops every
    rank)."""
    die_with_parent(parent_pid=job["parent_pid"])()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a forked rank's: the check's own stop handlers are the check's
        signal.signal(sig, signal.SIG_DFL)
    if job["forked"]:
        import torch

        torch.set_num_threads(1)  # before any op
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job["cores"]),
                      LOCAL_WORLD_SIZE=str(job["cores"]), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]))
    try:
        results.put((rank, "ok", generate_on_device(job)))
    except BaseException as e:  # noqa: BLE001  everything goes to the row, including SystemExit from a library
        # The exception itself first (it can be long: Dynamo's explain the graph break), then the frames.
        summary = "".join(traceback.format_exception_only(e)).strip()
        results.put((rank, "error", f"{summary[:2000]}\n--- traceback (last frames)\n{traceback.format_exc()[-2000:]}"))
    finally:
        device.teardown()


def model_inputs(job: dict):
    """(tokenizer, inputs): the tokenized prompt, or for image-text-to-text the processor's output for one
    image and the prompt, laid out by the model's own chat template."""
    from transformers import AutoProcessor, AutoTokenizer

    if job["task"] != "image-text-to-text":
        tok = AutoTokenizer.from_pretrained(job["folder"], trust_remote_code=job["trust_remote_code"])
        return tok, tok(job["prompt"], return_tensors="pt")
    from PIL import Image

    processor = AutoProcessor.from_pretrained(job["folder"], trust_remote_code=job["trust_remote_code"])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": job["prompt"]}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    with Image.open(job["image"]) as image:
        inputs = processor(images=[image.convert("RGB")], text=[text], return_tensors="pt")
    return processor.tokenizer, inputs


def generate_on_device(job: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dev = device.setup(job["device"], lnc=job["lnc"], timeout_s=job["timeout_s"])
    if dev.device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ and not job.get("forked"):
        # ranks share the host's cores; oversubscribing them slows every rank
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dev.world_size))
    auto_class = AutoModelForImageTextToText if job["task"] == "image-text-to-text" else AutoModelForCausalLM
    dtype = job["dtype"] if job["dtype"] == "auto" else getattr(torch, job["dtype"])
    load = {"dtype": dtype, "trust_remote_code": job["trust_remote_code"]}
    if job["runner"] in ("tp", "ep"):
        from transformers.distributed import DistributedConfig

        # transformers 5.16 shards from the config's plan: base_model_tp_plan, or base_model_ep_plan
        # (experts only, attention replicated) when enable_expert_parallel is set.
        load["distributed_config"] = DistributedConfig(tp_size=dev.world_size,
                                                       enable_expert_parallel=job["runner"] == "ep")
    start = time.perf_counter()
    model = auto_class.from_pretrained(job["folder"], **load).eval()
    nonfinite = measure.nonfinite_weights(model)  # every rank goes on regardless: the others wait in collectives
    if job["runner"] == "single":
        model.to(dev.device)
    tok, inputs = model_inputs(job)
    load_s = time.perf_counter() - start
    # transformers' own flag for "static cache and torch.compile work": where it is False, dynamic cache, eager.
    static = bool(getattr(model, "_can_compile_fullgraph", False)) and job["cache"] != "dynamic"
    compiled = job["compile"] and static
    model.generation_config.disable_compile = True  # compiled explicitly below, or not at all
    eager_forward = model.forward  # what the compile audit hands to Dynamo
    if compiled:
        model.forward = compile_forward(model.forward, "neuron" if dev.device_type == "neuron" else "inductor",
                                        job["fullgraph"])
    greedy = {"max_new_tokens": job["new_tokens"], "do_sample": False, "output_logits": True,
              "return_dict_in_generate": True,
              "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id}
    prompt_len = inputs["input_ids"].shape[1]
    generate_kwargs = {**inputs.to(dev.device), **({"cache_implementation": "static"} if static else {}), **greedy}
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**generate_kwargs)
    measure.synchronize(dev.device_type)
    end = time.perf_counter()
    tokens = out.sequences[0, prompt_len:].tolist()
    report = {"tokens": tokens, "text": tok.decode(tokens, skip_special_tokens=True), "wall_s": end - start,
              "compile_s": measure.compile_seconds() if compiled else 0.0, "static": static, "compiled": compiled,
              "compile_cache": measure.compile_cache(dev.device_type) if compiled else None,
              "peak_bytes": device.peak_memory_bytes(dev.device_type),
              "nonfinite": nonfinite or measure.nonfinite_logits(out.logits),
              "timings": {"load_s": load_s, "generate_s": end - t0}}
    if compiled or job["compile_audit"]:  # after the timed run: its wall and compile times do not include it
        report["audit"] = audit_compile(model, eager_forward, generate_kwargs, job, tokens, prompt_len)
        report["timings"]["compile_audit_s"] = report["audit"].get("seconds")
    if job["runner"] == "single":  # the reference: the same checkpoint, CPU, eager, default (dynamic) cache
        ref_start = time.perf_counter()
        del model
        ref = auto_class.from_pretrained(job["folder"], **load).eval()
        with torch.no_grad():
            ref_out = ref.generate(**inputs.to("cpu"), **greedy)
        report["cpu_tokens"] = ref_out.sequences[0, prompt_len:].tolist()
        report["nonfinite"] = report["nonfinite"] or measure.nonfinite_logits(ref_out.logits)
        report["timings"]["reference_s"] = time.perf_counter() - ref_start
    return report


def compile_forward(forward, backend, fullgraph: bool):
    """The check's torch.compile call: `backend` (neuron on Trainium, inductor elsewhere) with the arguments the compile
    audit uses too (compile_audit.compile_options: dynamic=False, as AWS's documentation asks of the neuron backend)."""
    import torch

    return torch.compile(forward, backend=backend, **compile_audit.compile_options(fullgraph))


def audit_compile(model, forward, generate_kwargs: dict, job: dict, tokens: list[int], prompt_len: int) -> dict:
    """The same generation under Dynamo with a counting backend (compat_check/compile_audit.py): graphs,
    recompiles, graph breaks. A failure of the audit is recorded as such, never the model's verdict."""
    import torch

    def generate():
        with torch.no_grad():
            return model.generate(**generate_kwargs)

    try:
        audit = compile_audit.audit_generation(model, forward, generate, fullgraph=job["fullgraph"],
                                               new_tokens=job["new_tokens"])
    except Exception as e:  # noqa: BLE001  Dynamo's Unsupported (fullgraph), anything: the audit's, not the row's
        first = (str(e).strip().splitlines() or [""])[0]
        return {"error": f"{type(e).__name__}: {first}"[:500]}
    out = audit.pop("output")
    audit["same_tokens"] = out.sequences[0, prompt_len:].tolist() == tokens  # it audited the run it reports on
    return audit


# ------------------------------------------------------------------------------------------ what is stored
def rerun_args(cfg: Config, row: dict) -> str:
    """The flags that run this one model again with the settings that produced its row."""
    args = ["--models", row["model_id"], "--task", row["task"], "--device", row["device"]]
    defaults = Config()
    names = ("train_steps", "train_lr") if row["task"] == "train" else (
        "dtype", "new_tokens", "core_memory_gib", "max_cores", "sharding", "trust_remote_code", "no_compile",
        "fullgraph", "compile_audit", "cache", "image_prompt" if row["task"] == "image-text-to-text" else "prompt",
        "image")
    args += ["--cores", str(row["tp"])] if row.get("tp") and row["task"] != "train" else []
    for f in fields(Config):
        value = getattr(cfg, f.name)
        if f.name in names and value != getattr(defaults, f.name):
            args += [f"--{f.name}"] if value is True else [f"--{f.name}", str(value)]
    return shlex.join(args)


def save_results(out_dir: Path, results: dict) -> None:
    """results.json, merged under its lock with what other checks into this --out_dir wrote (at the same time too):
    this run's entries replace the earlier ones of the same model and task (and a "not fetched" one of the model);
    the others stay, so it lists the models of every run. Never over another script's file."""
    path = out_dir / "results.json"
    with rows.locked(path):
        check_results_json(out_dir, str(out_dir))
        old = json.loads(path.read_text()) if path.exists() else {}
        mine = {(m["model_id"], m.get("task")) for m in results["models"]}
        ids = {m["model_id"] for m in results["models"]}
        others = [m for m in old.get("models") or [] if isinstance(m, dict) and (m.get("model_id"), m.get("task"))
                  not in mine and not (m.get("model_id") in ids and m.get("unavailable"))]
        files = [f for f in old.get("files") or [] if isinstance(f, str)]
        write_results(out_dir, dict(results, models=others + results["models"],
                                    files=list(dict.fromkeys(files + results["files"]))))


# ------------------------------------------------------------------------------------------ the entry point
def check_parser():
    """A parser of the check's own flags: the lookup decides with it whether a row's run_args rerun the row."""
    return cli.build_parser(Config, PRESETS, "", default_preset="offline")


SUBCOMMANDS = ("lookup", "rankings")  # compat_check/subcommands.py, with lookup.py, page.py and rankings.py


def subcommand():
    """The module that runs `lookup` and `rankings`; a copy of the check without it says so in one line."""
    try:
        from compat_check import subcommands
    except ModuleNotFoundError as missing:
        if (missing.name or "").startswith("common.harness"):  # the lookup's pull commands: the compile cache's keys
            sys.exit("error: lookup and rankings need common/harness/__init__.py and compile_cache.py beside common/ "
                     f"({one_line(str(missing))}): copy them too (this file's header)")
        if not (missing.name or "").startswith("compat_check."):
            raise
        sys.exit(f"error: lookup and rankings need examples/compat_check/subcommands.py, lookup.py, page.py and "
                 f"rankings.py beside this script ({one_line(str(missing))}): copy them too")
    return subcommands


if __name__ == "__main__":
    processes.stop_on_signals()  # SIGTERM, SIGHUP, SIGINT: every process below this one stopped, one error line
    name = sys.argv[1] if sys.argv[1:2] and sys.argv[1] in SUBCOMMANDS else None  # compat_check/subcommands.py
    try:
        if name:
            code = subcommand().run(name, sys.argv[2:], check_parser=check_parser,
                                    selected=tuple(model_specs(trn2_selected().models)))
        else:
            code = cli.run_cli(main, Config, PRESETS, __doc__, default_preset="offline")
    except processes.Interrupted as e:
        processes.exit_interrupted(e, f"{name} stopped; nothing is left half-written" if name else
                                   processes.CHECK_STOPPED)
    sys.exit(code)
