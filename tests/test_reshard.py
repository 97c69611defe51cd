"""--reshard: a stopped run resumes on another number of ranks. The native script stops on 2 ranks, resumes on 1 and
stops again, and resumes on 2 to the end; the MoE script stops on 2 ranks and resumes on 1 to the end. After each
change of world size the resumed state (weights, optimizer state, LR schedule, step) is the checkpoint's, tensor for
tensor; each step trains on the same sequences as a run that never changed size (the debug trace of every rank), none
twice and none left out; the losses stay within LOSS_BOUND of that run's. Without the flag the refusal names it; with
it, another --lr is still refused (both in this process: they end before a launch). The rest (the dealing rule, the
refusal hints, segments.json, the report's marker) without training."""
from __future__ import annotations

import json
import shutil
import signal

import pytest

from common.harness import reshard, resume
from common.harness.stops import EXIT_STOPPED
from conftest import TWO_RANKS, assert_clean_error, example_command, read_results, run_example, run_in_process
from stop_helpers import finish, start, wait_for_step

NATIVE = TWO_RANKS  # the shared 2-rank run's (the stop tests' too), which never changes size
MOE = ("--steps", "6", "--no-export", "--global_batch_size", "4")  # the shared 2-rank MoE run's; the batch spelled out
# float32 on CPU. Another world size changes the order of floating-point sums: the gradient norm is summed over
# shards and then over ranks instead of over whole tensors, AdamW's vectorised loops meet other tensor lengths, and
# the loss is summed over ranks instead of over micro-steps. Measured: both chains 0 to 1.9e-6 from the uninterrupted
# run (two float32 steps at loss 11.4). A batch trained twice or left out moves a step's loss by some 1e-2 (step 1's
# two batches on the same weights: losses 11.959 and 11.900).
LOSS_BOUND = 1e-4


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


def _trace(folder) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob("data-*.jsonl")) for line in f.read_text().splitlines()]


def _by_batch(lines: list[dict]) -> dict:
    """(step, shard, batch of the step) -> its rows' hashes, each key once. Each shard's documents read never go
    back (a loader that started its shard anew would). A resumed loader reads one document ahead of an uninterrupted
    one (torchtitan's reads the next document before it empties its token buffer: the same tokens come out), so
    the counts themselves are not compared."""
    out, read = {}, {}
    for line in sorted(lines, key=lambda x: (x["step"], x["shard"], x["batch"])):
        key = (line["step"], line["shard"], line["batch"])
        assert key not in out, f"step {key[0]}'s batch {key[2]} of shard {key[1]} trained twice"
        out[key] = line["rows"]
        assert line["documents_read"] >= read.get(line["shard"], 0), line
        read[line["shard"]] = line["documents_read"]
    return out


def _same_state(out, step: int, dump, tmp_path) -> None:
    """The state a resumed run started from (its debug dump, gathered from its ranks) is the DCP checkpoint's."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = tmp_path / f"step-{step}.pt"
    dcp_to_torch_save(out / "checkpoint" / f"step-{step}", whole)  # DCP's own reader, unsharded
    saved = {}
    for k, v in torch.load(whole, weights_only=False).items():
        if k in ("optimizer", "lr_scheduler", "train_state"):
            saved.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        elif k != "dataloader":
            saved[f"model.{k}"] = v
    resumed = torch.load(dump, weights_only=False)
    assert set(resumed) == set(saved), sorted(set(resumed) ^ set(saved))[:10]
    for k, v in saved.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == resumed[k].dtype and torch.equal(v, resumed[k]), k
        else:
            assert v == resumed[k], (k, v, resumed[k])
    assert saved["train_state.step"] == step and any(k.startswith("optimizer.state.") for k in saved)


def _refusals(out, root, run) -> dict:
    """The 1-rank commands without --reshard, and with it but another --lr, each on its own copy of the stopped run's
    folder (the out_dir is no setting a resume compares), in this process: they end in the checks before a launch,
    and an in-process command keeps its out_dir's lock until the test process ends."""
    refused = {}
    for name, args in (("no flag", NATIVE), ("lr", (*run[:-2], "--lr", "0.01"))):
        copy = root / f"refused {name}"
        shutil.copytree(out, copy, symlinks=True)
        refused[name] = run_in_process("train_native_qwen3.py", *args, "--out_dir", str(copy))
    return refused


