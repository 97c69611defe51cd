"""tools/aws_config_diff.py: AWS's TorchTitan Neuron config of a layout against the project's preset of that layout,
a field-by-field difference of two torchtitan Trainer.Config objects (parallelism, activation checkpointing,
training, compile, the attention class, the parallelize function's module). AWS's config is stood in for by
torchtitan's own `qwen3_32b()` Trainer.Config with fields changed; the preset's is made as its --dry_run makes it.
No torchtitan_neuron module is imported or imitated. `python -m common.harness.preflight --target trn2` names the
command instead of comparing.
"""
from __future__ import annotations

import dataclasses

import pytest

from common.harness import preflight
from tools import aws_config_diff


@pytest.fixture(scope="module")
def preset_8b():
    return aws_config_diff.preset_config("train_native_qwen3.py", "qwen3_8b")


def _aws_like():
    """torchtitan's qwen3_32b() Trainer.Config set to AWS's 8B layout's figures, plus compile on: what a Neuron
    config with a setting the preset lacks looks like."""
    from torchtitan.models.qwen3.config_registry import qwen3_32b

    tc = qwen3_32b()
    tc.parallelism.tensor_parallel_degree = 4
    tc.training.local_batch_size, tc.training.global_batch_size, tc.training.seq_len = 1, 16, 4096
    tc.compile.enable = True
    return tc


def test_the_difference_names_each_field_that_differs_and_only_those(preset_8b):
    diff = {path: (theirs, ours) for path, theirs, ours in aws_config_diff.config_diff(_aws_like(), preset_8b)}
    assert diff["compile.enable"] == (True, False), diff
    assert diff["activation_checkpoint (class)"] == (
        "torchtitan.distributed.activation_checkpoint.FullAC.Config",
        "torchtitan.distributed.activation_checkpoint.SelectiveAC.Config"), diff
    assert diff["parallelize function module"][0] == "torchtitan.models.qwen3.parallelize", diff
    assert "attention class" in diff  # torchtitan's FlexAttention against the preset's SDPA
    for agreed in ("parallelism.tensor_parallel_degree", "training.global_batch_size", "training.seq_len",
                   "training.local_batch_size", "parallelism.data_parallel_shard_degree"):
        assert agreed not in diff, (agreed, diff[agreed])
    assert all(path.split(".")[0].split(" ")[0] in aws_config_diff.DIFF_SECTIONS + ("attention", "parallelize")
               for path in diff), diff


def test_a_field_only_one_side_has_and_a_nested_config_are_shown():
    @dataclasses.dataclass
    class Inner:
        a: int = 1

    @dataclasses.dataclass
    class Ours:
        inner: Inner = dataclasses.field(default_factory=Inner)

    @dataclasses.dataclass
    class Theirs(Ours):
        spmd_backend: str = "neuron"  # a Neuron-specific field the preset's config lacks

    theirs, ours = Theirs(inner=Inner(a=2)), Ours()
    out = []
    aws_config_diff._diff("parallelism", theirs, ours, out)
    assert out[0][0] == "parallelism (class)"
    assert ("parallelism.inner.a", 2, 1) in out
    assert ("parallelism.spmd_backend", "neuron", aws_config_diff._ABSENT) in out
    assert "parallelism.spmd_backend: AWS 'neuron', preset (absent)" in aws_config_diff.format_diff(out, "AWS",
                                                                                                    "preset")


def test_the_tool_prints_the_difference_where_the_package_imports(preset_8b):
    """The printed block, with torchtitan's own registry in the place of torchtitan_neuron's (the same lookup:
    MODULE.config_registry, as torchtitan's --module finds it)."""
    text = aws_config_diff.aws_comparison(configs=(("train_native_qwen3.py", "qwen3_8b", "torchtitan.models.qwen3",
                                                    "qwen3_32b"),), package="torchtitan")
    first, *rest = text.splitlines()
    assert first.startswith("[preflight] AWS's torchtitan.models.qwen3 qwen3_32b vs train_native_qwen3.py "
                            "--preset qwen3_8b: "), first
    assert "  parallelism.tensor_parallel_degree: AWS 1, preset 4" in rest, text


def test_without_torchtitan_neuron_the_comparison_is_one_line():
    assert (aws_config_diff.aws_comparison()
            == "[preflight] AWS's configs not compared: torchtitan_neuron is not installed")


def test_the_command_prints_the_comparison_and_exits_0(capsys):
    assert aws_config_diff.main([]) == 0
    assert capsys.readouterr().out == aws_config_diff.aws_comparison() + "\n"


def test_a_bad_command_line_is_one_error_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        aws_config_diff.main(["--target", "trn2"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unrecognized arguments: --target trn2") and err.count("\n") == 1, err


def test_the_trn2_preflight_names_the_command_instead_of_comparing(capsys):
    preflight.main(["--target", "trn2"])
    out = capsys.readouterr().out
    assert ("[preflight] AWS's own configs of these layouts beside the presets, field by field: "
            "python -m tools.aws_config_diff") in out.splitlines(), out
    assert "AWS's configs not compared" not in out
