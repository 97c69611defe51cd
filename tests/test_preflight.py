"""common/harness/preflight.py: the stack check passes on this CPU stack, names what is missing for trn2 (torch-neuronx)
without a traceback, and names a required module or keyword that a shadowing torchtitan lacks.

The shadow packages below are fixtures for the check itself (a few files in tmp_path, first on the path while the
preflight's `main`, what `python -m common.harness.preflight` runs, checks them in this test process, the modules
they shadow set aside meanwhile); nothing stands in for the Neuron stack.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from common.harness import preflight
from common.errors import UserError
from common.kernels import moe_nki
from conftest import ROOT


def _preflight(*args: str, shadow: Path) -> subprocess.CompletedProcess:
    """`python -m common.harness.preflight ARGS` with the packages in the folder `shadow` first on the path, run in
    this test process: the modules of the packages it shadows are set aside while it runs (their imports then find
    the shadow) and put back after, with nothing of the shadow left in sys.modules."""
    shadowed = {p.name for p in shadow.iterdir() if (p / "__init__.py").exists()}

    def theirs(name: str) -> bool:
        return name.split(".")[0] in shadowed

    saved = {name: mod for name, mod in sys.modules.items() if theirs(name)}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(shadow))
    importlib.invalidate_caches()
    try:
        return _preflight_here(*args)
    finally:
        sys.path.remove(str(shadow))
        for name in [n for n in sys.modules if theirs(n)]:
            del sys.modules[name]
        sys.modules.update(saved)


def _preflight_here(*args: str) -> subprocess.CompletedProcess:
    """`python -m common.harness.preflight ARGS` in this test process (its `main`, what its `__main__` runs), stdout
    and stderr captured: for a check with nothing shadowed, or only a package this process has not imported (nkilib,
    a folder that a test puts first on sys.path)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = preflight.main(list(args))
    return subprocess.CompletedProcess([sys.executable, "-m", "common.harness.preflight", *args], rc, out.getvalue(),
                                       err.getvalue())


def _error_line(proc) -> str:
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def _shadow_torchtitan(root, config_init: str, override_py: str | None = None):
    """A torchtitan with just enough to be imported and routed: torchtitan/tools/utils.py and a config package."""
    files = {"torchtitan/__init__.py": "", "torchtitan/tools/__init__.py": "",
             "torchtitan/tools/utils.py": "device_type, device_module = 'cpu', None\n",
             "torchtitan/config/__init__.py": config_init}
    if override_py is not None:
        files["torchtitan/config/override.py"] = override_py
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_cpu_stack_passes_and_prints_the_table():
    proc = _preflight_here()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    header, rule, *rows = proc.stdout.splitlines()
    assert header.split() == ["requirement", "found", "verdict", "used", "by"] and set(rule) == {"-"}
    assert any(r.startswith("torchtitan.config:override ") and "takes target, fqns" in r for r in rows)
    assert any(r.startswith("transformers.distributed:DistributedConfig ") for r in rows)
    assert "[preflight] cpu stack: all" in proc.stdout


def test_trn2_target_names_torch_neuronx_without_a_traceback():
    line = _error_line(_preflight_here("--target", "trn2"))
    assert "not installed: torch-neuronx" in line and "nkilib" in line


def test_a_shadowing_torchtitan_without_config_override_is_named(tmp_path):
    shadow = _shadow_torchtitan(tmp_path, "def derive(*a, **k): pass\ndef apply_overrides(*a, **k): pass\n")
    proc = _preflight("--target", "cpu", shadow=shadow)
    line = _error_line(proc)
    assert "torchtitan.config:override: missing override" in line
    assert "torchtitan.config.override:OverrideConfig: no module torchtitan.config.override" in line
    assert str(tmp_path / "torchtitan") in proc.stdout  # the table shows where torchtitan came from


def test_a_shadowing_torchtitan_whose_override_lacks_a_keyword_is_named(tmp_path):
    shadow = _shadow_torchtitan(
        tmp_path, "from .override import override, OverrideConfig\n"
                  "def derive(*a, **k): pass\ndef apply_overrides(*a, **k): pass\n",
        override_py="""
            def override(*, target, description="", exact=False):  # no fqns: an older registry
                return lambda fn: fn
            class OverrideConfig:
                def __init__(self, imports=()):
                    self.imports = imports
            """)
    line = _error_line(_preflight("--target", "cpu", shadow=shadow))
    assert "torchtitan.config:override: does not take fqns" in line
    assert "OverrideConfig" not in line  # present, with the keyword our calls pass