@pytest.fixture(scope="module")
def native(tmp_path_factory, shared_run) -> dict:
    """The chain: 2 ranks (own launch) stopped after step 3 or so, 1 rank stopped two steps later, 2 ranks (torchrun)
    to step 8; the two refusals on a copy of the first stop's out_dir (_refusals). Every rank traces its batches; each
    resume dumps its starting state. Against the shared 2-rank run that never stops (the stop tests' too), traced the same way."""
    straight, straight_results = shared_run("native_2_ranks_8_steps")
    root = tmp_path_factory.mktemp("reshard_native")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(reshard.DEBUG_ENV, str(root / "debug"))
        out, run = root / "chain", (*NATIVE, "--reshard", "--out_dir", str(root / "chain"))
        first = _stop(example_command("train_native_qwen3.py", *run, "--nproc_per_node", "2"), out, root / "log1", 2)
        refused = _refusals(out, root, run)
        second = _stop(example_command("train_native_qwen3.py", *run), out, root / "log2", first["step"] + 2)
        run_example("train_native_qwen3.py", *run, torchrun=2)
    return {"root": root, "out": out, "stops": [first["step"], second["step"]], "refused": refused,
            "straight": straight_results, "straight_trace": straight.parent / f"{straight.name}.trace",
            "results": read_results(out)}


def test_a_resume_on_another_world_size_needs_the_flag_and_the_same_run(native):
    no_flag, lr = native["refused"]["no flag"], native["refused"]["lr"]
    assert_clean_error(no_flag, "world size 1 (checkpoint: 2", "(on 1 rank: add --reshard)")
    assert_clean_error(lr, "--lr 0.01 (checkpoint: 0.003)")
    assert no_flag.returncode == lr.returncode == 2
    assert "add --reshard" not in lr.stderr  # the flag does not help there


def test_native_resumes_2_then_1_then_2_ranks_as_if_it_never_changed_size(native, tmp_path):
    out, (s1, s2), res, straight = native["out"], native["stops"], native["results"], native["straight"]
    assert 2 <= s1 < s2 < 8, (s1, s2)
    assert res["segments"] == [
        {"steps": [1, s1], "world_size": 2, "stopped": "SIGTERM",
         "data": {"shards": 2, "world_size": 2, "exact": True}},
        {"steps": [s1 + 1, s2], "world_size": 1, "stopped": "SIGTERM",
         "data": {"shards": 2, "world_size": 1, "exact": True, "resharded_from": {"step": s1, "world_size": 2}}},
        {"steps": [s2 + 1, 8], "world_size": 2, "stopped": None,
         "data": {"shards": 2, "world_size": 2, "exact": True, "resharded_from": {"step": s2, "world_size": 1}}}]
    # the step counter, the LR schedule, the weights and the optimizer state: the checkpoint's, after each change
    _same_state(out, s1, native["root"] / "debug" / f"resumed-step{s1}-w1.pt", tmp_path)
    _same_state(out, s2, native["root"] / "debug" / f"resumed-step{s2}-w2.pt", tmp_path)
    # the data: the same batches each step as the run that never stopped, each trained once, none left out
    chain, ref = _by_batch(_trace(native["root"] / "debug")), _by_batch(_trace(native["straight_trace"]))
    assert len(ref) == 8 * 2 and chain == ref  # 8 steps x 2 shards x 1 batch of 2 sequences
    assert {line["world_size"] for line in _trace(native["root"] / "debug") if s1 < line["step"] <= s2} == {1}
    # the losses: equal before the first change, within the bound after
    losses = res["history"]["losses"]
    assert res["history"]["steps"] == list(range(1, 9)) and losses[:s1] == straight["losses"][:s1]
    worst = max(abs(a - b) for a, b in zip(losses, straight["losses"]))
    assert worst <= LOSS_BOUND, (worst, losses, straight["losses"])


def test_moe_resumes_2_then_1_rank_as_if_it_never_changed_size(tmp_path, shared_run, monkeypatch):
    """The MoE script (its grouped experts and routing state sharded anew): 2 ranks stopped, 1 rank (--reshard) to the
    end, against the shared 2-rank MoE run (the same settings; its held-out losses change nothing it trains). The
    resumed state is the checkpoint's, every (step, shard) batch trained once, the losses within the bound, and the
    resumed run's expert load counts its own steps only. (1 -> 2 ranks: the native chain above.)"""
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
    assert res["segments"][1]["data"]["resharded_from"] == {"step": s1, "world_size": 2}
    _same_state(out, s1, tmp_path / "debug" / f"resumed-step{s1}-w1.pt", tmp_path)
    trained = _by_batch(_trace(tmp_path / "debug"))
    assert sorted(trained) == [(step, shard, 0) for step in range(1, 7) for shard in (0, 1)]
    assert {line["world_size"] for line in _trace(tmp_path / "debug") if line["step"] > s1} == {1}
    losses = res["history"]["losses"]
    assert losses[:s1] == straight["losses"][:s1]
    worst = max(abs(a - b) for a, b in zip(losses, straight["losses"]))
    assert len(losses) == 6 and worst <= LOSS_BOUND, (worst, losses, straight["losses"])
    # tokens routed (the global batch of 4 sequences of 128, top-4 of the tiny preset's 2 MoE layers): this run's
    assert res["steps"] == list(range(s1 + 1, 7)) and sum(res["expert_load"]) == len(res["steps"]) * 4 * 128 * 4 * 2


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
