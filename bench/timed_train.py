"""Run one training example two ways with the same per-step timer, for the training benchmarks.

    python bench/timed_train.py --mode ours  --timing_file T.json examples/train_native_qwen3.py --steps 20 --no-export
    python bench/timed_train.py --mode stock --timing_file T.json examples/train_native_qwen3.py --steps 20 --no-export
    python bench/timed_train.py --mode stock --fix_hf_rotary --timing_file T.json examples/train_hf_backend.py \
        --steps 20 --no-export

`ours`: the example's own command line, unchanged (`runpy`, as `python examples/X.py ARGS` runs it,
with examples/ on sys.path as it is there).

`stock`: torchtitan's own entry point, `torchtitan.train.main()` (what `python -m torchtitan.train`
runs: tyro parses the config, `config.build()`, `trainer.train()`, `trainer.close()`, process group
torn down), handed the very Trainer.Config the example builds for the same flags. That config comes
from the examples' documented steps, the ones each example's docstring walks through: its `Config`
and `PRESETS` (the command line parsed into a config), `inputs(recipe, cfg)` (inputs checked and found)
and its recipe's `trainer_config(cfg, dev, out_dir, found)` (the Trainer.Config). Nothing private to an
example is used. torchtitan gets it through `--module __main__ --config prepared_config` (its
ConfigManager imports a config function by module and name, and this module is `__main__`). Only
what torchtitan cannot do on a CPU by itself is added, each item being what the example does too:
  - torchtitan's device is routed to the CPU before it is imported (`device.route_torchtitan_device`);
  - RANK/WORLD_SIZE/MASTER_* are filled in for a single process (`device.fill_single_process_env`);
  - the settings inside the config: SDPA with document masking for FlexAttention, gloo SUM
    reductions, CUDA graphs off (all from `build_trainer_config`);
  - with `--fix_hf_rotary` (for the Transformers backend, examples/train_hf_backend.py): Qwen3's
    rotary `inv_freq` recomputed after the build with examples/hf_backend/fixes.py (transformers
    leaves it uninitialised; the example does the same at the same point).
torchtitan creates its own process group (gloo on CPU); the example creates it itself. Neither
run writes an HF export when `--no-export` is passed (the benchmarks do).

Timer (the same in both modes): `Trainer.train` records its start and `MetricsProcessor.log`, which
the trainer calls once at the end of every step, records the time, the process's CPU time (all
threads; less sensitive than wall time to other processes on a shared machine), loss, tokens seen
and torchtitan's FLOPs per token. The example's own LossRecorder wraps the same call in `ours` mode;
it is part of the example's path and is measured with it. Rank 0 writes the record as JSON.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))  # as `python examples/X.py` has it: `from hf_backend import fixes`

from common import cli  # noqa: E402
from common import device  # noqa: E402
from common.harness.lifecycle import parse  # noqa: E402
from common.results import atomic_write_text  # noqa: E402

RECORD: dict = {"mode": None, "script": None, "start": None, "steps": [], "times": [], "losses": [],
                "tokens_seen": [], "cpu_times": [], "flops_per_token": None, "world_size": None}
_PREPARED: dict = {}


def load_example(path: Path):
    spec = importlib.util.spec_from_file_location(f"bench_example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def install_timer(fix_hf_rotary: bool) -> None:
    """Class-level wraps of Trainer.train and MetricsProcessor.log (after torchtitan is routed)."""
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.trainer import Trainer

    log, train = MetricsProcessor.log, Trainer.train

    def timed_log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None, *a, **k):
        RECORD.setdefault("first_step_end_wall", time.time())  # the command's time to step 1 (common_bench)
        RECORD["times"].append(time.perf_counter())
        RECORD["cpu_times"].append(time.process_time())
        RECORD["steps"].append(int(step))
        RECORD["losses"].append(float(global_avg_loss))
        RECORD["tokens_seen"].append(int((extra_metrics or {}).get("n_tokens_seen", 0)))
        RECORD["flops_per_token"] = int(self.num_flops_per_token)
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics, *a, **k)

    def timed_train(self, *a, **k):
        if fix_hf_rotary:
            from hf_backend import fixes as hf_fixes
            hf_fixes.recompute_rotary_buffers(self.model_parts[0])
            hf_fixes.check_rotary_buffers(self.model_parts[0])
        RECORD["start"] = time.perf_counter()
        RECORD["times"].append(RECORD["start"])  # times[0]: training starts; times[i]: step i ends
        RECORD["cpu_times"].append(time.process_time())
        return train(self, *a, **k)

    MetricsProcessor.log, Trainer.train = timed_log, timed_train


def prepared_config():
    """The config function torchtitan's ConfigManager imports (`--module __main__ --config prepared_config`)."""
    return _PREPARED["config"]


def run_stock(example, args: list[str]) -> None:
    """torchtitan's own entry point on the Trainer.Config the example's recipe builds (its declared `RECIPE`)."""
    import torch

    from common.recipe import inputs

    recipe = example.RECIPE
    cfg = parse(recipe, args)  # the example's flags and the guards'

    out_dir = cli.check_out_dir(cfg.out_dir).resolve()
    found = inputs(recipe, cfg)
    device.fill_single_process_env()
    dev_type = device.resolve_device_type(cfg.device)
    dev = device.DeviceInfo(torch.device(dev_type), dev_type, device.BACKENDS[dev_type],
                            int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")),
                            int(os.environ["WORLD_SIZE"]))
    tc, _notes = recipe.trainer_config(cfg, dev, out_dir, found)
    # The scripts keep torchtitan's checkpointer on so that a stop can save any step (common/harness/resume.py), and
    # save nothing at the end without --export; torchtitan's own loop would write a last save: off, as before.
    tc.checkpoint.enable = bool(getattr(cfg, "export", False) or cfg.guards.checkpoint_every != "0")
    # The example stages its tokenizer into OUT_DIR/hf_assets; torchtitan reads the source folder.
    tc.hf_assets_path = str(found.hf_folder or found.tokenizer_dir)
    _PREPARED["config"] = tc
    from torchtitan import train as titan_train

    sys.argv = ["torchtitan.train", "--module", "__main__", "--config", "prepared_config"]
    titan_train.main()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--mode", choices=("ours", "stock"), required=True)
    parser.add_argument("--timing_file", required=True)
    parser.add_argument("--fix_hf_rotary", action="store_true",
                        help="stock mode, Transformers backend: recompute the rotary buffers after the build "
                             "(examples/hf_backend/fixes.py), as train_hf_backend.py does itself")
    parser.add_argument("script", help="examples/train_*.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the example's flags")
    ns = parser.parse_args()
    if ns.fix_hf_rotary and ns.mode != "stock":
        parser.error("--fix_hf_rotary is for --mode stock (in --mode ours the example applies its own fixes)")
    script = Path(ns.script).resolve()
    example = load_example(script)
    cfg = parse(example.RECIPE, ns.args)  # the example's flags and the guards'

    device.route_torchtitan_device(device.resolve_device_type(cfg.device))
    install_timer(fix_hf_rotary=ns.fix_hf_rotary)
    RECORD.update(mode=ns.mode, script=script.name, args=ns.args)
    code = 0
    try:
        if ns.mode == "ours":
            sys.argv = [str(script), *ns.args]
            try:
                runpy.run_path(str(script), run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        else:
            run_stock(example, ns.args)
    finally:
        RECORD["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
        if int(os.environ.get("RANK", "0")) == 0 and RECORD["steps"]:
            atomic_write_text(ns.timing_file, json.dumps(RECORD, indent=1) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
