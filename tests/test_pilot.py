"""The pilot fields every training script writes into results.json: timing (first step apart from the steady
steps), FLOPs per token from the model's shape (the same for the HF backend and the native model), MFU against a
stated peak, memory against the dry run's plan, cost; the dry run's projection of the full run (TensorBoard:
tests/test_eval.py)."""
from __future__ import annotations

import json
import sys

import pytest

from common import device
from conftest import ROOT, assert_clean_error, read_results, run_example, run_in_process, run_python, script_env

PILOT = ("timing", "flops_per_token", "mfu", "peak_flops_per_device", "memory", "cost")


def _check_pilot(r: dict, *, ranks: int = 1, priced: bool = False) -> None:
    assert all(k in r for k in PILOT), sorted(set(PILOT) - set(r))
    t = r["timing"]
    # which is larger depends on how busy the machine is; the arithmetic: test_timing_sets_the_warm_up_apart
    assert t["first_step_s"] > 0 and t["steady_step_s"] > 0 and t["warmup_steps_excluded"] >= 1
    assert t["compile_or_warmup_s"] == pytest.approx(max(t["first_step_s"] - t["steady_step_s"], 0))
    assert t["steady_tokens_per_s_per_rank"] == pytest.approx(t["steady_tokens_per_s"] / ranks)
    peak = r["peak_flops_per_device"]
    # CPU: the best matmul measured on this machine (CPU time), kept across runs; an MFU against it is indicative
    assert peak["value"] > 1e9 and peak["source"].startswith("the best of ") and peak["indicative"] is True, peak
    assert 0 < r["mfu"] < 1, r["mfu"]  # a fraction, and not torchtitan's 0.00% against an accelerator's peak
    assert r["mfu"] == pytest.approx(r["flops_per_token"] * t["steady_tokens_per_s"] / (peak["value"] * ranks))
    m = r["memory"]
    assert len(m["peak_gib"]) == ranks and all(g > 0 for g in m["peak_gib"]) and m["measured_by"]
    assert m["planned_gib"] > 0 and m["comparable"] is False and m["ratio"] is None  # a CPU run's resident set
    assert m["not_comparable"].startswith("CPU run: the peak is the process's resident set")
    if priced:
        c = r["cost"]
        assert c["run_cost"] == pytest.approx(c["price_per_hour"] * c["run_hours"])
        assert c["per_million_tokens"] == pytest.approx(c["price_per_hour"] / (t["steady_tokens_per_s"] * 3600) * 1e6)
    else:
        assert r["cost"] is None


def test_timing_sets_the_warm_up_apart():
    """Step 1 on its own, the steady figure the median of the steps after the warm-up (2 steps from 5 steps on),
    tokens a second from the tokens seen."""
    from common.losses import LossRecorder
    from common.harness.pilot import timing

    ends = [0.0, 9.0, 12.0, 13.0, 14.5, 15.5, 16.5]  # start, then the end of steps 1..6: 9, 3, 1, 1.5, 1, 1 s
    rec = LossRecorder(steps=list(range(1, 7)), losses=[1.0] * 6, times=ends, tokens_seen=[64 * s for s in range(1, 7)])
    t = timing(rec, world_size=2)
    assert (t["first_step_s"], t["steady_step_s"], t["warmup_steps_excluded"]) == (9.0, 1.0, 2)
    assert t["compile_or_warmup_s"] == 8.0 and t["tokens_per_step"] == 64
    assert (t["steady_tokens_per_s"], t["steady_tokens_per_s_per_rank"]) == (64.0, 32.0)
    quick_first = timing(LossRecorder(steps=[1, 2, 3], losses=[1.0] * 3, times=[0.0, 1.0, 3.0, 5.0],
                                      tokens_seen=[64, 128, 192]), 1)
    assert quick_first["compile_or_warmup_s"] == 0.0  # step 1 faster than the steady steps: no warm-up, not -1 s
    short = timing(LossRecorder(steps=[1, 2, 3], losses=[1.0] * 3, times=ends[:4], tokens_seen=[64, 128, 192]), 1)
    assert (short["steady_step_s"], short["warmup_steps_excluded"]) == (2.0, 1)  # median of 3 s and 1 s


def test_native_pilot_fields(shared_run):
    _check_pilot(shared_run("native_tiny")[1])
    _check_pilot(shared_run("native_2_ranks_8_steps")[1], ranks=2)


