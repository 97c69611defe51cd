"""--reshard: a stopped run resumes on another number of ranks. The MoE script stops on 2 ranks and resumes on 1 to
the end: the resumed state (weights, optimizer state, LR schedule, step) is the checkpoint's, tensor for tensor; each
step trains on the same sequences as a run that never changed size (the debug trace of every rank), none twice and
none left out; the losses stay within LOSS_BOUND of that run's. Its --stock path at tensor parallel 2 stops and
resumes on 1 rank with a 1-rank run's losses (both extended: docs/testing.md). The native script's 2 -> 1 -> 2
ranks, and the refusals without the flag or with another --lr: tests/test_stop.py's chain. The rest (the dealing
rule, the refusal hints, segments.json, the report's marker) without training."""
from __future__ import annotations

import json
import signal

import pytest

from common.harness import reshard, resume
from common.harness.stops import EXIT_STOPPED
from conftest import assert_clean_error, example_command, read_results, run_example, run_in_process
from stop_helpers import LOSS_BOUND, by_batch, finish, same_state, start, trace, wait_for_step

MOE = ("--steps", "6", "--no-export", "--global_batch_size", "4")  # the shared 2-rank MoE run's; the batch spelled out


def _stop(cmd: list[str], out, log, after: int) -> dict:
    """Start `cmd`, SIGTERM it once step `after` is logged: it stops at a step boundary with exit 75."""
    proc = start(cmd, log)
    wait_for_step(proc, out, after)
    proc.send_signal(signal.SIGTERM)
    text = finish(proc)
    assert proc.returncode == EXIT_STOPPED and "Traceback" not in text, text[-3000:]
    stopped = read_results(out)["stopped"]
    assert stopped and stopped["reason"] == "SIGTERM", stopped
    return stopped


@pytest.mark.extended
def test_moe_resumes_2_then_1_rank_as_if_it_never_changed_size(tmp_path, shared_run, monkeypatch):
    """The MoE script (its grouped experts and routing state sharded anew): 2 ranks stopped, 1 rank (--reshard) to the
    end, against the shared 2-rank MoE run (the same settings; its held-out losses change nothing it trains). The
    resumed state is the checkpoint's, every (step, shard) batch trained once, the losses within the bound, and the
    resumed run's expert load counts its own steps only. (1 -> 2 ranks: tests/test_stop.py's chain.)"""
    _, straight = shared_run("moe_tiny_2_ranks")
    monkeypatch.setenv(reshard.DEBUG_ENV, str(tmp_path / "debug"))
    out = tmp_path / "o"
    run = (*MOE, "--reshard", "--out_dir", str(out))
    # the stop a step or two after the signal, sent once step 1 is logged: 6 steps leave room for it
    s1 = _stop(example_command("train_moe_nki.py", *run, "--nproc_per_node", "2"), out, tmp_path / "log1", 1)["step"]
    assert 1 <= s1 < 6, s1
    run_example("train_moe_nki.py", *run)
    res = read_results(out)
    assert [(s["steps"], s["world_size"], s["stopped"]) for s in res["segments"]] == [
        ([1, s1], 2, "SIGTERM"), ([s1 + 1, 6], 1, None)]
    assert res["segments"][1]["data"]["resharded_from"] == {"step": s1, "world_size": 2, "tensor_parallel": 1}
    same_state(out, s1, tmp_path / "debug" / f"resumed-step{s1}-w1.pt", tmp_path)
    trained = by_batch(trace(tmp_path / "debug"))
    assert sorted(trained) == [(step, shard, 0) for step in range(1, 7) for shard in (0, 1)]
    assert {line["world_size"] for line in trace(tmp_path / "debug") if line["step"] > s1} == {1}
    losses = res["history"]["losses"]
    assert losses[:s1] == straight["losses"][:s1]
    worst = max(abs(a - b) for a, b in zip(losses, straight["losses"]))
    assert len(losses) == 6 and worst <= LOSS_BOUND, (worst, losses, straight["losses"])
    # tokens routed (the global batch of 4 sequences of 128, top-4 of the tiny preset's 2 MoE layers): this run's
    assert res["steps"] == list(range(s1 + 1, 7)) and sum(res["expert_load"]) == len(res["steps"]) * 4 * 128 * 4 * 2


STOCK = ("--stock", "--steps", "5", "--no-export", "--global_batch_size", "4", "--seq_len", "64")
# torchtitan's stock experts multiply in bfloat16: split over two tensor-parallel ranks, their sums round in another
# order than on one. Measured: 7.7e-5 at step 2 (trained at tensor parallel 2), 2.3e-4 at most over 5 steps. A batch
# trained twice or left out moves a step's loss by some 1e-2.
STOCK_BOUND = 1e-3


