"""Unit tests for common/: the SDPA document-mask workaround, the CLI generator, checkpoint checks."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch

from common import device

device.route_torchtitan_device("cpu")  # before torchtitan is imported below

from torchtitan.models.common.attention import (  # noqa: E402
    create_varlen_metadata_for_document, get_causal_mask_mod, get_document_mask_mod)

from common import checkpoint, cli  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.torchtitan_fixes import SDPADocumentAttention  # noqa: E402
from common.results import replace_dir, write_results  # noqa: E402


def test_document_mask_matches_torchtitan_mask_mods():
    # two rows; row 0 holds three packed documents, row 1 starts mid-document
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [3, 4, 0, 1, 2, 3, 0, 1]])
    B, L = positions.shape
    meta = create_varlen_metadata_for_document(positions)
    ours = SDPADocumentAttention.document_causal_mask(meta, B, L, "cpu")[:, 0]
    doc, causal = get_document_mask_mod(positions), get_causal_mask_mod()
    b, q, k = torch.meshgrid(torch.arange(B), torch.arange(L), torch.arange(L), indexing="ij")
    h = torch.zeros_like(b)
    expected = doc(b, h, q, k) & causal(b, h, q, k)
    assert torch.equal(ours, expected)


def test_sdpa_attention_equals_per_document_attention():
    torch.manual_seed(0)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])
    q, k, v = (torch.randn(1, 8, 4, 16) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]  # grouped-query: 4 heads share 2 kv heads
    attn = SDPADocumentAttention(SDPADocumentAttention.Config())
    out = attn(q, k, v, attention_masks=create_varlen_metadata_for_document(positions))
    for start, end in ((0, 4), (4, 7), (7, 8)):  # each document on its own, plain causal
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, start:end].transpose(1, 2), k[:, start:end].transpose(1, 2), v[:, start:end].transpose(1, 2),
            is_causal=True, enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(out[:, start:end], ref, rtol=0, atol=1e-6)


@dataclass
class _Cfg:
    preset: str = "a"
    steps: int = field(default=3, metadata={"help": "steps", **cli.bounds(1, 100)})
    name: str | None = None
    export: bool = True
    mode: Literal["x", "y"] = "x"


def _presets():
    def a():
        """first"""
        return _Cfg()

    def b():
        """second"""
        return _Cfg(steps=7, mode="y")
    return {"a": a, "b": b}


def test_cli_preset_then_flags():
    cfg = cli.parse_config(_Cfg, _presets(), ["--preset", "b", "--no-export", "--name", "n"], "", "a")
    assert (cfg.preset, cfg.steps, cfg.export, cfg.name, cfg.mode) == ("b", 7, False, "n", "y")
    cfg = cli.parse_config(_Cfg, _presets(), ["--steps", "5"], "", "a")
    assert (cfg.preset, cfg.steps, cfg.mode) == ("a", 5, "x")
    with pytest.raises(SystemExit):
        cli.parse_config(_Cfg, _presets(), ["--mode", "z"], "", "a")
    with pytest.raises(SystemExit):
        cli.parse_config(_Cfg, _presets(), ["--steps", "three"], "", "a")


def test_atomic_write_leaves_no_temp(tmp_path):
    target = tmp_path / "results.json"
    write_results(tmp_path, {"a": 1})
    write_results(tmp_path, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_replace_dir_swaps_whole_folders_and_keeps_the_old_one_on_failure(tmp_path):
    dest, new = tmp_path / "export", tmp_path / ".export.tmp"
    for folder, text in ((dest, "old"), (new, "new")):
        folder.mkdir()
        (folder / "weights").write_text(text)
    replace_dir(new, dest)
    assert (dest / "weights").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["export"]
    with pytest.raises(OSError):
        replace_dir(tmp_path / "never_built", dest)  # the second rename fails
    assert (dest / "weights").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["export"]


def test_out_dir_not_writable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="cannot be written"):
        cli.check_out_dir(str(blocker / "sub"))


def test_remote_code_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], "auto_map": {"AutoModelForCausalLM": "x.Y"}}))
    with pytest.raises(UserError, match="remote code"):
        checkpoint.validate_hf_checkpoint(tmp_path, checkpoint.QWEN3_DENSE)


def test_spec_round_trips_through_config_json():
    hf = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 512,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    back = checkpoint.hf_config_from_qwen3(checkpoint.qwen3_spec_from_hf(hf).model)
    for key, value in hf.items():
        assert back[key] == value, key


def test_torch_neuron_only_after_the_neuron_environment_and_the_process_group(monkeypatch):
    """The Neuron runtime reads NEURON_LOGICAL_NC_CONFIG and the NEFF cache when it starts, and must not start before
    init_process_group: common.device.neuron_runtime(), the one way to torch.neuron, refuses out of order, on CPU as
    on Trainium, so a launcher or parent that asked the runtime would fail the suite here. No stand-in for
    torch-neuronx: in the right order it reaches the import of torch_neuronx, which this machine lacks. In this
    process, as a fresh one starts: the Neuron environment not set, no launcher variables, no process group; the
    environment and the process group are put back after."""
    import torch.distributed as dist

    def attempt(fn):
        try:
            fn()
            return "reached"
        except RuntimeError as e:
            return "refused: " + str(e)
        except ImportError as e:
            return "import " + str(e.name)

    assert not dist.is_initialized(), "a process group left over in this test process"
    monkeypatch.setattr(device, "_neuron_env_set", False)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "NEURON_LOGICAL_NC_CONFIG", device.NEFF_CACHE_VAR):
        monkeypatch.setenv(var, "")  # recorded as it was (or unset), put back after the test
        monkeypatch.delenv(var)
    assert device.resolve_device_type("auto") == "cpu"  # a launcher's or the compatibility parent's choice
    available = attempt(device.neuron_available)  # a parent asking the runtime: refused on every machine
    assert available.startswith("refused: torch.neuron used before the Neuron environment was set"), available
    assert attempt(device.neuron_runtime) == available
    device.set_neuron_env(2, "/tmp/neff_cache")
    for var, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(device._free_port())
                           ).items():
        monkeypatch.setenv(var, value)
    before_group = attempt(device.neuron_runtime)  # the environment is set, the worker has no process group yet
    assert before_group.startswith("refused: torch.neuron used before this worker's process group exists")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        assert attempt(device.neuron_runtime) == "import torch_neuronx"  # both: goes on to torch-neuronx
    finally:
        dist.destroy_process_group()


def test_torch_neuron_is_reached_only_through_common_device():
    """Every `torch.neuron` in the repository's Python is inside common.device.neuron_runtime(), where the order is
    checked; a `torch.neuron.synchronize()` written anywhere else fails here."""
    import ast

    from conftest import ROOT

    found = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        if ".git" in path.parts or "tests" in path.parts[len(ROOT.parts):][:1]:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] + [tree]:
            for node in ast.walk(fn):
                if (isinstance(node, ast.Attribute) and node.attr == "neuron" and isinstance(node.value, ast.Name)
                        and node.value.id == "torch"):
                    found.append((str(path.relative_to(ROOT)), getattr(fn, "name", "<module>"), node.lineno))
    innermost = {(p, line): name for p, name, line in found if name != "<module>"}  # ast.walk: outer first
    places = sorted({(p, innermost.get((p, line), "<module>")) for p, _, line in found})
    assert places == [("common/device.py", "neuron_runtime")], places


@pytest.mark.parametrize("script", ["train_native_qwen3.py", "rope_parity.py", "generate_compat_check.py"])
def test_a_python_without_torch_gets_one_line_naming_the_environment(script):
    """The system's Python instead of the environment's (here: the same interpreter without site-packages, -I -S):
    one `error:` line naming the environment's python and its activate line, exit 2, no traceback."""
    import subprocess
    import sys

    from conftest import ROOT, script_env

    proc = subprocess.run([sys.executable, "-I", "-S", f"examples/{script}", "--help"], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {sys.executable} has no torch: use the environment")
    assert "venv/bin/python" in lines[0] and "venv/bin/activate" in lines[0]


def test_a_hub_id_given_for_a_folder_gets_the_download_hint_quoted(tmp_path, monkeypatch):
    """A missing --hf_checkpoint named like a Hub model id says the scripts never download and how to fetch it; a
    name that is not a Hub id gets no command (nothing a user might copy is built from it)."""
    from pathlib import Path

    from common.checkpoint import read_hf_config

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        read_hf_config("Qwen/Qwen3-0.6B")
    assert str(e.value).endswith("download it first (hf download Qwen/Qwen3-0.6B --local-dir assets/hf/Qwen3-0.6B) "
                                 "and give that folder"), e.value
    for name in ("a/b;rm -rf x", "../x/y", "./x/y", "x"):
        with pytest.raises(UserError) as e:
            read_hf_config(name)
        assert str(e.value) == f"checkpoint folder {Path(name)} does not exist", e.value
