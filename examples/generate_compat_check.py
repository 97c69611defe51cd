"""The Trainium model-compatibility protocol: a short, reproducible generation run per model, kept in Parquet.

It mirrors the protocol behind the public dataset aws-neuron/torch-neuronx-model-support. For each model:
the weight size, read from the safetensors headers (nothing loaded), gives the fewest cores that hold
it (`--core_memory_gib` each, 24 GiB for an LNC=2 Trainium2 core; at most `--max_cores`); the model
is sharded tensor-parallel when it has a TP plan, expert-parallel alone when it is a mixture of experts
without one, and otherwise recorded as having no sharding plan. The run self-launches one process
per core (spawn; no torchrun), loads with `from_pretrained`, compiles the forward (`backend="neuron"`
on Trainium, inductor elsewhere) and generates 32 greedy tokens with a static cache. Verdicts:
a single-core run must equal, token for token, the same checkpoint run in eager mode on CPU
(`cpu_match`); a sharded run must read as fluent English to a small judge model (`english`).
A PASS says nothing about throughput or long outputs.

Each finished model is written at once, atomically, as one row of `<out_dir>/neuronx-cc-<v>__transformers-<v>.parquet`
(the public dataset's columns, plus device, compile_s, prompt, generated_text, judge; `run_py` holds
this file's exact source, to read, never to run). result is PASS or FAIL: FAIL for a verdict that
fails, and for a crash or a run past `--timeout_s` (then `error` holds what happened and the next
model runs); EXCLUDED when the model is not run (too big
for `--max_cores`, no sharding plan, or model code shipped with the checkpoint without
`--trust_remote_code`). A rerun skips models already recorded for the same version stack (`--redo`
runs them again). results.json lists the Parquet file and a summary per model.

Training compatibility (`--task train`): per model, a few steps of the HF-backend training recipe
(examples/train_hf_backend.py) from the checkpoint's weights; PASS when the losses are finite and
falling and the HF export re-reads with its check passing. Same Parquet file (column `task`), same lookup.

CPU (the default preset, `offline`: tiny Qwen3, tiny Qwen3-MoE and SmolLM2-135M-Instruct, from `make setup`):
    python examples/generate_compat_check.py --no_compile --out_dir runs/compat
    python examples/generate_compat_check.py --task train --out_dir runs/compat          # training rows
    python examples/generate_compat_check.py --models smollm2-135m-instruct --cores 3 --no_compile \\
        --out_dir runs/compat_tp               # a sharded run: 3 gloo processes, judged for English
    python examples/generate_compat_check.py lookup runs/compat --name qwen3     # search results
    python examples/generate_compat_check.py lookup runs/compat --name smollm2 --run_py   # print a row's script

One trn2.48xlarge (Neuron DLAMI with the guide's stack; models from the Hub):
    python examples/generate_compat_check.py --preset trn2_selected --out_dir runs/compat_trn2
    python examples/generate_compat_check.py --preset trn2_selected --models Qwen/Qwen3-8B --out_dir runs/compat_trn2

Expected (offline, --no_compile, busy 2-core CPU, about 2 minutes): three rows, all PASS with cpu_match
true on 1 core; the judge (run on single-core rows too in this preset) gives english true for SmolLM2
and false for the two random tiny models. Compiling with inductor on CPU costs about 90 s per model
and graph shape the first time (tiny Qwen3: 87 s of a 93 s wall time), about 11 s from inductor's
cache. The sharded SmolLM2 command above: 3 processes, english true, about 2 minutes.
"""
from __future__ import annotations