def test_the_time_to_step_1_is_split_into_its_phases(shared_run):
    """The 2-rank run from HF weights (the scripts' own launch: its checks, a plan, a load check) and the 1-rank run
    from random weights: each phase of the command's time to the end of step 1, in the order a run goes through them."""
    order = ["launch", "imports", "checks", "plan", "device", "build", "load", "load check", "first step"]
    two = shared_run("native_2_ranks_8_steps")[1]["time_to_first_step"]
    assert list(two["phases"]) == order
    assert all(v >= 0 for v in two["phases"].values()) and two["phases"]["first step"] > 0
    assert abs(two["total_s"] - sum(two["phases"].values())) < 1e-6
    assert all(two["longest_over_ranks"][k] >= v for k, v in two["phases"].items())
    one = shared_run("native_tiny")[1]["time_to_first_step"]
    assert list(one["phases"]) == order and one["phases"]["launch"] == 0  # one process, no launch of its own


def test_hf_backend_pilot_fields_and_the_same_flops_as_the_native_model(shared_run):
    """The same tiny Qwen3 counts the same FLOPs per token through torchtitan's Transformers backend and its own
    model (torchtitan's own count for the backend is about a hundredth of it)."""
    hf_run = shared_run("hf_tiny")[1]
    _check_pilot(hf_run, priced=True)
    native = shared_run("native_tiny")[1]
    assert hf_run["flops_per_token"] == pytest.approx(native["flops_per_token"], rel=0.01)
    assert native["flops_per_token"] > 50e6  # 6 x ~9.8 M parameters a token passes through, plus attention


def test_moe_pilot_fields_count_active_experts_only(shared_run):
    r = shared_run("moe_tiny_2_ranks")[1]
    _check_pilot(r, ranks=2)
    from common.harness.pilot import flops_per_token

    shape, seq = r["model_shape"], r["config"]["seq_len"]
    all_experts = dict(shape, num_experts_per_tok=shape["num_experts"])
    assert r["flops_per_token"] == flops_per_token(shape, seq) < flops_per_token(all_experts, seq)


def test_dry_run_projects_the_full_runs_time_and_cost(shared_run):
    """--dry_run with --assumed_mfu and --price_per_hour (the shared 4B dry run: 0.3 and 50): the full run's time from
    its FLOPs at that MFU of trn2's peak (158 TFLOPS a logical core), and its cost."""
    out, results = shared_run("native_4b_dry_run")
    p = results["projection"]
    assert p["world_size"] == 64 and p["tokens_per_step"] == 64 * 4096 and p["peak_flops_per_device"] == 158e12
    seconds = 10 * 64 * 4096 * p["flops_per_token"] / (0.3 * 158e12 * 64)
    assert p["seconds"] == pytest.approx(seconds) and p["cost"] == pytest.approx(50 * seconds / 3600)
    assert 25e9 < p["flops_per_token"] < 40e9  # Qwen3-4B: 6 x ~4 B + attention at 4096 tokens
    assert "[plan] 10 steps x 262,144 tokens" in (out.parent / "native_4b_dry_run.log").read_text()


PLAN_AFTER_THREADED_OPS = """
import sys, torch
sys.path.insert(0, {root!r})
from common.harness import pilot
torch.set_num_threads(2)
x = torch.randn(2000, 2000)
torch.nn.functional.gelu(x @ x).sum()  # the parent's OpenMP pool now has a second thread
plan = lambda: int(torch.nn.functional.gelu(torch.randn(2000, 2000)).numel())  # a parallel region in the child
print(pilot._plan_in_a_child(plan, "cpu", lambda device_type: None))
"""


def test_the_plan_is_made_in_a_child_after_the_parent_ran_ops_on_several_threads(tmp_path):
    """torch's default threads: once an op has run, a forked child's first parallel region waits forever for the
    parent's OpenMP threads (the plan then came back only at PLAN_TIMEOUT_S, as None). The child plans on one
    thread and answers."""
    import subprocess
    import sys

    from conftest import ROOT, script_env

    env = dict(script_env(), OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", PLAN_AFTER_THREADED_OPS.format(root=str(ROOT))], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [str(round(4_000_000 / (1 << 30), 4))], proc.stdout



# --profile, an impossible MFU, the compile cache, trn2's peak per LNC: one short profiled run (2 steps of the tiny
# preset, its last step traced) read by the tests below; everything else in-process.

@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory, prepared_assets):
    """The tiny preset at 512-token sequences, 2 steps, step 2 traced, against a peak of 1e-3 TFLOPS (--peak_tflops's
    lower bound): at about 60 MFLOP a token, any step of its 1,024 tokens under a minute (a few seconds here, profiled;
    a machine ten times busier stays well under) is more than that peak can do, an MFU above 1."""
    out = tmp_path_factory.mktemp("profiled") / "run"
    proc = run_example("train_native_qwen3.py", "--steps", "2", "--seq_len", "512", "--profile",
                       "--peak_tflops", "0.001",
                       "--tensorboard", "--no-export", "--out_dir", str(out))
    return out, read_results(out), proc