@pytest.mark.extended
def test_moe_stock_at_tensor_parallel_2_resumes_on_1_rank_as_if_it_never_changed_layout(tmp_path, prepared_assets):
    """The MoE script's --stock path (torchtitan's MoE on torch._grouped_mm, AWS's 2.34 choice) from the tiny
    Qwen3-MoE's HF weights at tensor parallel 2 on 2 ranks (one data-parallel rank), stopped after step 2 and resumed
    on 1 rank with --reshard to step 5: its losses are a 1-rank run's of the same command within STOCK_BOUND."""
    from tools import prepare_assets as assets

    weights = ("--hf_checkpoint", str(assets.prepare(["tiny_qwen3_moe"])["tiny_qwen3_moe"]))
    run_example("train_moe_nki.py", *STOCK, *weights, "--out_dir", str(tmp_path / "one"))
    straight = read_results(tmp_path / "one")["losses"]
    out = tmp_path / "o"
    run = (*STOCK, *weights, "--reshard", "--out_dir", str(out))
    stopped = _stop(example_command("train_moe_nki.py", *run, "--tensor_parallel_degree", "2", "--nproc_per_node", "2"),
                    out, tmp_path / "log1", 2)["step"]
    assert 2 <= stopped < 5, stopped
    run_example("train_moe_nki.py", *run)
    res = read_results(out)
    assert [(s["steps"], s["world_size"], s["stopped"]) for s in res["segments"]] == [
        ([1, stopped], 2, "SIGTERM"), ([stopped + 1, 5], 1, None)]
    assert [s["data"].get("data_parallel", s["world_size"]) for s in res["segments"]] == [1, 1], res["segments"]
    losses = res["history"]["losses"]
    worst = max(abs(a - b) for a, b in zip(losses, straight))
    assert len(losses) == 5 and worst <= STOCK_BOUND, (worst, losses, straight)


# ---- without training ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shards, ranks", [(1, 1), (2, 2), (2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (2, 3), (3, 2),
                                           (64, 32), (32, 64)])