def test_require_stack_raises_one_user_error_naming_torch_neuronx():
    with pytest.raises(UserError, match="not installed: torch-neuronx") as e:
        preflight.require_stack("trn2", "native")
    assert "\n" not in str(e.value)
    assert preflight.wants_neuron("neuron") and not preflight.wants_neuron("cpu")
    assert not preflight.wants_neuron("auto")  # no torch-neuronx here


def test_keyword_lists_are_the_ones_the_kernel_calls_pass():
    """The MoE rows list exactly the keywords common/kernels/moe_nki.py passes (its packed arguments plus the
    two constants experts_fwd_nki / experts_bwd_nki add)."""
    listed = {spec.partition(":")[2]: set(kw) for _, spec, kw, _ in preflight.SYMBOLS}
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 64, generator=g), [torch.randn(s, generator=g) for s in ((2, 64, 64), (2, 64, 64))]
    scores, ids = torch.rand(6, 2, generator=g), torch.tensor([[0, 1]] * 6)
    args, counts = moe_nki.pack_forward(x, scores, ids, w[0], w[1], w[0], torch.float32, 128)
    assert set(args) | {"compute_dtype", "expert_affinities_scaling_mode"} == \
        listed["blockwise_mm_baseline_shard_hidden"]
    _, gate_up_act, down_act, _ = moe_nki.unpack_forward(x, args, 6, torch.float32)  # checkpoints recomputed
    bwd = moe_nki.pack_backward(x, x, scores, ids, w[0], w[1], w[0], args["token_position_to_id"].long(), counts,
                                gate_up_act, down_act, torch.float32)
    assert set(bwd) | {"compute_dtype"} == listed["blockwise_mm_bwd"]


def test_signatures_of_jit_kernels_are_read_from_the_wrapped_function():
    """nki.jit returns a Kernel object that keeps the function as `.func` (and, in some releases, its signature
    as `.sign`); the check reads the function's parameters, and a **kwargs function takes any keyword."""
    class Wrapped:  # the shape of such an object, not a Neuron module
        def __init__(self, func):
            self.func = func

    def kernel(q, k, q_out, k_out, cos=None, sin=None, rope_cache=None, backward=False):
        return q_out, k_out

    assert list(preflight._parameters(Wrapped(kernel))) == ["q", "k", "q_out", "k_out", "cos", "sin",
                                                             "rope_cache", "backward"]
    assert preflight._parameters(lambda **kw: None) is None


RELEASE = json.loads((ROOT / "tests" / "assets" / "neuron-2.33.0.json").read_text())


def _next_minor(version: str) -> str:
    from packaging.version import Version

    v = Version(version)
    return f"{v.major}.{v.minor + 1}.0"