def test_profile_traces_the_last_step_into_the_run_folder(profiled_run):
    """--profile: torchtitan's own profiler settings (profile_freq 0: the last step); a gzipped Chrome trace of
    step 2 in OUT_DIR/profile_traces, listed in results.json with its size; memory against the plan marked not
    comparable there and in the [pilot] line."""
    import gzip
    import json

    out, r, proc = profiled_run
    p = r["profile"]
    assert (p["every"], p["steps"], p["folder"], p["activities"]) == (2, [2], "profile_traces", "CPU")
    (trace,) = p["traces"]
    assert trace["path"] == "profile_traces/iteration_2/rank0_trace.json.gz" and trace["step"] == 2
    path = out / trace["path"]
    assert path.stat().st_size == trace["bytes"] > 0
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    assert any(e.get("name", "").startswith("ProfilerStep#") for e in events)  # the traced training step
    assert sorted(q.name for q in (out / "profile_traces").iterdir()) == ["iteration_2"]  # step 1: warm-up only
    m = r["memory"]
    assert m["comparable"] is False and m["ratio"] is None and "profiler" in m["not_comparable"]
    assert m["planned_gib"] > 0 and m["peak_gib"][0] > 0
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("[pilot]")]
    assert "(not comparable: a profiled run)" in line and "1 profile trace(s) in profile_traces" in line
    print(f"trace {path} {trace['bytes']} bytes")