def test_every_batch_of_a_step_goes_to_one_rank_once(shards, ranks):
    """The dealing rule: the step's G / L batches (G / (N x L) from each of N shards) each to one (rank, micro-step);
    with as many ranks as shards, each rank its own shard in order (torchtitan's own)."""
    per_step = shards * ranks  # a global batch (in local batches) that splits over both
    micro = per_step // ranks
    dealt = [(key, rank, m) for rank in range(ranks) for key, m in reshard.deal(shards, ranks, rank, micro).items()]
    assert sorted(key for key, _, _ in dealt) == [(v, b) for v in range(shards) for b in range(per_step // shards)]
    assert all(sorted(m for _, r, m in dealt if r == rank) == list(range(micro)) for rank in range(ranks))
    if shards == ranks:
        assert all(key == (rank, m) for key, rank, m in dealt)


def test_data_shards_are_read_from_the_checkpoint_keys():
    keys = ["tok_embeddings.weight", "optimizer.state.x", "dataloader.world_size"]
    assert reshard.data_shards(keys + ["dataloader.dp_rank_0", "dataloader.dp_rank_1"]) == 2
    assert reshard.data_shards(keys) is None  # no loader state per shard: the data cannot be carried over
    assert reshard.data_shards(keys + ["dataloader.dp_rank_1"]) is None  # not each shard's
    assert reshard.data_shards(keys + ["dataloader.dp_rank_0", "dataloader.dp_rank_x"]) is None


def test_the_global_batch_is_compared_and_named_with_the_flag():
    def record(ranks, batch=-1, lr=3e-3):
        return {"script": "s", "world_size": ranks, "dataset": None,
                "settings": {"local_batch_size": 2, "global_batch_size": batch, "lr": lr}}

    old, new, hint = resume.compared(record(2), record(1), reshard=False)
    assert (old, new) == (record(2), record(1)) and hint == " (on 1 rank: add --reshard)"
    old, new, hint = resume.compared(record(2), record(1, 4), reshard=True)
    assert old == new and hint == ""  # -1 on 2 ranks of 2 is 4
    old, new, hint = resume.compared(record(2), record(1), reshard=True)
    assert old["settings"]["global_batch_size"] == 4 and new["settings"]["global_batch_size"] == 2
    assert hint == " (--reshard keeps the global batch: pass --global_batch_size 4)"
    old, new, _ = resume.compared(record(2, 4), record(4, 4, lr=0.01), reshard=True)
    assert old["world_size"] == new["world_size"] and old["settings"]["lr"] != new["settings"]["lr"]


def test_segments_are_kept_across_resumes(tmp_path):
    reshard.open_segment(tmp_path, 1, 2, {"shards": 2})
    reshard.close_segment(tmp_path, 3, "SIGTERM")
    reshard.open_segment(tmp_path, 4, 1, {"shards": 2})  # killed: it never closes
    rows = reshard.open_segment(tmp_path, 6, 2, {"shards": 2})  # resumed from the step-5 checkpoint it left
    assert [(r["steps"], r["world_size"], r["stopped"]) for r in rows] == [
        ([1, 3], 2, "SIGTERM"), ([4, 5], 1, reshard.NO_RESULT), ([6, None], 2, None)]
    rows = reshard.close_segment(tmp_path, 8, None)
    assert rows[-1]["steps"] == [6, 8] and reshard.read_segments(tmp_path) == rows
    rows = reshard.open_segment(tmp_path, 3, 4, {"shards": 2})  # from an earlier checkpoint: later parts trained again
    assert [(r["steps"], r["world_size"]) for r in rows] == [([1, 2], 2), ([3, None], 4)]


def test_the_report_marks_where_the_world_size_changed(tmp_path, capsys):
    from tools import report

    losses = [11.9, 11.8, 11.6, 11.5, 11.4, 11.3]
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps({
        "script": "train_native_qwen3.py", "world_size": 2, "history": {"steps": list(range(1, 7)), "losses": losses},
        "segments": [{"steps": [1, 3], "world_size": 2, "stopped": "SIGTERM"},
                     {"steps": [4, 5], "world_size": 1, "stopped": "SIGTERM"},
                     {"steps": [6, 6], "world_size": 2, "stopped": None}, "not a segment"]}))
    assert report.main([str(run), "--out", str(tmp_path / "r.png")]) == 0
    table = capsys.readouterr().out
    assert " 2->1->2 " in table and "2 -> 1 ranks from step 4, 1 -> 2 ranks from step 6" in table
    assert "segments[3] = " in table  # the entry that is not one: named in the notes
    assert "the record of the steps between is missing" not in table
    assert report.is_own_report(tmp_path / "r.png")
    data = json.loads((run / "results.json").read_text())
    del data["segments"][1]  # the middle part's record lost
    (run / "results.json").write_text(json.dumps(data))
    assert report.main([str(run), "--out", str(tmp_path / "r2.png")]) == 0
    assert "starts at step 6 after a part that ended at step 3: the record of the steps between is missing" in \
        capsys.readouterr().out


def test_a_debug_trace_path_that_is_not_a_folder_is_one_line_before_the_build(tmp_path, monkeypatch):
    taken = tmp_path / "a_file"
    taken.write_text("mine")
    monkeypatch.setenv(reshard.DEBUG_ENV, str(taken))
    proc = run_in_process("train_native_qwen3.py", "--steps", "1", "--no-export", "--out_dir", str(tmp_path / "o"))
    assert_clean_error(proc, f"{reshard.DEBUG_ENV}={taken} is not a folder")
    assert taken.read_text() == "mine" and not (tmp_path / "o" / "losses.jsonl").exists()


@pytest.mark.parametrize("content", [b"{not json", b'{"steps": [1, 3]}', b'[{"steps": "1-3"}]', b"\xff\xfe"])
def test_a_damaged_segments_json_is_refused_never_replaced(tmp_path, content):
    """segments.json holds the parts of a run on each world size: a damaged one was silently replaced (the 2-rank
    part disappeared from results.json and the report), while a damaged run.json is refused. Now both are."""
    out = tmp_path / "o"
    out.mkdir()
    (out / reshard.SEGMENTS).write_bytes(content)
    proc = run_in_process("train_native_qwen3.py", "--steps", "1", "--no-export", "--out_dir", str(out))
    assert_clean_error(proc, "segments.json is damaged", "left as it is")
    assert (out / reshard.SEGMENTS).read_bytes() == content


def test_a_change_of_tensor_parallel_degree_at_one_world_size_is_recorded(tmp_path):
    """A run stopped at TP 2 on 2 ranks and resumed at TP 1 on 2 ranks (--reshard): its segments say each part's
    tensor-parallel degree, and the resumed part's `data_shards` says it was resharded from that layout."""
    first = reshard.Reshard(plan=reshard.Plan(), world_size=2, out_dir=tmp_path, is_main=True, tensor_parallel=2)
    reshard.open_segment(tmp_path, 1, 2, first.summary(), tensor_parallel=2)
    reshard.close_segment(tmp_path, 3, "SIGTERM")
    resumed = reshard.Reshard(plan=reshard.Plan(step=3, shards=1, saved_world_size=2), world_size=2,
                              out_dir=tmp_path, is_main=True, first_step=4, tensor_parallel=1,
                              saved_tensor_parallel=reshard.segment_tensor_parallel(tmp_path, 3))
    rows = reshard.open_segment(tmp_path, 4, 2, resumed.summary(), tensor_parallel=1)
    assert [(r["steps"], r["world_size"], r["tensor_parallel"]) for r in rows] == [([1, 3], 2, 2), ([4, None], 2, 1)]
    assert resumed.summary()["resharded_from"] == {"step": 3, "world_size": 2, "tensor_parallel": 2}
    same = reshard.Reshard(plan=reshard.Plan(step=3, shards=1, saved_world_size=2), world_size=2, out_dir=tmp_path,
                           is_main=True, first_step=4, tensor_parallel=2, saved_tensor_parallel=2)
    assert "resharded_from" not in same.summary()  # the same layout: a plain resume
