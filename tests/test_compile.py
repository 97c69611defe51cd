"""--compile: torchtitan's own compile (each block and the loss), the guards around it, and the compile audit.

In `make test` each training script compiles with the aot_eager backend (Dynamo's graphs traced, no code generated:
seconds on CPU), 10 steps, its losses compared with an eager run's; with inductor (16-36 s of compile a run on 2
cores), the same in the extended tier, and in the bench against stock torchtitan (bench/bench_train_overhead.py
--compiled)."""
from __future__ import annotations

import signal

import pytest
import torch

from conftest import ROOT, SHARED_RUNS, known_noise, read_results, run_example

GOLDEN = ROOT / "tests" / "assets" / "golden_losses"


def _compiled_run(script: str, out, *args: str, reference=None, steps: int | None = 10,
                  backend: str = "aot_eager") -> dict:
    """`steps` steps compiled (None: as `args` say), the losses compared with `reference` (a results.json; default:
    the script's golden losses, an eager run of the same 10 steps on one process)."""
    reference = reference or GOLDEN / f"{script.removesuffix('.py')}.tiny.json"
    proc = run_example(script, *(("--steps", str(steps)) if steps else ()), "--compile", "--compile_backend", backend,
                "--out_dir", str(out), "--compare_losses", str(reference), "--loss_tolerance", "1e-5", *args,
                process=True)
    return {**read_results(out), "output": proc.stdout + proc.stderr}  # and what the run printed


def _assert_compiled_like_eager(res: dict, backend: str = "aot_eager") -> None:
    """And the run printed none of the lines no user can act on (common/torchtitan_fixes.py), compiled as eager."""
    assert res["loss_comparison"]["passed"], res["loss_comparison"]  # the eager losses, within the tolerance
    audit = res["compile"]
    assert audit["backend"] == backend and audit["graphs"] >= 2 and audit["graph_breaks"] == 0, audit
    assert audit["recompiles_after_warmup"] == [], audit["recompiles_after_warmup"]
    assert res["export_check"]["passed"], res["export_check"]
    assert known_noise(res["output"]) == []
    if backend == "aot_eager":  # it generates no code: no cache to be warm
        assert res["timing"]["compile_cache"]["state"] == "none", res["timing"]["compile_cache"]


def test_the_native_script_compiled_trains_as_eager_with_no_recompile_after_warm_up(tmp_path, monkeypatch):
    """10 steps compiled, with an evaluation every 5 steps and a save every 4: the losses are the eager golden
    losses, the export re-reads as the trained model, and after the 2-step warm-up nothing compiles again (the
    evaluation at step 1 compiles its no-grad graph once; the saves compile nothing). With --compile_cache, an
    entry another host of this compiler pushed (under this host's key) is pulled into this host's cache before step
    1, and one of another compiler's key is not (common/harness/compile_cache.py; pull and push in full:
    tests/test_compile_cache.py)."""
    from common.harness.compile_cache import cache_key

    shared, local = tmp_path / "shared", tmp_path / "inductor"
    for key in (cache_key("cpu"), "cpu_torch-0.0_python-3.0"):
        (shared / key / "seeded").mkdir(parents=True)
        (shared / key / "seeded" / "entry.bin").write_text(key)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(local))  # this "host's" own cache, not the machine's
    res = _compiled_run("train_native_qwen3.py", tmp_path / "n", "--eval_every", "5", "--checkpoint_every", "4",
                        "--compile_cache", str(shared))
    _assert_compiled_like_eager(res)
    pulled = res["compile_cache_shared"]
    assert (pulled["key"], pulled["pulled"], pulled["dir"]) == (cache_key("cpu"), 1, str(local)), pulled
    assert (local / "seeded" / "entry.bin").read_text() == cache_key("cpu") and isinstance(pulled["pushed"], int)
    after_eval = [e for e in res["compile"]["events"] if e["where"] == "after"]
    assert after_eval and all(e["step"] == 1 and "grad_mode" in str(e["reason"]) for e in after_eval), after_eval
    assert [r["step"] for r in res["eval_losses"]] == [1, 5, 10]


def test_the_moe_script_compiled_trains_as_eager(tmp_path):
    """The MoE script's replacement ops (the grouped-expert op, NKIRoPE) traced into each block's graph (fullgraph:
    a graph break would be an error): 10 steps, the eager golden losses, no recompile after the warm-up."""
    _assert_compiled_like_eager(_compiled_run("train_moe_nki.py", tmp_path / "o"))


def test_the_hf_backend_compiled_trains_as_eager(tmp_path, shared_run):
    """The Transformers backend's blocks compiled: the shared eager run's command (10 steps from the tiny Qwen3's HF
    weights, the load check, a held-out evaluation every 2 steps) with --compile, its losses the eager run's and no
    recompile after the warm-up (an evaluation compiles its no-grad graph once, after step 1)."""
    eager_dir, eager = shared_run("hf_tiny")
    script, args, _ranks = SHARED_RUNS["hf_tiny"]
    res = _compiled_run(script, tmp_path / "o", *args, reference=eager_dir / "results.json", steps=None)
    assert res["steps"] == eager["steps"] and res["load_check"]["passed"], res["load_check"]
    _assert_compiled_like_eager(res)