import json
import math
import os
import queue
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python examples/...` finds common/

from common import cli, device, paths  # noqa: E402
from compat_check import rows as compat  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.results import atomic_write_text, versions, write_results  # noqa: E402


@dataclass
class Config:
    preset: str = "offline"
    models: str = field(default="tiny-qwen3,tiny-qwen3-moe,smollm2-135m-instruct",
                        metadata={"help": "comma-separated: offline asset names, local HF folders, or Hub ids"})
    out_dir: str = field(default="runs/compat", metadata={"help": "Parquet results and results.json go here"})
    device: Literal["auto", "cpu", "cuda", "neuron"] = field(default="auto", metadata={"help": "auto: neuron, then cuda, then cpu"})
    core_memory_gib: float = field(default=24.0, metadata={"help": "memory of one core (24 GiB: an LNC=2 Trainium2 core)"})
    max_cores: int = field(default=16, metadata={"help": "most cores a model may use (16 = 4 Trainium2 chips)"})
    cores: int = field(default=0, metadata={"help": "0: the fewest that hold the weights; N: force N cores"})
    sharding: Literal["auto", "tp", "ep"] = field(default="auto", metadata={"help": "auto: TP if the model has a plan, else EP for MoE; tp/ep: force one (for runs on more than one core)"})
    dtype: Literal["auto", "float32", "bfloat16"] = field(default="auto", metadata={"help": "auto: the checkpoint's dtype"})
    no_compile: bool = field(default=False, metadata={"help": "skip torch.compile (by default the forward is compiled: neuron backend on Trainium, inductor elsewhere)"})
    fullgraph: bool = field(default=False, metadata={"help": "torch.compile(fullgraph=True): no graph breaks allowed. Off by default: "
                            "transformers 5.16's TP plans hook q_norm/k_norm for backward, which Dynamo cannot trace in one graph"})
    new_tokens: int = field(default=32, metadata={"help": "greedy tokens generated per model"})
    prompt: str = field(default="Once upon a time, in a small village by the sea,", metadata={"help": "the generation prompt"})
    timeout_s: int = field(default=1800, metadata={"help": "per-model limit (load, compile, generate); past it the run is killed and recorded as an error"})
    judge_model: str | None = field(default=None, metadata={"help": "English judge: folder or Hub id (default: SmolLM2-135M-Instruct from set-up)"})
    judge_max_perplexity: float = field(default=compat.JudgeLimits.max_perplexity, metadata={"help": "highest judge perplexity counted as fluent"})
    judge_single_core: bool = field(default=False, metadata={"help": "also judge single-core runs for English (recorded, not part of their verdict)"})
    trust_remote_code: bool = field(default=False, metadata={"help": "allow checkpoints that ship their own model code (refused by default)"})
    task: Literal["generate", "train"] = field(default="generate", metadata={"help": "generate: the inference protocol; train: a few steps of the HF-backend training recipe per model (training compatibility)"})
    train_steps: int = field(default=4, metadata={"help": "--task train: steps per model"})
    train_lr: float = field(default=3e-4, metadata={"help": "--task train: peak learning rate (low enough not to wreck pretrained weights)"})
    redo: bool = field(default=False, metadata={"help": "run models already recorded for this version stack again"})
    lnc: int = field(default=2, metadata={"help": "Trainium logical NeuronCore size (NEURON_LOGICAL_NC_CONFIG)"})

    def validate(self) -> None:
        for name in ("max_cores", "new_tokens", "timeout_s", "lnc", "train_steps"):
            if getattr(self, name) <= 0:
                raise UserError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.core_memory_gib <= 0 or self.judge_max_perplexity <= 0:
            raise UserError("--core_memory_gib and --judge_max_perplexity must be positive")
        if not 0 <= self.cores <= self.max_cores:
            raise UserError(f"--cores must be between 0 (automatic) and --max_cores {self.max_cores}, got {self.cores}")
        if not model_specs(self.models):
            raise UserError("--models is empty")


def offline() -> Config:
    """CPU default: tiny Qwen3, tiny Qwen3-MoE, SmolLM2-135M-Instruct, all from set-up; judge every row."""
    return Config(judge_single_core=True)


def trn2_selected() -> Config:
    """trn2.48xlarge: popular text-generation models from the Hub, bfloat16, neuron backend."""
    return replace(Config(), device="neuron", dtype="bfloat16", out_dir="runs/compat_trn2",
                   judge_model="HuggingFaceTB/SmolLM2-135M-Instruct", models=",".join((
        "Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-8B", "Qwen/Qwen3-14B",
        "Qwen/Qwen3-32B", "Qwen/Qwen3-30B-A3B-Instruct-2507", "meta-llama/Llama-3.2-1B-Instruct",
        "meta-llama/Llama-3.1-8B-Instruct", "mistralai/Mistral-7B-Instruct-v0.3", "google/gemma-3-1b-it",
        "microsoft/Phi-4-mini-instruct", "HuggingFaceTB/SmolLM2-1.7B-Instruct", "openai/gpt-oss-20b")))


PRESETS = {"offline": offline, "trn2_selected": trn2_selected}
OFFLINE_MODELS = {"tiny-qwen3": paths.tiny_qwen3_dir, "tiny-qwen3-moe": paths.tiny_qwen3_moe_dir,
                  "smollm2-135m-instruct": paths.smollm2_dir}
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]  # never pickles


def model_specs(text: str) -> list[str]:
    return [s.strip().rstrip("/") for s in text.split(",") if s.strip()]


def check_specs(specs: list[str]) -> None:
    """Paths must exist before anything runs; Hub ids are resolved per model (offline: an error row)."""
    for spec in specs:
        if spec.startswith(("/", "./", "../", "~")) and not Path(spec).expanduser().is_dir():
            raise UserError(f"--models: {spec} is not a folder (give an HF folder, an offline asset "
                            f"name ({', '.join(OFFLINE_MODELS)}) or a Hub id)")


def resolve_model(spec: str, with_code: bool = False) -> Path:
    """An HF folder for a model spec: a local folder, an offline asset, or a Hub snapshot (weights as
    safetensors; the checkpoint's own *.py files only when remote code is allowed)."""
    if Path(spec).expanduser().is_dir():
        return Path(spec).expanduser()
    if spec in OFFLINE_MODELS:
        return OFFLINE_MODELS[spec]()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(spec, allow_patterns=HUB_FILES + ["*.py"] * with_code))


# ------------------------------------------------------------------------------------------ one process per core
def worker(rank: int, job: dict, results) -> None:
    """One rank of a model's run (spawned). Reports ("ok", measurements) or ("error", traceback)."""
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


def generate_on_device(job: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dev = device.setup(job["device"], lnc=job["lnc"], timeout_s=job["timeout_s"])
    if dev.device_type == "cpu":  # ranks share the host's cores; oversubscribing them slows every rank
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dev.world_size))
    dtype = job["dtype"] if job["dtype"] == "auto" else getattr(torch, job["dtype"])
    load = {"dtype": dtype, "trust_remote_code": job["trust_remote_code"]}
    if job["runner"] in ("tp", "ep"):
        from transformers.distributed import DistributedConfig

        # transformers 5.16 shards from the config's plan: base_model_tp_plan, or base_model_ep_plan
        # (experts only, attention replicated) when enable_expert_parallel is set.
        load["distributed_config"] = DistributedConfig(tp_size=dev.world_size,
                                                       enable_expert_parallel=job["runner"] == "ep")
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["folder"], **load).eval()
    if job["runner"] == "single":
        model.to(dev.device)
    tok = AutoTokenizer.from_pretrained(job["folder"], trust_remote_code=job["trust_remote_code"])
    model.generation_config.disable_compile = True  # compiled explicitly below, or not at all
    if job["compile"]:
        backend = "neuron" if dev.device_type == "neuron" else "inductor"
        model.forward = torch.compile(model.forward, backend=backend, fullgraph=job["fullgraph"])
    ids = tok(job["prompt"], return_tensors="pt").input_ids
    greedy = {"max_new_tokens": job["new_tokens"], "do_sample": False,
              "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id}
    with torch.no_grad():
        out = model.generate(ids.to(dev.device), cache_implementation="static", **greedy)
    device.synchronize(dev.device_type)
    wall_s = time.perf_counter() - start
    tokens = out[0, ids.shape[1]:].tolist()
    report = {"tokens": tokens, "text": tok.decode(tokens, skip_special_tokens=True), "wall_s": wall_s,
              "compile_s": compat.compile_seconds() if job["compile"] else 0.0,
              "peak_bytes": device.peak_memory_bytes(dev.device_type)}
    if job["runner"] == "single":  # the reference: the same checkpoint, CPU, eager, default (dynamic) cache
        del model
        ref = AutoModelForCausalLM.from_pretrained(job["folder"], **load).eval()
        with torch.no_grad():
            ref_out = ref.generate(ids, **greedy)
        report["cpu_tokens"] = ref_out[0, ids.shape[1]:].tolist()
    return report


def run_processes(job: dict) -> dict:
    """Spawn one process per core, wait for all reports or the per-model time limit, kill leftovers."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")  # Neuron: the runtime must not be forked; CUDA neither
    results = ctx.Queue()
    job = dict(job, port=device._free_port())
    procs = [ctx.Process(target=worker, args=(rank, job, results)) for rank in range(job["cores"])]
    for p in procs:
        p.start()
    deadline, reports = time.monotonic() + job["timeout_s"], {}
    try:
        while len(reports) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out after {job['timeout_s']} s (load, compile and generate); "
                                   f"{len(reports)} of {len(procs)} ranks had finished")
            try:
                rank, status, payload = results.get(timeout=min(left, 2.0))
            except queue.Empty:
                dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in reports]
                if dead:
                    time.sleep(1.0)  # a report written just before exiting may still be in the pipe
                    if results.empty():
                        raise RuntimeError(f"rank {dead[0][0]} died with exit code {dead[0][1]} without a report")
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank}: {payload}")
            reports[rank] = payload
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    first = reports[0]
    first["peak_bytes"] = max(r["peak_bytes"] for r in reports.values())
    return first


# ------------------------------------------------------------------------------------------ one model
def check_model(cfg: Config, spec: str, dev_type: str, judge) -> dict:
    """Everything for one model: plan, run, verdicts. Returns the row (without versions and run_py)."""
    from transformers import AutoConfig

    row = {"model_id": spec, "device": dev_type, "prompt": cfg.prompt}
    folder = resolve_model(spec, with_code=cfg.trust_remote_code)
    if compat.needs_remote_code(folder) and not cfg.trust_remote_code:
        return dict(row, result="EXCLUDED", exclusion="ships its own model code (auto_map); pass --trust_remote_code to allow")
    hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code)
    run_bytes = {"auto": None, "float32": 4, "bfloat16": 2}[cfg.dtype]
    size = compat.weight_bytes(folder, run_bytes)
    need = compat.min_cores(size, cfg.core_memory_gib)
    plan = compat.choose_plan(hf_config, need, cfg.max_cores, cfg.sharding, cfg.cores)
    row.update(tp=plan.cores, runner=plan.runner, hbm_capacity_gb=plan.cores * cfg.core_memory_gib,
               notes=f"weights {size / device.GIB:.3f} GiB need {need} core(s) of {cfg.core_memory_gib:g} GiB")
    if plan.runner is None:
        return dict(row, result="EXCLUDED", exclusion=plan.exclusion)
    job = {"folder": str(folder), "cores": plan.cores, "runner": plan.runner, "device": dev_type,
           "dtype": cfg.dtype, "compile": not cfg.no_compile, "fullgraph": cfg.fullgraph, "prompt": cfg.prompt,
           "new_tokens": cfg.new_tokens, "timeout_s": cfg.timeout_s, "lnc": cfg.lnc,
           "trust_remote_code": cfg.trust_remote_code}
    try:
        rep = run_processes(job)
    except (TimeoutError, RuntimeError) as e:
        return dict(row, result="FAIL", error=str(e))
    row.update(wall_s=rep["wall_s"], compile_s=rep["compile_s"], hbm_peak_gb=rep["peak_bytes"] / device.GIB,
               generated_text=rep["text"])
    compiled = f"compiled ({'neuron' if dev_type == 'neuron' else 'inductor'})" if not cfg.no_compile else "eager"
    row["notes"] += f"; {plan.runner} on {plan.cores} {dev_type} process(es), {compiled}, static cache"
    if dev_type == "cpu":
        row["notes"] += "; hbm_peak_gb is the peak resident memory of a process (CPU has no HBM)"
    if plan.runner == "single":
        row["cpu_match"] = rep["tokens"] == rep["cpu_tokens"]
        if not row["cpu_match"]:
            diverge = next((i for i, (a, b) in enumerate(zip(rep["tokens"], rep["cpu_tokens"])) if a != b),
                           min(len(rep["tokens"]), len(rep["cpu_tokens"])))
            row["notes"] += f"; tokens differ from the CPU eager reference from new token {diverge}"
    if plan.runner != "single" or cfg.judge_single_core:
        verdict = judge().judge(rep["text"], cfg.prompt)
        row["english"], row["judge"] = verdict["english"], json.dumps(verdict)
    passed = row["cpu_match"] if plan.runner == "single" else row["english"]
    return dict(row, result="PASS" if passed else "FAIL")


# ------------------------------------------------------------------------------------------ --task train
TRAIN_SCRIPT = Path(__file__).resolve().parent / "train_hf_backend.py"
# One short document, repeated: every batch holds the same text, so a model that trains correctly
# lowers its loss step after step (on fresh text the batch-to-batch spread of a pretrained model's
# loss, about +-0.3 on SmolLM2, hides a few steps of learning).
TRAIN_TEXT = ("The harbour was quiet in the early morning, and the fishermen mended their nets while "
              "the gulls waited on the old stone wall.")


def fixed_text_dataset(folder: Path, copies: int = 256) -> Path:
    """A folder of JSON lines with one `text` field, as torchtitan's c4_test loader reads them."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "train.jsonl", (json.dumps({"text": TRAIN_TEXT}) + "\n") * copies)
    return folder


def train_model(cfg: Config, spec: str, dev_type: str, out_dir: Path) -> dict:
    """Training compatibility: a few steps of the HF-backend recipe (examples/train_hf_backend.py,
    torchtitan's Transformers backend) from the checkpoint's own weights on one repeated text
    (TRAIN_TEXT), as a subprocess with the per-model time limit, then its HF export re-read by
    transformers. PASS: every loss finite, the last below the first, the export check passed."""
    row = {"model_id": spec, "device": dev_type, "task": "train", "runner": "train_hf_backend", "tp": 1}
    folder = resolve_model(spec)
    if compat.needs_remote_code(folder):
        return dict(row, result="EXCLUDED", exclusion="ships its own model code (auto_map); training never runs it")
    run_dir = out_dir / "train_runs" / re.sub(r"[^A-Za-z0-9._-]", "_", spec)
    data = fixed_text_dataset(out_dir / "train_runs" / "fixed_text")
    cmd = [sys.executable, str(TRAIN_SCRIPT), "--hf_checkpoint", str(folder), "--steps", str(cfg.train_steps),
           "--dataset", str(data),
           "--lr", str(cfg.train_lr), "--warmup_steps", "1", "--seq_len", "64", "--local_batch_size", "2",
           "--device", cfg.device, "--out_dir", str(run_dir)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.timeout_s)
    except subprocess.TimeoutExpired:
        return dict(row, result="FAIL", error=f"timed out after {cfg.timeout_s} s (training and export)")
    row["wall_s"] = time.perf_counter() - start
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        return dict(row, result="FAIL", error=errors[-1] if errors else proc.stderr[-3000:])
    res = json.loads((run_dir / "results.json").read_text())
    losses, check = res["losses"], res["export_check"] or {}
    finite = all(math.isfinite(x) for x in losses)
    falling = finite and len(losses) > 1 and losses[-1] < losses[0]
    reasons = [text for ok, text in ((finite, "a loss is not finite"), (falling, "loss did not fall"),
                                     (check.get("passed"), "export check failed")) if not ok]
    row.update(train_losses=json.dumps(losses), train_tokens_per_s=res["tokens_per_s"],
               export_max_abs_logit_diff=check.get("max_abs_logit_diff"),
               notes=f"{len(losses)} steps of train_hf_backend.py on one repeated text, loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
                     f"export: missing {check.get('missing_keys')}, unexpected {check.get('unexpected_keys')}"
                     + ("; " + "; ".join(reasons) if reasons else ""))
    return dict(row, result="FAIL" if reasons else "PASS")


def main(cfg: Config) -> dict:
    from tqdm import tqdm

    out_dir = cli.check_out_dir(cfg.out_dir).resolve()
    specs = model_specs(cfg.models)
    check_specs(specs)
    dev_type = device.resolve_device_type(cfg.device)
    judge_dir = Path(cfg.judge_model) if cfg.judge_model else paths.smollm2_dir()
    run_py = Path(__file__).read_text()  # the exact source that runs: stored with every row, never executed
    if cfg.task == "train":  # the training script runs too: keep its source beside this one
        run_py += f"\n# ---- {TRAIN_SCRIPT.name}, run as a subprocess by --task train ----\n" + TRAIN_SCRIPT.read_text()
    stack = compat.stack_versions()
    path = compat.results_file(out_dir, stack)
    print(f"[config] {cli.format_config(cfg)}", flush=True)
    print(f"[stack] {json.dumps(stack)} -> {path}", flush=True)

    judge_cache = []

    def judge():
        if not judge_cache:
            limits = compat.JudgeLimits(max_perplexity=cfg.judge_max_perplexity)
            judge_cache.append(compat.EnglishJudge(judge_dir if judge_dir.is_dir() else resolve_model(str(judge_dir)), limits))
        return judge_cache[0]

    summary, results = [], {"script": "generate_compat_check.py", "config": cfg, "versions": versions(),
                            "stack": stack, "files": [str(path)], "models": []}
    bar = tqdm(specs, desc="models", unit="model", file=sys.stdout)
    for spec in bar:
        bar.set_postfix_str(spec)
        old = None if cfg.redo else compat.recorded(path, spec, stack, cfg.task)
        if old is not None:
            summary.append({"model_id": spec, "skipped": True, "result": old["result"]})
            tqdm.write(f"[skip] {spec}: already recorded for this stack ({old['result']}); --redo to run again")
            continue
        t0 = time.perf_counter()
        try:
            row = train_model(cfg, spec, dev_type, out_dir) if cfg.task == "train" else \
                dict(check_model(cfg, spec, dev_type, judge), task="generate")
        except Exception as e:  # noqa: BLE001  one model's failure is its row; the next model still runs
            row = {"model_id": spec, "device": dev_type, "prompt": cfg.prompt, "task": cfg.task, "result": "FAIL",
                   "error": f"{type(e).__name__}: {e}"[:4000]}
        row.update(stack, run_py=run_py)
        compat.write_row(path, row)
        keys = ("task", "result", "tp", "runner", "cpu_match", "english", "wall_s", "compile_s", "hbm_peak_gb",
                "train_losses", "exclusion", "error")
        summary.append({"model_id": spec, "skipped": False, **{k: row.get(k) for k in keys}})
        tqdm.write(f"[model] {spec}: {row['result']} cores={row.get('tp')} runner={row.get('runner')} "
                   f"cpu_match={row.get('cpu_match')} english={row.get('english')} wall={row.get('wall_s') or 0:.1f}s "
                   f"compile={row.get('compile_s') or 0:.1f}s ({time.perf_counter() - t0:.0f} s in all)"
                   + (f" error: {str(row['error']).strip().splitlines()[0][:200]}" if row.get("error") else "")
                   + (f" excluded: {row['exclusion']}" if row.get("exclusion") else ""))
        results["models"] = summary
        write_results(out_dir, results)
    results["models"] = summary
    write_results(out_dir, results)
    print(f"[done] {len(summary)} model(s); rows in {path}", flush=True)
    return results


if __name__ == "__main__":
    if sys.argv[1:2] == ["lookup"]:
        sys.exit(compat.lookup_main(sys.argv[2:]))
    sys.exit(cli.run_cli(main, Config, PRESETS, __doc__, default_preset="offline"))
