"""AWS's TorchTitan Neuron configs of this project's layouts beside the presets, field by field.

    python -m tools.aws_config_diff      # on a trn2 host where torchtitan_neuron imports

For each preset with an AWS config of the same layout (AWS_CONFIGS: qwen3_8b, qwen3_4b, qwen3_30b_a3b_reduced),
prints one `[preflight]` line naming the two configs and how many fields differ, then a line per differing field:
`  path: AWS value, preset value`, over the Trainer.Config sections parallelism, activation_checkpoint, training and
compile, the attention class and the parallelize function's module. Where torchtitan_neuron is not installed, or
has no such config, or a config cannot be made, one line says so. Exit code 0; a bad command line is one `error:`
line and exit code 2. The preset's config is made as its --dry_run makes it: no model is built and nothing is
trained. `python -m common.harness.preflight --target trn2` names this command. Set-up tooling: no example imports
it, nothing copies it.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python tools/aws_config_diff.py` as well as `python -m tools.aws_config_diff`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.errors import ArgumentParser, UserError  # noqa: E402
# A failure in a row's few words, as the preflight's table shows one.
from common.harness.preflight import _failure  # noqa: E402


# AWS's TorchTitan Neuron configs beside the presets of the same layout, compared on a host where torchtitan_neuron
# imports. The module and config name are the TorchTitan Neuron basic training tutorial's ("Module:
# torchtitan_neuron.models.qwen3 Config: qwen3_8b_tp4_fsdp16_sac": awsdocs-neuron.readthedocs-hosted.com/en/latest/
# training/torchtitan/tutorials/tutorial-basic-training.html); the registry is found as torchtitan's own --module
# finds one (MODULE.config_registry, else MODULE itself: torchtitan 0.3.0 config/manager.py:126-133), and its 4B and
# MoE configs by name prefix, since no page read here names them. Each entry: (script, preset, AWS module, AWS
# config name or name prefix).
AWS_CONFIGS = (("train_native_qwen3.py", "qwen3_8b", "torchtitan_neuron.models.qwen3", "qwen3_8b_tp4_fsdp16_sac"),
               ("train_native_qwen3.py", "qwen3_4b", "torchtitan_neuron.models.qwen3", "qwen3_4b*"),
               ("train_moe_nki.py", "qwen3_30b_a3b_reduced", "torchtitan_neuron.models.qwen3", "qwen3_30b_a3b*"))
# What the comparison covers: the Trainer.Config sections a layout is made of, compared field by field, then the
# attention class and the parallelize function's module, read from the model spec.
DIFF_SECTIONS = ("parallelism", "activation_checkpoint", "training", "compile")
_ABSENT = type("absent", (), {"__repr__": lambda self: "(absent)"})()


def _shown(value):
    """A value as the difference shows it: a class or function by its module and name, a config by its class."""
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"
    return value


def _field_names(obj) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(obj)]


def _is_config(value) -> bool:
    """A dataclass instance (a config to compare field by field), not a dataclass class (a value)."""
    import dataclasses

    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _diff(path: str, theirs, ours, out: list) -> None:
    if _is_config(theirs) and _is_config(ours):
        if type(theirs) is not type(ours):
            out.append((f"{path} (class)", _shown(type(theirs)), _shown(type(ours))))
        names = list(dict.fromkeys(_field_names(theirs) + _field_names(ours)))
        for name in names:
            _diff(f"{path}.{name}", getattr(theirs, name, _ABSENT), getattr(ours, name, _ABSENT), out)
    elif _is_config(theirs) or _is_config(ours):
        out.append((path, _shown(type(theirs)) if theirs is not _ABSENT else theirs,
                    _shown(type(ours)) if ours is not _ABSENT else ours))
    elif _shown(theirs) != _shown(ours):
        out.append((path, _shown(theirs), _shown(ours)))


def _attention_class(tc):
    """The class of the first layer's inner attention config (torchtitan 0.3.0's Qwen3: GQAttention.Config's
    inner_attention), or _ABSENT where the model spec has none."""
    layers = getattr(getattr(getattr(tc, "model_spec", None), "model", None), "layers", None)
    inner = getattr(getattr(layers[0], "attention", None), "inner_attention", _ABSENT) if layers else _ABSENT
    return _ABSENT if inner is _ABSENT else type(inner)


def config_diff(theirs, ours, sections: tuple[str, ...] = DIFF_SECTIONS) -> list[tuple[str, object, object]]:
    """(field path, theirs, ours) for each field that differs between two torchtitan Trainer.Config objects, in
    `sections` (recursive over dataclass fields: a field only one side has shows `(absent)` on the other; a config
    of another class shows both classes, then the fields), then the attention class and the parallelize function's
    module."""
    out: list = []
    for name in sections:
        _diff(name, getattr(theirs, name, _ABSENT), getattr(ours, name, _ABSENT), out)
    _diff("attention class", _attention_class(theirs), _attention_class(ours), out)
    fn = [getattr(getattr(tc, "model_spec", None), "parallelize_fn", None) for tc in (theirs, ours)]
    _diff("parallelize function module", *(getattr(f, "__module__", _ABSENT) for f in fn), out)
    return out


def format_diff(diff, theirs_name: str, ours_name: str) -> str:
    """The difference as lines, `  path: AWS ..., preset ...`; one line saying they agree where nothing differs."""
    if not diff:
        return f"  {theirs_name} and {ours_name} agree in {', '.join(DIFF_SECTIONS)}, attention, parallelize"
    return "\n".join(f"  {path}: {theirs_name} {theirs!r}, {ours_name} {ours!r}" for path, theirs, ours in diff)


def preset_config(script: str, preset: str):
    """The project's torchtitan Trainer.Config of examples/SCRIPT's `preset`, made as its --dry_run makes it
    (common/harness/lifecycle.py dry_run: the guarded recipe's trainer_config on a meta-device target); no model is
    built and nothing is trained."""
    import tempfile

    import torch

    from common import device

    # By name: a module the presets need that is missing (the training harness, or torchtitan beneath it) is named
    # in the comparison's line for this preset, not an import error of the tool.
    try:
        lifecycle = importlib.import_module("common.harness.lifecycle")
        Inputs = importlib.import_module("common.recipe").Inputs
    except ModuleNotFoundError as e:
        raise UserError(f"{script}'s presets need the training harness: no module {e.name}") from None

    path = Path(__file__).resolve().parents[1] / "examples" / script
    module = sys.modules.get(path.stem)
    if module is None:  # the example as `python examples/SCRIPT` loads it, under its own name
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = sys.modules[path.stem] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    if "torchtitan.tools.utils" not in sys.modules:
        device.route_torchtitan_device("cpu")  # as the dry run routes it; a routed torchtitan (trn2) stays routed
    recipe = module.RECIPE
    cfg = lifecycle.parse(recipe, ["--preset", preset])
    with tempfile.TemporaryDirectory() as out:
        found = recipe.dry_run_inputs(cfg, Path(out)) if recipe.dry_run_inputs else Inputs()
        target = device.DeviceInfo(torch.device("meta"), cfg.device, "fake", 0, 0, cfg.guards.dry_run_ranks)
        with contextlib.redirect_stdout(io.StringIO()):
            tc, _notes = recipe.trainer_config(cfg, target, Path(out), found)
    return tc


def aws_registry(module_name: str):
    """AWS's config registry module, found as torchtitan's --module finds one: MODULE.config_registry, else MODULE."""
    for candidate in (f"{module_name}.config_registry", module_name):
        try:
            return importlib.import_module(candidate)
        except ImportError:
            continue
    return None


def aws_comparison(configs=AWS_CONFIGS, package: str = "torchtitan_neuron") -> str:
    """On a host where `package` (torchtitan_neuron) imports: each AWS config of a preset's layout against the preset,
    field by field (config_diff); one line saying so where it is not installed or has no such config."""
    if importlib.util.find_spec(package) is None:
        return f"[preflight] AWS's configs not compared: {package} is not installed"
    lines = []
    for script, preset, module_name, wanted in configs:
        registry = aws_registry(module_name)
        names = ([n for n in dir(registry) if n.startswith(wanted[:-1]) and callable(getattr(registry, n))]
                 if registry is not None and wanted.endswith("*") else [wanted])
        found = [n for n in names if registry is not None and callable(getattr(registry, n, None))]
        if not found:
            lines.append(f"[preflight] {module_name}: no config {wanted} to compare with {script} --preset {preset}")
            continue
        try:
            ours = preset_config(script, preset)
        except Exception as e:  # the comparison is a report: a preset that cannot be made is named, not raised
            lines.append(f"[preflight] {script} --preset {preset} not compared: {_failure(e)}")
            continue
        for name in found:
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    theirs = getattr(registry, name)()
            except Exception as e:
                lines.append(f"[preflight] {module_name} {name}() not compared: {_failure(e)}")
                continue
            diff = config_diff(theirs, ours)
            lines.append(f"[preflight] AWS's {module_name} {name} vs {script} --preset {preset}: "
                         f"{len(diff)} field(s) differ")
            lines.append(format_diff(diff, "AWS", "preset"))
    return "\n".join(lines)



def main(argv: list[str] | None = None) -> int:
    ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    print(aws_comparison(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