def _trn2_requirements() -> dict[str, str]:
    from packaging.requirements import Requirement

    reqs = {}
    for line in (ROOT / "requirements-trn2.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            req = Requirement(line)
            reqs[req.name] = str(req.specifier)
    return reqs


@pytest.mark.parametrize("source", ["requirements-trn2.txt", "preflight"])
def test_trn2_pins_admit_the_233_release_and_refuse_the_next_minor(source):
    """Every Neuron package pip installs is pinned, and each pin admits the Neuron 2.33.0 release's own version
    string (TorchNeuron's 2.14.3.0 family: a build number may follow) and refuses the next minor version."""
    pins = _trn2_requirements() if source == "requirements-trn2.txt" else preflight.TRN2_PINS
    if source == "requirements-trn2.txt":  # torchtitan-neuron installs from a clone of its release branch
        assert "torchtitan-neuron" not in pins and "torchtitan" not in pins
    for dist, version in RELEASE["pip"].items():
        if dist == "torchtitan-neuron" and source == "requirements-trn2.txt":
            continue
        assert dist in pins, (source, dist)
        builds = [version, f"{version}.1234"] if dist == "torch-neuronx" else [version]
        for build in builds:
            assert preflight.admits(pins[dist], build), (source, dist, pins[dist], build)
        assert not preflight.admits(pins[dist], _next_minor(version)), (source, dist, pins[dist])


@pytest.mark.parametrize("script, named, not_named", [
    ("native", [], ["nki", "blockwise", "rope_hf", "DistributedConfig"]),
    ("hf", [], ["nki", "blockwise", "rope_hf", "DistributedConfig"]),
    ("rope", ["nki", "nkilib.core.embeddings.rope_hf"], ["blockwise", "DistributedConfig"]),
    ("moe", ["nki", "nkilib.core.embeddings.rope_hf", "nkilib.experimental.moe.forward.bwmm_shard_on_H",
             "nkilib.experimental.moe.bwd.blockwise_mm_backward"], ["DistributedConfig"]),
    ("compat", [], ["nki", "rope_hf", "blockwise"]),
])
def test_each_script_checks_what_it_uses(script, named, not_named):
    """A script's preflight names what it calls and nothing else: the native and HF-backend runs and the
    compatibility check do not need the kernels; the RoPE check needs rope_hf's module, the MoE run the MoE ones."""
    with pytest.raises(UserError) as e:
        preflight.require_stack("trn2", script)
    line = str(e.value)
    assert "not installed: torch-neuronx" in line, line
    for name in named:
        assert name in line, (name, line)
    for name in not_named:
        assert name not in line, (name, line)
    rows = [r for r, _, _ in preflight.check("trn2", script)]
    assert ("torch_neuronx:wrap_nki" in rows) is False  # only where the launch setting uses it
    assert "torch_neuronx:wrap_nki" in [r for r, _, _ in preflight.check("trn2", script, wrap_nki=True)]


def test_a_shadowing_torchtitan_without_a_config_field_is_named_before_anything_is_built(tmp_path):
    """A torchtitan whose TrainingConfig (a slots dataclass, as torchtitan's) lacks a field the scripts set: the
    preflight names the field and the module that lacks it; disable_cuda_graphs, a CUDA setting, is reported and
    left unset, the others are errors."""
    shadow = _shadow_torchtitan(tmp_path, "def derive(*a, **k): pass\ndef apply_overrides(*a, **k): pass\n")
    (tmp_path / "torchtitan" / "config" / "configs.py").write_text(textwrap.dedent("""
        from dataclasses import dataclass

        @dataclass(slots=True)
        class TrainingConfig:  # no disable_cuda_graphs, no seq_len
            steps: int = 1
            local_batch_size: int = 1
            global_batch_size: int = -1
            mixed_precision_param: str = "float32"
        """))
    proc = _preflight("--target", "cpu", shadow=shadow)
    rows = {r.split(" fields ")[1].split()[0]: r for r in proc.stdout.splitlines()
            if r.startswith("torchtitan.config.configs:TrainingConfig fields ")}
    assert "no field disable_cuda_graphs in torchtitan.config.configs: left unset" in rows["disable_cuda_graphs?"]
    assert rows["disable_cuda_graphs?"].split()[-4] == "info", rows
    assert "missing field seq_len in torchtitan.config.configs" in rows["steps"] and " ERROR " in rows["steps"]
    assert "TrainingConfig fields steps" in _error_line(proc) and "seq_len" in _error_line(proc)


@pytest.mark.parametrize("installed", [True, False], ids=["nki-library-build", "a-bare-folder"])
def test_the_table_names_which_nkilib_is_imported(tmp_path, monkeypatch, installed):
    """`nkilib` comes from neuronx-cc (bundled) or from a standalone nki-library build that replaces it: the trn2
    table shows the folder `import nkilib` loads and the distribution that installed it.
    The fixture is an nkilib folder, with or without the dist-info pip writes for nki-library."""
    (tmp_path / "nkilib").mkdir()
    (tmp_path / "nkilib" / "__init__.py").write_text("")
    if installed:
        info = tmp_path / "nki_library-2.33.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nki-library\nVersion: 2.33.0\n")
        (info / "RECORD").write_text("nkilib/__init__.py,,\nnki_library-2.33.0.dist-info/METADATA,,\n")
        (info / "top_level.txt").write_text("nkilib\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # in this process: no nkilib is installed or imported here
    try:
        proc = _preflight_here("--target", "trn2")
    finally:
        for name in [m for m in sys.modules if m == "nkilib" or m.startswith("nkilib.")]:
            del sys.modules[name]
    row = next(r for r in proc.stdout.splitlines() if r.startswith("nkilib imported from "))
    owner = "nki-library 2.33.0" if installed else "no installed distribution: a folder on the path"
    assert f"{tmp_path / 'nkilib'} ({owner})" in row and row.split()[-3:] == ["info", "train_moe_nki.py",
                                                                                "rope_parity.py"], row


EXITS = "import sys\nsys.exit(0)\n"


@pytest.fixture(scope="module")
def exiting_packages(tmp_path_factory) -> subprocess.CompletedProcess:
    """One preflight run with a torchtitan and a transformers that both call sys.exit(0) at import first on the path
    (in this process, the real ones set aside meanwhile); each has its own rows in the table."""
    root = tmp_path_factory.mktemp("exiting_packages")
    for package in ("torchtitan", "transformers"):
        (root / package).mkdir()
        (root / package / "__init__.py").write_text(EXITS)
    return _preflight("--target", "cpu", shadow=root)


@pytest.mark.parametrize("package, init, row, needle", [
    ("torchtitan", EXITS, "import torchtitan ", "import torchtitan: the import called sys.exit(0)"),
    ("transformers", EXITS, "transformers:AutoConfig ",
     "transformers:AutoConfig AutoModelForCausalLM AutoTokenizer Qwen3Config Qwen3ForCausalLM Qwen3MoeForCausalLM: "
     "the import called sys.exit(0)"),
    ("torchtitan", "raise ValueError('not this torchtitan')\n", "import torchtitan ",
     "import torchtitan: ValueError: not this torchtitan"),
], ids=["torchtitan-sys-exit", "transformers-sys-exit", "torchtitan-value-error"])
def test_a_shadow_package_that_exits_or_raises_at_import_is_an_error_row(request, tmp_path, package, init, row,
                                                                        needle):
    """A package first on the path whose __init__ calls sys.exit(0), or raises what an import does not usually
    raise: the preflight could not check what it imports, so those rows are ERROR and the run is not a pass (not an
    empty output and exit 0, nor a traceback). The two sys.exit(0) packages share one run (`exiting_packages`)."""
    if init == EXITS:
        proc = request.getfixturevalue("exiting_packages")
    else:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(init)
        proc = _preflight("--target", "cpu", shadow=tmp_path)
    line = _error_line(proc)
    assert needle in line, line
    assert "checks passed" not in proc.stdout
    rows = [r for r in proc.stdout.splitlines() if r.startswith(row)]
    assert len(rows) == 1 and " ERROR " in rows[0], proc.stdout


def _preflight_with_requirements(tmp_path, monkeypatch, content: bytes | None) -> subprocess.CompletedProcess:
    """The preflight (in this process) reading a requirements.txt that holds `content` (None: a folder of that
    name) in place of the one beside common/."""
    req = tmp_path / "requirements.txt"
    if content is None:
        req.mkdir()
    else:
        req.write_bytes(content)
    monkeypatch.setattr(preflight, "REQUIREMENTS", req)
    return _preflight_here("--target", "cpu")


@pytest.mark.parametrize("content, needle", [
    (b"torch==2.14.1\n\xff\xfe\x00garbage==1\n", "requirements.txt: is not UTF-8 text (byte 14)"),
    (b"torch==2.14.1\nfoo ==\n", "requirements.txt: line 2 is not a requirement pip reads: 'foo =='"),
    (None, "requirements.txt: cannot be read (Is a directory)"),
], ids=["bad-bytes", "pin-without-a-version", "a-folder"])
def test_a_requirements_txt_that_cannot_be_read_is_an_error_row(tmp_path, monkeypatch, content, needle):
    """requirements.txt is where the CPU stack's tested versions come from: one that cannot be read or parsed is an
    ERROR row naming it, not a pass without version rows and not a traceback."""
    proc = _preflight_with_requirements(tmp_path, monkeypatch, content)
    line = _error_line(proc)
    assert needle in line, line
    assert "checks passed" not in proc.stdout
    assert any(r.startswith("requirements.txt ") and " ERROR " in r for r in proc.stdout.splitlines()), proc.stdout


PATCH = json.loads((ROOT / "tests" / "assets" / "neuron-2.33.1.json").read_text())


def _dpkg_query(folder: Path, versions: dict[str, str]) -> Path:
    """An executable `dpkg-query` in `folder` that answers `dpkg-query -W -f=${Version} PACKAGE` with `versions` (as
    dpkg prints them: an epoch or a build suffix around the number), and any other package as dpkg does: not found,
    exit 1. First on PATH, it is the one the preflight runs (it looks dpkg-query up on PATH)."""
    cases = "".join(f"  {pkg}) printf '%s' '{version}' ;;\n" for pkg, version in versions.items())
    script = folder / "dpkg-query"
    script.write_text('#!/bin/sh\nfor pkg; do :; done\ncase "$pkg" in\n' + cases +
                      '  *) echo "dpkg-query: no packages found matching $pkg" >&2; exit 1 ;;\nesac\n')
    script.chmod(0o755)
    return folder


def test_the_system_package_minimums_are_the_2331_release():
    """The runtime, collectives and driver the preflight asks for are Neuron 2.33.1's (its release notes' package
    updates), each newer than 2.33.0's."""
    assert preflight.NEURON_SYSTEM == PATCH["system"]
    for pkg, version in PATCH["system"].items():
        assert preflight._release_numbers(RELEASE["not_pip"][pkg]) < preflight._release_numbers(version), pkg


def test_neuron_system_packages_older_than_2331_are_warning_rows(tmp_path):
    """Neuron 2.33.1 fixes a hang of HWDGE DMA transposes racing collectives (the MoE backward kernel's, under FSDP):
    with a dpkg-query first on PATH that reports 2.33.0's runtime, 2.33.1's collectives (with a build suffix) and no
    driver (a container's is the host's), the runtime row is a WARN naming 2.33.1, the collectives row ok, the driver
    row info; none of them is an error."""
    folder = _dpkg_query(tmp_path, {
        "aws-neuronx-runtime-lib": RELEASE["not_pip"]["aws-neuronx-runtime-lib"] + "-5d0c7e2a1",
        "aws-neuronx-collectives": PATCH["system"]["aws-neuronx-collectives"] + "-8b3f1a9c4"})
    with pytest.MonkeyPatch.context() as mp:  # in this process, the dpkg-query first on its PATH
        mp.setenv("PATH", os.pathsep.join([str(folder), os.environ["PATH"]]))
        proc = _preflight_here("--target", "trn2")
    rows = {r.split()[0]: r for r in proc.stdout.splitlines() if r.startswith("aws-neuronx-")}
    runtime, collectives, driver = (rows[p] for p in ("aws-neuronx-runtime-lib", "aws-neuronx-collectives",
                                                     "aws-neuronx-dkms"))
    assert runtime.startswith("aws-neuronx-runtime-lib >= 2.35.33.0 (Neuron 2.33.1) "), runtime
    assert "2.35.30.0-5d0c7e2a1: older than Neuron 2.33.1's" in runtime and runtime.split()[-2] == "WARN", runtime
    assert "2.35.49.0-8b3f1a9c4" in collectives and collectives.split()[-2] == "ok", collectives
    assert "not found" in driver and driver.split()[-2] == "info", driver
    assert "aws-neuronx" not in _error_line(proc)  # a warning, not an error (the error is the missing torch-neuronx)


def test_a_problem_reports_package_lists_are_pip_lists_and_dpkgs(tmp_path, monkeypatch):
    """results.json `installed` on a Neuron run (what AWS's bug template asks for): every installed distribution as
    name==version, as pip lists it, and the Neuron OS packages as `dpkg-query -W 'aws-neuronx*'` prints them (a
    dpkg-query first on PATH that answers that pattern only)."""
    script = tmp_path / "dpkg-query"
    script.write_text("#!/bin/sh\n[ \"$1 $2\" = \"-W aws-neuronx*\" ] || exit 2\n"
                      "printf 'aws-neuronx-collectives\\t2.35.49.0-8b3f1a9c4\\naws-neuronx-runtime-lib\\t2.35.33.0\\n'\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path), os.environ["PATH"]]))
    lists = preflight.installed_lists()
    assert f"torch=={preflight.installed_version('torch')}" in lists["pip"]
    assert f"torchtitan=={preflight.installed_version('torchtitan')}" in lists["pip"]
    assert lists["os"] == ["aws-neuronx-collectives 2.35.49.0-8b3f1a9c4", "aws-neuronx-runtime-lib 2.35.33.0"]
    assert lists["os_from"] == "dpkg-query -W 'aws-neuronx*'"


@pytest.mark.parametrize("version, verdict, found", [
    ("2.31.7.0", "WARN", "2.31.7.0: older than Neuron 2.33.1's"),
    ("2.31.8.0-3c5e", "ok", "2.31.8.0-3c5e"),
    ("1:2.31.8", "ok", "1:2.31.8"),
    ("2.32.0.0", "WARN", "2.32.0.0: newer than tested (Neuron 2.33.1's)"),
    ("unknown", "WARN", "unknown: cannot be compared"),
], ids=["2.33.0", "2.33.1", "epoch", "newer", "unreadable"])
def test_the_driver_row_compares_the_version_dpkg_reports(tmp_path, monkeypatch, version, verdict, found):
    """The same comparison in this process (the version rows of the trn2 table), the dpkg-query on PATH reporting
    the driver at each version."""
    monkeypatch.setenv("PATH", os.pathsep.join([str(_dpkg_query(tmp_path, {"aws-neuronx-dkms": version})),
                                                os.environ["PATH"]]))
    rows = [row for row in preflight._versions("trn2") if row[0].startswith("aws-neuronx-dkms")]
    assert rows == [("aws-neuronx-dkms >= 2.31.8.0 (Neuron 2.33.1)", found, verdict)]


def test_a_torchtitan_without_model_spec_names_the_form_it_takes_and_the_pin(tmp_path):
    """A torchtitan after ModelSpec's removal takes the model as Trainer.Config(model=...): the rows that look for
    config.model_spec (the Trainer.Config field and the registry builders' `.model_spec`) name that form and the
    torchtitan to install, and the error line names it once."""
    shadow = _shadow_torchtitan(tmp_path, "def derive(*a, **k): pass\ndef apply_overrides(*a, **k): pass\n")
    files = {"torchtitan/trainer.py": """
                 from dataclasses import dataclass

                 class Trainer:
                     @dataclass(slots=True)
                     class Config:  # the model config itself, no ModelSpec
                         model: object = None
                 """,
             "torchtitan/models/__init__.py": "", "torchtitan/models/qwen3/__init__.py": "",
             "torchtitan/models/qwen3/config_registry.py": """
                 from torchtitan.trainer import Trainer

                 def qwen3_32b():
                     return Trainer.Config()

                 def qwen3_30b_a3b():
                     return Trainer.Config()
                 """}
    for rel, text in files.items():
        (shadow / rel).parent.mkdir(parents=True, exist_ok=True)
        (shadow / rel).write_text(textwrap.dedent(text))
    proc = _preflight("--target", "cpu", shadow=shadow)
    line = _error_line(proc)
    rows = [r for r in proc.stdout.splitlines() if " ERROR " in r and "model_spec" in r.split(" ERROR ")[0]]
    assert any(r.startswith("torchtitan.trainer:Trainer.Config fields ") for r in rows), proc.stdout
    assert any(r.startswith("torchtitan.models.qwen3.config_registry:qwen3_32b().model_spec ") for r in rows)
    for row in rows:
        assert "Trainer.Config(model=...)" in row and "torchtitan 0.3.0" in row and "release-2.33" in row, row
    assert line.count("Trainer.Config(model=...)") == 1 and "torchtitan-neuron release-2.33" in line, line


def test_a_torchtitan_whose_overridden_trainer_method_was_renamed_is_named(tmp_path):
    """The guards subclass torchtitan's Trainer and components and override their methods (common/harness/trainer.py):
    a torchtitan whose Trainer renamed `train_step` (or whose checkpoint manager's `_should_save` lost `last_step`)
    is an error row naming the method, before any launch, not a guard that silently stops being called."""
    shadow = _shadow_torchtitan(tmp_path, "def derive(*a, **k): pass\ndef apply_overrides(*a, **k): pass\n")
    files = {
        "torchtitan/trainer.py": """
            class Trainer:
                class Config:
                    pass

                def __init__(self, config): pass
                def train(self): pass
                def step(self, data_iterator): pass  # train_step renamed
                def should_continue_training(self): return False
            """,
        "torchtitan/components/__init__.py": "",
        "torchtitan/components/checkpoint.py": """
            class CheckpointManager:
                def save(self, curr_step, last_step=False): pass
                def _should_save(self, curr_step): pass  # last_step gone
                def _save(self, curr_step, last_step=False): pass
                def _load(self, step=-1): pass
            """,
    }
    for rel, text in files.items():
        (shadow / rel).parent.mkdir(parents=True, exist_ok=True)
        (shadow / rel).write_text(textwrap.dedent(text))
    proc = _preflight("--target", "cpu", shadow=shadow)
    rows = {r.split()[0]: r for r in proc.stdout.splitlines() if r.startswith("torchtitan.")}
    assert "missing Trainer.train_step" in rows["torchtitan.trainer:Trainer.train_step"], rows
    assert " ERROR " in rows["torchtitan.trainer:Trainer.train_step"]
    assert "does not take last_step" in rows["torchtitan.components.checkpoint:CheckpointManager._should_save"]
    assert rows["torchtitan.trainer:Trainer.should_continue_training"].split()[-4] == "ok", rows
    assert proc.returncode == 2 and "Trainer.train_step" in _error_line(proc)