def test_an_impossible_mfu_is_null_with_its_reason(profiled_run):
    """An MFU above 1 is no measurement: results.json's mfu is null with mfu_note, one warning line names the
    peak and its source, the [pilot] line prints no number, torchtitan's step lines say N/A and its TensorBoard
    log has no mfu(%) point."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, r, proc = profiled_run
    would_be = r["flops_per_token"] * r["timing"]["steady_tokens_per_s"] / r["peak_flops_per_device"]["value"]
    assert would_be > 1 and r["peak_flops_per_device"] == {"value": 1e9, "source": "--peak_tflops"}
    assert r["mfu"] is None and "above 1" in r["mfu_note"] and "0.001 TFLOPS" in r["mfu_note"]
    warnings = [x for x in proc.stderr.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 1 and "0.001 TFLOPS a device (--peak_tflops)" in warnings[0], warnings
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("[pilot]")]
    assert "MFU - (left out" in line
    steps = [x for x in proc.stdout.splitlines() + proc.stderr.splitlines() if "step:" in x and "mfu:" in x]
    assert len(steps) == 2 and all("mfu: N/A" in x for x in steps), steps
    (tb,) = list((out / "tb").iterdir())
    events = EventAccumulator(str(tb))
    events.Reload()
    assert "loss_metrics/global_avg_loss" in events.Tags()["scalars"] and "mfu(%)" not in events.Tags()["scalars"]


def test_mfu_is_never_above_one_nor_against_a_peak_that_is_not_positive():
    """In-process, on a fixed step record: the same run against a peak it cannot exceed, one it exceeds, and peaks
    that are no peaks."""
    from common.harness import pilot
    from common.losses import LossRecorder

    rec = LossRecorder(steps=[1, 2, 3], losses=[1.0] * 3, times=[0.0, 5.0, 6.0, 7.0], tokens_seen=[256, 512, 768])
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 1000, "num_attention_heads": 4,
             "intermediate_size": 128}
    memory = {"peak_gib": [1.0], "measured_by": "test"}

    def rep(value, source="--peak_tflops"):
        return pilot.report(rec, shape=shape, seq_len=128, world_size=1, peak={"value": value, "source": source},
                            memory=memory, planned_gib=2.0, price_per_hour=None)

    flops = pilot.flops_per_token(shape, 128) * 256  # FLOP/s: 256 tokens a second
    over = rep(flops / 2)
    assert over["mfu"] is None and "MFU would be 2, above 1" in over["mfu_note"]
    assert "(--peak_tflops)" in pilot.mfu_warning(over) and "MFU - (left out" in pilot.format_line(over)
    ok = rep(10 * flops)
    assert ok["mfu"] == pytest.approx(0.1) and ok["mfu_note"] is None and pilot.mfu_warning(ok) is None
    assert "MFU 0.100 of" in pilot.format_line(ok) and "ran on the CPU" not in pilot.format_line(ok)
    fell_back = {**ok, "fallback_ops": {"ops": ["aten::_unique2", "aten::nonzero"], "count": 2}}  # a Neuron run's
    assert pilot.format_line(fell_back).endswith("; 2 op(s) ran on the CPU: aten::_unique2, aten::nonzero")
    assert pilot.fallback_ops("cpu") is None
    for bad in (0.0, -1e12, float("nan"), float("inf")):
        r = rep(bad, "torchtitan get_peak_flops")
        assert r["mfu"] is None and "not a positive number" in r["mfu_note"], bad
        assert "(torchtitan get_peak_flops)" in pilot.mfu_warning(r)


def test_peak_tflops_has_a_real_lower_bound():
    """--peak_tflops 1e-300 was taken and printed an MFU of 298 digits: the flag now takes no less than 1e-3
    TFLOPS (1 GFLOP/s), one error line naming the bound."""
    import train_native_qwen3 as script

    from common.errors import UserError
    from common.harness import lifecycle

    def parse(value):
        return lifecycle.parse(script.RECIPE, ["--peak_tflops", value])  # the recipe's flags and the guards'

    assert parse("0.001").guards.peak_tflops == 0.001 and parse("1e5").guards.peak_tflops == 1e5
    for value in ("1e-300", "0.0009", "0"):
        with pytest.raises(UserError, match="^--peak_tflops .*1 GFLOP/s"):
            parse(value)


def test_trn2_peak_is_79_tflops_per_neuroncore_times_the_lnc():
    """torchtitan's trn2 peak multiplies by 2 whatever the LNC: here 79 TFLOPS x --lnc, computed without the Neuron
    runtime (this host has none), AWS's per-chip figure in the source; the dry run's projection uses it too."""
    import importlib.util

    from common.harness import pilot

    assert importlib.util.find_spec("torch_neuronx") is None  # the number needs no torch.neuron
    one, two = (pilot.peak_flops("neuron", "bfloat16", None, lnc=lnc) for lnc in (1, 2))
    assert (one["value"], two["value"]) == (79e12, 158e12)
    assert "x LNC=1" in one["source"] and "667" in one["source"] and "8 NeuronCores" in one["source"]
    assert pilot.peak_flops("neuron", "bfloat16", 100.0, lnc=1) == {"value": 100e12, "source": "--peak_tflops"}
    flops, tps = 1e9, 1e4  # the same throughput is twice the MFU of one NeuronCore as of two
    assert pilot.checked_mfu(flops, tps, one, 1)[0] == pytest.approx(2 * pilot.checked_mfu(flops, tps, two, 1)[0])


def test_memory_is_read_after_the_neuron_device_finished_its_work():
    """AWS's memory guide: the Neuron allocator is asynchronous, read its statistics after torch.neuron.synchronize().
    Read from the source (no Neuron runtime here): each step's peak (common/harness/trainer.py's step_peak_bytes)
    synchronizes the device module on Neuron before it reads the peak."""
    import ast

    tree = ast.parse((ROOT / "common" / "harness" / "trainer.py").read_text())
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "step_peak_bytes")
    calls = [(n.lineno, ast.unparse(n.func)) for n in ast.walk(body) if isinstance(n, ast.Call)]
    sync = next(line for line, call in calls if call.endswith("device_module.synchronize"))
    read = next(line for line, call in calls if call == "neuron_peak_memory")
    guard = next(n for n in ast.walk(body) if isinstance(n, ast.If))
    assert "neuron" in ast.unparse(guard.test) and sync < read


@pytest.mark.parametrize("version, documented", [
    ("2.14.3.0.7631", False), ("2.14.3.1.1234", True), ("2.13.3.1", True), ("2.13.3.0", False),
    ("2.14.4.0", True), ("2.15.0", True), ("2.12.9", False), (None, False), ("2.14.3", False)])
def test_torch_accelerator_memory_is_read_from_the_torchneuron_that_documents_it(version, documented):
    """Neuron 2.34.0's TorchNeuron (2.14.3.1, 2.13.3.1) documents torch.accelerator's memory functions on Neuron;
    2.33's (2.14.3.0) does not, and its peak is read with torch.neuron's."""
    from common.device import accelerator_memory_documented

    assert accelerator_memory_documented(version) is documented


def test_compile_cache_cold_then_warm_counted_on_a_real_folder(tmp_path, monkeypatch, profiled_run):
    """timing.compile_cache: the cache folder's entries counted before step 1 and after it; a first run that adds
    entries found it cold, a second that adds none warm. Counted here on a real folder in-process, as a compile
    fills it (a CPU run compiles nothing: the profiled run says "none"); and where each device's cache is."""
    from common.harness import compile_cache as pilot  # the watch and the folders live with the shared cache

    assert profiled_run[1]["timing"]["compile_cache"]["state"] == "none"
    folder = tmp_path / "inductor"
    where = {"kind": "inductor", "dir": str(folder), "dir_from": "TORCHINDUCTOR_CACHE_DIR"}
    first = pilot.CompileCacheWatch(where, "cpu")
    first.start()  # no folder yet: 0 entries
    (folder / "fxgraph" / "ab").mkdir(parents=True)
    for name in ("graph.py", "kernel.so"):
        (folder / "fxgraph" / "ab" / name).write_text("compiled")
    first.first_step()
    first.first_step()  # only the first call (step 1) counts
    assert first.result() == {**where, "entries_before": 0, "entries_after": 2, "state": "cold"}
    second = pilot.CompileCacheWatch(where, "cpu")
    second.start()
    (folder / "locks").mkdir()  # a compile served from the cache still takes inductor's lock files: not entries
    (folder / "locks" / "cab.lock").write_text("")
    second.first_step()
    assert second.result() == {**where, "entries_before": 2, "entries_after": 2, "state": "warm"}

    assert pilot.compile_cache_folder("cpu", compiled=False) is None
    assert pilot.CompileCacheWatch(None, "cpu").result()["state"] == "none"
    aot = pilot.CompileCacheWatch(where, "cpu", backend="aot_eager")  # compiles, generates no code, keeps none
    aot.start()
    aot.first_step()
    assert aot.result()["state"] == "none" and "aot_eager backend keeps nothing" in aot.result()["note"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
    assert pilot.compile_cache_folder("cpu", compiled=True) == where
    # Neuron: the folder the run sets is the folder watched, and only NEFFs count (not a lock or a log beside them)
    monkeypatch.delenv("TORCH_NEURONX_NEFF_CACHE_DIR", raising=False)
    assert pilot.compile_cache_folder("neuron", compiled=False)["dir"] == "/tmp/neff_cache"  # TorchNeuron's own
    out = tmp_path / "run"
    assert device.neff_cache_dir(None, out) == str(out / "neff_cache")  # beside the run, a folder that lasts
    assert device.neff_cache_dir("/fsx/neff", out) == "/fsx/neff"
    cache = device.neff_cache_dir(None, out)
    for var in ("TORCH_NEURONX_NEFF_CACHE_DIR", "NEURON_LOGICAL_NC_CONFIG"):  # restored after the test
        monkeypatch.setenv(var, "unset")
    device.set_neuron_env(2, cache)
    neff = pilot.compile_cache_folder("neuron", compiled=False)
    assert neff == {"kind": "neff", "dir": str(out / "neff_cache"), "dir_from": "TORCH_NEURONX_NEFF_CACHE_DIR"}
    assert device.neff_cache_dir(None, tmp_path / "other") == str(out / "neff_cache")  # the user's variable
    watch = pilot.CompileCacheWatch(neff, "neuron")
    (out / "neff_cache" / "MODULE_1").mkdir(parents=True)
    (out / "neff_cache" / "MODULE_1" / "model.lock").write_text("")
    watch.start()
    (out / "neff_cache" / "MODULE_1" / "model.neff").write_text("compiled")
    watch.first_step()
    assert (watch.result()["entries_before"], watch.result()["entries_after"], watch.result()["state"]) == (0, 1, "cold")


@pytest.mark.parametrize("args, needle", [
    (("--steps", "2", "--profile", "--profile_freq", "3"), "--profile_freq 3 is more than --steps 2"),
    (("--steps", "3", "--profile", "--profile_freq", "1"), "--profile_freq 1 leaves the profiler no warm-up step"),
    (("--steps", "1", "--profile"), "--steps 1 leaves the profiler no warm-up step"),
    (("--steps", "2", "--profile_freq", "2"), "--profile_freq 2 traces nothing without --profile"),
])
def test_profile_settings_that_would_trace_nothing_are_refused(tmp_path, args, needle):
    proc = run_in_process("train_native_qwen3.py", *args, "--out_dir", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert_clean_error(proc, needle)
    assert not (tmp_path / "o").exists()


PROFILER_ON_CPU = """
import gzip, json, os, sys, tempfile
sys.path.insert(0, {root!r})
import torch
from common import device
dev = device.setup("cpu")
from dataclasses import dataclass
from torchtitan.tools.profiler import Profiler
from common.harness.trainer import GuardedProfiler
from common.trainer import same_fields

class OnNeuron(GuardedProfiler):  # as on a NeuronCore; no torch_neuronx here, so no NeuronConfig to build
    @dataclass(kw_only=True, slots=True)
    class Config(GuardedProfiler.Config):
        pass

    def on_neuron(self):
        return True

    def neuron_config(self, folder, *, device_mode):
        asked.append((folder, device_mode))

def steps(config, first, last):
    \"\"\"Steps first..last under the profiler built from `config`, as torchtitan's train() runs it from a checkpoint
    of step first - 1; the steps whose traces it wrote (each holding its ProfilerStep), and the activities.\"\"\"
    folder = tempfile.mkdtemp()
    with config.build(global_step=first - 1, base_folder=folder) as prof:
        activities = sorted(a.name for a in prof.torch_profiler.activities)
        for _ in range(first, last + 1):
            torch.randn(64, 64) @ torch.randn(64, 64)
            prof.step()
    written = {{}}
    for name in sorted(os.listdir(os.path.join(folder, "t"))) if os.path.isdir(os.path.join(folder, "t")) else []:
        if name.startswith("iteration_"):
            trace = json.loads(gzip.decompress(open(os.path.join(folder, "t", name, "rank0_trace.json.gz"), "rb").read()))
            written[int(name.split("_")[1])] = sorted({{e["name"] for e in trace.get("traceEvents", [])
                                                       if str(e.get("name", "")).startswith("ProfilerStep#")}})
    return written, activities, folder

asked = []
config = Profiler.Config(enable_profiling=True, save_traces_folder="t", profile_freq=2, profiler_warmup=1)
neuron = same_fields(OnNeuron.Config, config, device_mode=True)  # as GuardHooks.build sets it
assert isinstance(neuron, Profiler.Config) and type(neuron) is not Profiler.Config
assert all(getattr(neuron, k) == getattr(config, k) for k in ("save_traces_folder", "profile_freq", "profiler_warmup"))
profile = torch.profiler.profile
written, activities, folder = steps(neuron, 1, 2)
assert asked == [(folder + "/t/neuron/node0", True)] and os.path.isdir(asked[0][0]), asked  # under the run, per node
assert torch.profiler.profile is profile
print("neuron|", activities, written)
# the last step traced (every 6, 3 warm-up steps): a run resumed after step 5, after step 3, and one stopped after 5
last = same_fields(GuardedProfiler.Config, Profiler.Config(enable_profiling=True, save_traces_folder="t",
                                                           profile_freq=6, profiler_warmup=3))
print("resumed after 5|", steps(last, 6, 6)[0])
print("resumed after 3|", steps(last, 4, 6)[0])
print("stopped after 5|", steps(last, 1, 5)[0])
device.teardown()
"""


def test_the_profiler_traces_a_resumed_runs_steps_and_nothing_at_a_stop_and_on_neuron_its_activity(tmp_path):
    """torchtitan's profiler built from the guards' GuardedProfiler, through torchtitan's own Profiler and a real
    process group of one on the CPU: a run resumed right before its traced step still traces it (the profiler's
    step and action set before it starts; torchtitan 0.3.0's own traced nothing there), a stop just before the
    traced step writes no trace of a step that never ran, and on Neuron (a subclass answering as one) the Neuron
    activity is asked for and the runtime's traces go under the run. torch.profiler's function as it was."""
    from conftest import ROOT, run_python

    script = tmp_path / "profiler.py"
    script.write_text(PROFILER_ON_CPU.format(root=str(ROOT)))
    proc = run_python([sys.executable, str(script)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split("| ", 1) for line in proc.stdout.strip().splitlines() if "| " in line)
    assert lines["neuron"].startswith("['CPU', 'PrivateUse1'] {2: ['ProfilerStep#1']}"), proc.stdout
    assert lines["resumed after 5"] == "{6: ['ProfilerStep#5']}", proc.stdout
    assert lines["resumed after 3"] == "{6: ['ProfilerStep#5']}", proc.stdout
    assert lines["stopped after 5"] == "{}", proc.stdout


def test_the_reported_device_peak_is_the_heaviest_step_not_the_last(tmp_path):
    """torchtitan's MetricsProcessor resets the device's peak memory after every logged step, so a peak read once
    after training is the last window's. With a fixture memory reader in place of the project's CPU shim
    (tests/memory_fixture_native.py: the peak resets as a device allocator's does, step 2 of 3 allocates 7 GiB and
    the others 1 GiB), results.json's memory.peak_gib is the heaviest step's 7 GiB."""
    env = {**script_env(), "MEMORY_FIXTURE_GIB": "1,7,1"}
    out = tmp_path / "o"
    proc = run_python([sys.executable, str(ROOT / "tests" / "memory_fixture_native.py"), "--steps", "3",
                       "--no-export", "--out_dir", str(out)], cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    memory = json.loads((out / "results.json").read_text())["memory"]
    assert memory["peak_gib"] == [7.0], memory


def test_a_neuron_profiles_runtime_files_are_listed_and_device_mode_needs_profile(tmp_path):
    """On Neuron, results.json `profile.neuron_traces` lists the runtime's files under profile_traces/neuron (each
    process's folder whole, written by this run: an older run's file is left out); --profile_device alone is refused
    before anything runs."""
    import os
    import time

    from common.harness import pilot

    out = tmp_path / "run"
    pid_dir = out / pilot.PROFILE_FOLDER / pilot.NEURON_TRACES / "node0" / "i-0abc_pid_42" / "20261206"
    pid_dir.mkdir(parents=True)
    old = pid_dir / "old.ntff"
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 3600,) * 2)
    now = time.time()
    for name in ("trace_info.pb", "ntrace.pb"):
        (pid_dir / name).write_bytes(b"pb")
    p = pilot.profile_traces(out, every=2, steps=[1, 2], since=now, activities="CPU and Neuron (PrivateUse1)")
    assert [t["path"].rsplit("/", 1)[1] for t in p["neuron_traces"]] == ["ntrace.pb", "trace_info.pb"], p
    assert p["neuron_traces"][0]["path"].startswith("profile_traces/neuron/node0/i-0abc_pid_42/")
    assert "neuron_traces" not in pilot.profile_traces(out, every=2, steps=[2], since=now, activities="CPU")
    proc = run_in_process("train_native_qwen3.py", "--steps", "2", "--profile_device", "--out_dir", str(tmp_path / "o"))
    assert_clean_error(proc, "--profile_device traces nothing without --profile")
    assert not (tmp_path / "o").exists()


def test_a_resumed_profiled_run_lists_the_stopped_parts_traces_too(tmp_path):
    """A profiled run stopped and resumed: results.json lists the stopped part's traces (from its results.json, read
    before the resumed part replaces it) beside the resumed part's, where each file is still there at its size; a
    path outside the traces' folder, a changed file, or a step of the resumed part from an older listing is not."""
    import time

    from common.harness import pilot

    out = tmp_path / "run"

    def trace(step: int, data: bytes = b"trace") -> dict:
        path = out / pilot.PROFILE_FOLDER / f"iteration_{step}" / "rank0_trace.json.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return {"step": step, "path": str(path.relative_to(out)), "bytes": len(data)}

    earlier = {"traces": [trace(2), trace(4), {**trace(3), "bytes": 999}, trace(6, b"older"),
                          {"step": 1, "path": "../../etc/passwd", "bytes": 1}, {"step": "x"}]}
    now = time.time()
    trace(6, b"this part's")
    p = pilot.profile_traces(out, every=2, steps=[5, 6], since=now - 1, activities="CPU", earlier=earlier)
    assert p["steps"] == [2, 4, 6], p
    assert [(t["step"], t["bytes"]) for t in p["traces"]] == [(2, 5), (4, 5), (6, len(b"this part's"))], p
    fresh = pilot.profile_traces(out, every=2, steps=[1, 2], since=now - 1, activities="CPU", earlier=earlier)
    assert fresh["steps"] == [2] and [t["step"] for t in fresh["traces"]] == [2], fresh  # no earlier part's step 4


def test_held_out_evaluation_and_saves_are_not_step_time():
    """With --eval_every 1 each step's wall time (the LossRecorder's) holds the evaluation after the step before;
    the stop control's step times (common/harness/stops.py) leave it out, and the steady step, tokens/s and MFU come
    from them. Step 1 stays the recorder's: the stop control counts it from before the build."""
    from common.losses import LossRecorder
    from common.harness import pilot

    # step 1 ends at 9 s; after each step a 30 s evaluation, then a 1 s step
    ends = [0.0, 9.0, 40.0, 71.0, 102.0, 133.0, 164.0]
    rec = LossRecorder(steps=list(range(1, 7)), losses=[1.0] * 6, times=ends, tokens_seen=[64 * s for s in range(1, 7)])
    steps_s = [25.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    t = pilot.timing(rec, world_size=1, steps_s=steps_s)
    assert (t["first_step_s"], t["steady_step_s"], t["steady_tokens_per_s"]) == (9.0, 1.0, 64.0)
    r = pilot.report(rec, shape=TINY_SHAPE, seq_len=8, world_size=1, peak={"value": 1e12, "source": "test"},
                     memory={"peak_gib": [1.0]}, planned_gib=None, price_per_hour=None, steps_s=steps_s)
    assert r["timing"]["steady_step_s"] == 1.0 and r["mfu"] == pytest.approx(r["flops_per_token"] * 64.0 / 1e12)
    assert pilot.timing(rec, world_size=1)["steady_step_s"] == 31.0  # the recorder alone: the evaluation counted
    # a stop control that saw other steps than the recorder (none, or a count that differs): the recorder's times
    assert pilot.timing(rec, world_size=1, steps_s=steps_s[:3])["steady_step_s"] == 31.0


def test_a_resumed_parts_first_step_is_named_by_its_number():
    """A part resumed after step 6: the [pilot] and [step 1] lines describe its first step, step 7, not step 1."""
    from common.losses import LossRecorder
    from common.harness import phases, pilot

    rec = LossRecorder(steps=[7, 8, 9], losses=[1.0] * 3, times=[0.0, 5.0, 6.0, 7.0], tokens_seen=[64, 128, 192])
    p = pilot.report(rec, shape=TINY_SHAPE, seq_len=8, world_size=1, peak={"value": 1e12, "source": "test"},
                     memory={"peak_gib": [1.0]}, planned_gib=None, price_per_hour=None)
    assert p["timing"]["first_step"] == 7
    assert pilot.format_line(p).startswith("[pilot] first step (step 7, after the resume) 5.00 s, steady ")
    fresh = LossRecorder(steps=[1, 2, 3], losses=[1.0] * 3, times=[0.0, 5.0, 6.0, 7.0], tokens_seen=[64, 128, 192])
    p = pilot.report(fresh, shape=TINY_SHAPE, seq_len=8, world_size=1, peak={"value": 1e12, "source": "test"},
                     memory={"peak_gib": [1.0]}, planned_gib=None, price_per_hour=None)
    assert pilot.format_line(p).startswith("[pilot] step 1 5.00 s, steady ")
    r = {"phases": {"launch": 0.0, "imports": 2.0, "load": 3.0, "first step": 5.0}, "total_s": 10.0}
    assert phases.format_line(r, first_step=7).startswith(
        "[first step] the command to the end of the first step (step 7, after the resume): 10.0 s (")
    assert phases.format_line(r).startswith("[step 1] the command to the end of step 1: 10.0 s (")
    assert phases.format_line(r, first_step=1) == phases.format_line(r)


TINY_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}


def test_the_neuron_profiler_is_given_the_runs_neff_cache(monkeypatch):
    """On Trainium the profiler's NeuronConfig names the run's NEFF cache (the folder common.device.setup sets), so the
    NEFFs are copied into the traces once, at the stop; without the variable it names none."""
    from common import device

    device.route_torchtitan_device("cpu")
    from common.harness.trainer import neuron_config_paths

    monkeypatch.setenv(device.NEFF_CACHE_VAR, "/runs/x/neff_cache")
    assert neuron_config_paths("/runs/x/profile_traces/neuron/node0") == {
        "profile_output_dir": "/runs/x/profile_traces/neuron/node0", "neff_cache_dir": "/runs/x/neff_cache"}
    monkeypatch.delenv(device.NEFF_CACHE_VAR)
    assert neuron_config_paths("t") == {"profile_output_dir": "t"}