@pytest.mark.extended
@pytest.mark.parametrize("script", ["train_native_qwen3.py", "train_moe_nki.py", "train_hf_backend.py"])
def test_each_script_compiled_with_inductor_trains_as_eager(script, tmp_path, monkeypatch, shared_run):
    """inductor, as a CPU or CUDA user compiles: code generated for each block (the MoE script's replacement ops
    inside them), 10 steps into an empty inductor cache, the eager losses within 1e-5 (at most 2e-6 apart here: generated
    float32 kernels sum in another order), no recompile after the warm-up, step 1 found the cache cold."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    if script == "train_hf_backend.py":  # the shared eager run is the reference, its command compiled
        eager_dir, _ = shared_run("hf_tiny")
        res = _compiled_run(script, tmp_path / "o", *SHARED_RUNS["hf_tiny"][1], reference=eager_dir / "results.json",
                            steps=None, backend="inductor")
    else:
        res = _compiled_run(script, tmp_path / "o", backend="inductor")
    _assert_compiled_like_eager(res, backend="inductor")
    assert res["timing"]["compile_cache"]["state"] == "cold", res["timing"]["compile_cache"]


@pytest.mark.extended
def test_compiled_a_stopped_run_resumes_at_tensor_parallel_2_as_if_it_never_stopped(tmp_path, shared_run):
    """The guards compiled (aot_eager), on the shared 2-rank run's command (the scripts' own launch, FSDP over 2
    ranks, 8 steps from the tiny Qwen3's HF weights, exported), with --reshard: SIGTERM to the launcher after step 2
    stops it with a whole checkpoint and exit 75; the same command at tensor parallel 2 resumes there, compiles its
    blocks again within its own warm-up and trains to the end; the losses of both parts are the eager run's within
    1e-4 (the stop tests' bound for a change of layout), and the export at tensor parallel 2 re-reads as trained."""
    import psutil

    from common.harness.stops import EXIT_STOPPED
    from conftest import TWO_RANKS_RUN, example_command
    from stop_helpers import LOSS_BOUND, finish, start, wait_for_step, workers

    _, straight = shared_run("native_2_ranks_8_steps")
    out = tmp_path / "o"
    args = (*TWO_RANKS_RUN, "--nproc_per_node", "2", "--compile", "--compile_backend", "aot_eager", "--reshard",
            "--out_dir", str(out))
    first = start(example_command("train_native_qwen3.py", *args), tmp_path / "log1")
    wait_for_step(first, out, 2)
    assert len(workers(first, 2)) == 2
    psutil.Process(first.pid).send_signal(signal.SIGTERM)
    log = finish(first)
    stopped = read_results(out)
    assert first.returncode == EXIT_STOPPED and stopped["stopped"]["reason"] == "SIGTERM", log[-3000:]
    assert stopped["compile"]["recompiles_after_warmup"] == [] and stopped["compile"]["graph_breaks"] == 0

    run_example("train_native_qwen3.py", *args, "--tensor_parallel_degree", "2")
    res = read_results(out)
    step = stopped["stopped"]["step"]
    assert res["resumed_from_step"] == step < 8 and res["layout"]["tensor_parallel"] == 2, res["layout"]
    assert res["compile"]["backend"] == "aot_eager" and res["compile"]["graphs"] >= 2, res["compile"]
    assert res["compile"]["recompiles_after_warmup"] == [] and res["compile"]["graph_breaks"] == 0, res["compile"]
    assert res["history"]["steps"] == list(range(1, 9))
    worst = max(abs(a - b) for a, b in zip(res["history"]["losses"], straight["losses"]))
    assert worst <= LOSS_BOUND, (worst, res["history"]["losses"], straight["losses"])
    assert res["export_check"]["passed"], res["export_check"]


def test_the_audit_places_each_compile_and_names_a_late_recompile():
    """CompileAudit against torch's own record of compiles: a first compile, a recompile within the warm-up, one
    after it (a changed input shape, as a resume with another layout or a save that changes a guarded value)."""
    from common import device

    device.route_torchtitan_device("cpu")
    from common.harness.trainer import CompileAudit

    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2, backend="aot_eager", dynamic=False)
    audit = CompileAudit()
    f(torch.ones(2))
    audit.collect(1, "step")
    f(torch.ones(2))
    audit.collect(2, "step")
    f(torch.ones(3))  # step 3: after the warm-up
    audit.collect(3, "step")
    summary = audit.summary()
    assert (summary["graphs"], summary["recompiles"]) == (1, 1), summary["events"]
    late = summary["recompiles_after_warmup"]
    assert len(late) == 1 and late[0]["step"] == 3 and "size mismatch" in late[0]["reason"], late
    torch._dynamo.reset()
