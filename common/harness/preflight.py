"""Stack preflight: is every external symbol the scripts use where they import it, taking the keywords they pass?

    python -m common.harness.preflight                  # this machine's stack (trn2 where torch-neuronx is installed, else cpu)
    python -m common.harness.preflight --target trn2    # the Trainium stack: the first command on a trn2 box

Prints one table (requirement, found, verdict) and exits 0, or 2 with one `error:` line naming each missing piece
(a version other than the tested one is only a warning). No process group or Neuron runtime is started, so a wrong
torchtitan fails in seconds. With --device neuron each script runs the same check first, of what it uses: `require_stack("trn2", script)`;
the table's last column names the scripts that need each row.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

from common.errors import ArgumentParser, UserError, one_line
from common.results import installed_version

# The tested stacks, as version specifiers. CPU: the `==` pins of requirements.txt. trn2: one of two Neuron releases,
# found from the installed TorchNeuron (`trn2_stack`) and held to its own versions (TRN2_STACKS).
# 2.33: the AWS guide's, the Neuron 2.33.0 release's own versions (requirements-trn2.txt; tests/test_preflight.py
# checks both against the release's table). TorchNeuron is published as the family 2.14.3.0.*, which `==2.14.3` does
# not match.
TRN2_PINS = {"torch": "==2.14.0", "torch-neuronx": "==2.14.3.0.*", "neuronx-cc": "==2.28.7631.0", "nki": "==0.7.0",
             "transformers": "==5.16.0", "torchtitan-neuron": "==0.2.2+neuron.1"}  # torchtitan-neuron: release-2.33
# 2.34 (2026-11-30; requirements-trn2-2.34.txt), the Neuron 2.34.0 release's own versions: neuronx-cc 2.29.16866.0 and
# nki 0.8.0 (its package list: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.34.0/release-notes/
# releasecontent.html), torch-neuronx 2.14.3.1 ("torch-neuronx 2.13.3.1 and 2.14.3.1 (Neuron 2.34.0 Release)",
# "install torch-neuronx==2.14.* with PyTorch 2.14": https://github.com/aws-neuron/torch-neuronx/releases/tag/v2.34.0;
# the build suffix is not given, hence 2.14.3.1.*) and TorchTitan Neuron 0.2.2+neuron.2 ("Latest version (in
# 2.34.0)": https://awsdocs-neuron.readthedocs-hosted.com/en/v2.34.0/_sources/release-notes/components/
# torchtitan-neuron.rst). torch: the 2.14 line torch-neuronx 2.14.* is built for (its own requirement fixes the patch).
# Not confirmed for 2.34: the NKI Library (nkilib) version and TorchTitan Neuron's branch or tag.
TRN2_234_PINS = {"torch": "==2.14.*", "torch-neuronx": "==2.14.3.1.*", "neuronx-cc": "==2.29.16866.0",
                 "nki": "==0.8.0", "transformers": "==5.16.0", "torchtitan-neuron": "==0.2.2+neuron.2"}
TRN2_STACKS = {"2.33": (TRN2_PINS, "requirements-trn2.txt"), "2.34": (TRN2_234_PINS, "requirements-trn2-2.34.txt")}
# Which release a TorchNeuron build belongs to, by its first four numbers (2.13 and 2.14 lines alike).
TORCH_NEURONX_RELEASE = {(3, 0): "2.33", (3, 1): "2.34"}
# TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION's default, per stack: 2.34 documents True ("When 1 (the default), a
# torch.compile(backend="neuron") graph that fails to compile raises the error instead of falling back to eager
# execution ... Affects the torch.compile path only": awsdocs-neuron.readthedocs-hosted.com/en/v2.34.0/torch/reference/
# env-vars.html). For 2.33 no page read here states it; TorchNeuron's April pre-release source defaulted to False.
FALLBACK_VAR = "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"
FALLBACK_DEFAULT = {"2.34": "True (a graph that fails to compile raises)",
                    "2.33": "not stated for 2.33 (TorchNeuron's April source: False, eager fallback)"}
TRN2_PYTHON = (3, 12)
TRN2_INFO = ("nki-library",)  # reported: the public index has only a placeholder (the kernels: nkilib, neuronx-cc's)
# The Neuron runtime, collectives and driver are OS packages (deb or rpm), at least at the Neuron 2.33.1 release's
# versions (tests/assets/neuron-2.33.1.json): 2.33.1 changes only these (the pip stack stays 2.33.0's) and fixes a
# hang when HWDGE DMA transposes race collectives, as the blockwise MoE backward kernel's transposes do while FSDP's
# collectives run. An older one is a warning row; one not found (a container's driver is the host's) is reported.
NEURON_SYSTEM = {"aws-neuronx-runtime-lib": "2.35.33.0", "aws-neuronx-collectives": "2.35.49.0",
                 "aws-neuronx-dkms": "2.31.8.0"}
SYSTEM_RELEASE = "Neuron 2.33.1"
# The 2.34 stack's: the Neuron 2.34.0 release's own (its package list:
# https://awsdocs-neuron.readthedocs-hosted.com/en/v2.34.0/release-notes/releasecontent.html), held as 2.33's are.
NEURON_SYSTEM_234 = {"aws-neuronx-runtime-lib": "2.36.8.0", "aws-neuronx-collectives": "2.36.0.0",
                     "aws-neuronx-dkms": "2.32.6.0"}
SYSTEM_STACKS = {"2.33": (NEURON_SYSTEM, SYSTEM_RELEASE), "2.34": (NEURON_SYSTEM_234, "Neuron 2.34.0")}
PIP_NAME = {"torch_neuronx": "torch-neuronx", "nkilib": "nkilib (neuronx-cc or nki-library)"}

# Every external symbol the scripts use, a line each: "module:name name ...", then after "|" the keywords their calls
# pass (with one name; an indented line continues the keywords), then after "@" the scripts that use it (SCRIPTS; no
# "@": all of them). A dotted name is read attribute by attribute; "f()" is called, as the scripts call a registry
# builder. The Trainium lines are the documented APIs common/kernels/ calls; `wrap_nki` is a requirement only where
# the kernels' launch setting uses it (common/kernels/rope_op.py: NKI_LAUNCH).
SCRIPTS = {"native": "train_native_qwen3.py", "hf": "train_hf_backend.py", "moe": "train_moe_nki.py",
           "rope": "rope_parity.py", "compat": "generate_compat_check.py"}
CPU_AND_TRN2 = """
torchtitan.config:override | target fqns exact description @ native hf moe rope
torchtitan.config:derive apply_overrides @ native hf moe rope
torchtitan.config.override:OverrideConfig | imports @ native hf moe rope
torchtitan.trainer:Trainer.Config @ native hf moe
torchtitan.trainer:Trainer.__init__ | config @ native hf moe
torchtitan.trainer:Trainer.train @ native hf moe
torchtitan.trainer:Trainer.train_step | data_iterator @ native hf moe
torchtitan.trainer:Trainer.should_continue_training @ native hf moe
torchtitan.experiments.transformers_modeling_backend.configs:TransformersBackendConfig @ hf
torchtitan.components.metrics:MetricsProcessor.__init__ | config parallel_dims @ native hf moe
torchtitan.components.metrics:MetricsProcessor.log | step global_avg_loss global_max_loss grad_norm extra_metrics
    @ native hf moe
torchtitan.components.checkpoint:CheckpointManager.save | curr_step last_step @ native hf moe
torchtitan.components.checkpoint:CheckpointManager._should_save | curr_step last_step @ native hf moe
torchtitan.components.checkpoint:CheckpointManager._save | curr_step last_step @ native hf moe
torchtitan.components.checkpoint:CheckpointManager._load | step @ native hf moe
torchtitan.components.checkpoint:CheckpointManager.maybe_wait_for_saving @ native hf moe
torchtitan.components.validate:Validator.__init__ | config @ native hf moe
torchtitan.components.validate:Validator.validate | model_parts step @ native hf moe
torchtitan.components.validate:Validator.should_validate | step @ native hf moe
torchtitan.tools.profiler:Profiler.build_torch_profiler | global_step base_folder leaf_folder @ native hf moe
torchtitan.tools.profiler:Profiler.__exit__ | exc_type exc_val exc_tb @ native hf moe
torchtitan.tools.profiler:PROFILE_FILE PROFILE_ITER_DIR @ native hf moe
torchtitan.hf_datasets:DatasetConfig | path loader sample_processor @ native hf moe
torchtitan.hf_datasets.text_datasets:DATASETS _process_c4_text @ native hf moe
torchtitan.components.metrics:MetricsProcessor.log_validation | loss step extra_metrics @ native hf moe
torchtitan.components.optimizer:default_adamw | lr @ native hf moe
torchtitan.distributed:ParallelDims @ native hf moe
torchtitan.distributed.activation_checkpoint:FullAC @ native hf moe
torchtitan.models.common:Embedding Linear @ native hf moe rope
torchtitan.models.common.rope:CosSinRoPE _yarn_inv_freq @ native hf moe rope
torchtitan.models.common.moe:RoutedExperts @ moe
torchtitan.models.common.attention:FlexAttention VarlenAttention VarlenMetadata @ native hf moe
torchtitan.models.common.nn_modules:RMSNorm @ native moe rope
torchtitan.models.common.config_utils:decoder_vocab_size @ native moe
torchtitan.models.qwen3:model_registry _build_qwen3_layers _build_qwen3_moe_layers @ native moe rope
torchtitan.models.qwen3.model:Qwen3Model @ native moe rope
torchtitan.models.qwen3.config_registry:qwen3_32b().model_spec qwen3_30b_a3b().model_spec @ native moe
torchtitan.experiments.transformers_modeling_backend:model_registry @ hf
torchtitan.experiments.transformers_modeling_backend.config_registry:transformers_modeling_backend_full @ hf
torchtitan.tools.logging:init_logger @ native hf moe rope
transformers:AutoConfig AutoModelForCausalLM AutoTokenizer Qwen3Config Qwen3ForCausalLM Qwen3MoeForCausalLM
transformers.models.qwen3.modeling_qwen3:Qwen3RotaryEmbedding apply_rotary_pos_emb @ rope
transformers.modeling_rope_utils:ROPE_INIT_FUNCTIONS @ hf
transformers.distributed:DistributedConfig | tp_size enable_expert_parallel @ compat
"""
TRN2_ONLY = """
torch_neuronx
torch_neuronx:wrap_nki @ wrap_nki
nki:jit @ moe rope
nki.language:bfloat16 @ moe rope
nkilib.core.embeddings.rope_hf:rope_hf | q k q_out k_out rope_cache backward @ moe rope
nkilib.experimental.moe.forward.bwmm_shard_on_H:blockwise_mm_baseline_shard_hidden | hidden_states
    expert_affinities_masked gate_up_proj_weight down_proj_weight block_size token_position_to_id block_to_expert
    gate_up_activations_T down_activations compute_dtype is_tensor_update_accumulating expert_affinities_scaling_mode
    @ moe
nkilib.experimental.moe.bwd.blockwise_mm_backward:blockwise_mm_bwd | hidden_states expert_affinities_masked
    gate_up_proj_weight down_proj_weight gate_up_proj_act_checkpoint_T down_proj_act_checkpoint token_position_to_id
    block_to_expert output_hidden_states_grad block_size compute_dtype is_tensor_update_accumulating @ moe
nkilib.core.utils.common_types:ExpertAffinityScaleMode.POST_SCALE @ moe
"""
# Every torchtitan config field the scripts set, by the class that holds it: "module:Class field field ... @ users".
# A slots dataclass without the field fails at the assignment, after the preflight, so each is checked here by its
# dataclass fields (nothing is built). A field ending in "?" is a CUDA setting, set only where it exists: its
# absence is reported, not an error.
CONFIG_FIELDS = """
torchtitan.trainer:Trainer.Config hf_assets_path dump_folder model_spec optimizer loss dataloader checkpoint training
    lr_scheduler debug metrics parallelism override compile activation_checkpoint validator comm @ native hf moe
torchtitan.config.configs:CommConfig init_timeout_seconds train_timeout_seconds @ native hf moe
torchtitan.components.validate:Validator.Config enable freq steps dataloader @ native hf moe
torchtitan.config.configs:TrainingConfig steps local_batch_size global_batch_size seq_len mixed_precision_param
    @ native hf moe
torchtitan.config.configs:TrainingConfig disable_cuda_graphs? @ native hf moe
torchtitan.components.checkpointer.dcp:CheckpointManager.Config enable interval initial_load_path initial_load_in_hf
    last_save_model_only last_save_in_hf export_dtype load_only keep_latest_k async_mode @ native hf moe
torchtitan.components.optimizer.lr_scheduler:LRSchedulersContainer.Config warmup_steps @ native hf moe
torchtitan.hf_datasets.text_datasets:HuggingFaceTextDataLoader.Config dataset dataset_path @ native hf moe
torchtitan.config.configs:DebugConfig seed deterministic @ native hf moe
torchtitan.config.configs:DebugConfig print_config @ hf
torchtitan.components.metrics:MetricsProcessor.Config log_freq enable_tensorboard save_tb_folder @ native hf moe
torchtitan.components.loss:ChunkedLossWrapper.Config loss_fn @ native moe
torchtitan.components.loss:CrossEntropyLoss.Config global_vocab_size @ native moe
torchtitan.config.configs:ParallelismConfig tensor_parallel_degree expert_parallel_degree @ moe
torchtitan.config.override:OverrideConfig imports @ moe
"""
# The Neuron backends: the training scripts' process group (rope_parity.py runs one process), the compatibility
# check's torch.compile (training runs eager) and its sharded workers' process group.
NEURON_BACKENDS = {"dist": ("native", "hf", "moe", "compat"), "compile": ("compat",)}


def _symbol_rows(text: str, targets: tuple[str, ...]) -> list[tuple[tuple[str, ...], str, tuple[str, ...], tuple]]:
    """(targets, "module:names", keywords, users) for each line of a table above."""
    rows = []
    for line in text.strip().splitlines():
        line, _, users = line.partition("@")
        if line.startswith(" "):  # more keywords of the row above
            rows[-1] = (targets, rows[-1][1], rows[-1][2] + tuple(line.split()), tuple(users.split()) or rows[-1][3])
        else:
            spec, _, keywords = line.partition("|")
            rows.append((targets, spec.strip(), tuple(keywords.split()), tuple(users.split()) or tuple(SCRIPTS)))
    return rows


SYMBOLS = _symbol_rows(CPU_AND_TRN2, ("cpu", "trn2")) + _symbol_rows(TRN2_ONLY, ("trn2",))
FIELDS = [(spec.split()[0], tuple(spec.split()[1:]) + keywords, users)
          for _, spec, keywords, users in _symbol_rows(CONFIG_FIELDS, ("cpu", "trn2"))]
OK, WARN, ERROR, INFO = "ok", "WARN", "ERROR", "info"
# Where the scripts' config.model_spec is missing: the torchtitan that dropped ModelSpec (after 0.3.0) takes the
# model config itself as Trainer.Config(model=...), which the scripts do not build.
MODEL_SPEC_GONE = ("this torchtitan has no ModelSpec: it takes Trainer.Config(model=...), as torchtitan after 0.3.0 "
                   "does; install torchtitan 0.3.0 (trn2: torchtitan-neuron release-2.33)")


REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements.txt"  # beside common/


def _cpu_pins() -> tuple[dict[str, str], list[str]]:
    """The `==` pins of requirements.txt ({distribution: specifier}), and what could not be read: a file that is
    missing, unreadable or not UTF-8, a pin that does not parse (`foo ==`). Each of those is an ERROR row, never a
    pass: a version the preflight could not check has not been checked."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        text = REQUIREMENTS.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return {}, [f"not found at {REQUIREMENTS}: the tested versions cannot be checked"]
    except OSError as e:
        return {}, [f"cannot be read ({e.strerror or e}): the tested versions cannot be checked"]
    except UnicodeDecodeError as e:
        return {}, [f"is not UTF-8 text (byte {e.start}): the tested versions cannot be checked"]
    pins, bad = {}, []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#")[0].strip()
        if "==" not in line or line.startswith("-"):  # not a pin (a range, an option of pip's)
            continue
        try:
            req = Requirement(line)
            if not req.specifier:
                raise InvalidRequirement(line)
        except InvalidRequirement:
            bad.append(f"line {number} is not a requirement pip reads: {one_line(line)[:60]!r}")
            continue
        pins[req.name] = str(req.specifier)
    return pins, bad


def admits(spec: str, version: str | None) -> bool:
    """Whether an installed `version` satisfies the version specifier `spec` (PEP 440, as pip reads it)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return version is not None and SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def trn2_stack(read=installed_version) -> tuple[str, str]:
    """(stack, why): which Neuron release the installed TorchNeuron belongs to ("2.33" or "2.34", TRN2_STACKS), from
    its version as `read` (a distribution name -> version or None) gives it; without TorchNeuron, or with a build of
    another release, the AWS guide's 2.33, said so in `why`."""
    have = read("torch-neuronx")
    numbers = tuple(int(n) for n in re.findall(r"\d+", (have or "").split("+")[0])[:4])
    stack = TORCH_NEURONX_RELEASE.get(numbers[2:4]) if len(numbers) >= 4 and numbers[:2] in ((2, 13), (2, 14)) else None
    if stack:
        return stack, f"torch-neuronx {have}"
    return "2.33", (f"torch-neuronx {have} is neither release's: checked against 2.33" if have
                    else "no torch-neuronx: checked against 2.33, the AWS guide's")


def _stack_rows(stack: str, why: str, read=installed_version) -> list[tuple[str, str, str]]:
    """The rows that name the Neuron stack found and what differs between the two: the pins file, the compile
    fallback's default (and the variable where it is set), and how the memory peak is read."""
    from common.device import accelerator_memory_documented

    rows = [("Neuron stack", f"{stack} ({why}); pins: {TRN2_STACKS[stack][1]}", INFO)]
    value = os.environ.get(FALLBACK_VAR)
    rows.append((f"{FALLBACK_VAR} (torch.compile only)",
                 f"set to {value!r}" if value is not None else f"unset: default {FALLBACK_DEFAULT[stack]}", INFO))
    documented = accelerator_memory_documented(read("torch-neuronx"))
    rows.append(("device memory peak read with",
                 "torch.accelerator.max_memory_allocated (documented from torch-neuronx 2.14.3.1 / 2.13.3.1)"
                 if documented else "torch.neuron.max_memory_allocated (torch.accelerator's documented from 2.34)",
                 INFO))
    return rows


def _versions(target: str, read=installed_version) -> list[tuple[str, str, str]]:
    """The version rows of the `target` stack; `read` gives a distribution's installed version (None: not
    installed), the installed metadata's by default. trn2: the stack `trn2_stack` finds, held to its own pins."""
    py = platform.python_version()
    rows = [("python" + (" >= 3.12" if target == "trn2" else ""), py,
             WARN if target == "trn2" and sys.version_info[:2] < TRN2_PYTHON else OK)]
    stack = None
    if target == "trn2":
        stack, why = trn2_stack(read)
        pins, unread = TRN2_STACKS[stack][0], []
        rows += _stack_rows(stack, why, read)
    else:
        pins, unread = _cpu_pins()
    rows += [("requirements.txt", problem, ERROR) for problem in unread]
    for dist, want in pins.items():
        have = read(dist) or (read("torchtitan") if dist == "torchtitan-neuron" else None)
        rows.append((f"{dist}{want}", have or "not installed", OK if admits(want, have) else WARN))
    if target == "trn2":
        rows += [(dist, read(dist) or "not installed", INFO) for dist in TRN2_INFO]
        system, release = SYSTEM_STACKS[stack]
        rows += [_system_row(pkg, minimum, release) for pkg, minimum in system.items()]
    return rows


def _system_row(pkg: str, minimum: str, release: str = SYSTEM_RELEASE) -> tuple[str, str, str]:
    """An OS package of the Neuron stack against the version of its `release` (SYSTEM_STACKS: Neuron 2.33.1's on the
    2.33 stack, 2.34.0's on the 2.34 stack): older is a warning (not an error: 2.33's pip stack runs on 2.33.0's
    packages too, with the hang 2.33.1 fixes); newer is a warning too (a later release's runtime under the stack's
    pip packages is a pairing nobody tested: keep the table with any report)."""
    requirement = f"{pkg} >= {minimum} ({release})"
    have = _system_version(pkg)
    if have is None:
        return requirement, "not found", INFO
    found = _release_numbers(have)
    if found is None:
        return requirement, f"{have}: cannot be compared", WARN
    if found < _release_numbers(minimum):
        return requirement, f"{have}: older than {release}'s", WARN
    if found > _release_numbers(minimum):
        return requirement, f"{have}: newer than tested ({release}'s)", WARN
    return requirement, have, OK


def _release_numbers(version: str) -> tuple[int, ...] | None:
    """The dotted numbers a deb or rpm version starts with (an epoch `1:` and a suffix `-1a2b3c` dropped), trailing
    zeros dropped: "2.35.33.0-7f3e" -> (2, 35, 33). None when it does not start with a number."""
    match = re.match(r"(?:\d+:)?(\d+(?:\.\d+)*)", version.strip())
    if match is None:
        return None
    numbers = [int(n) for n in match.group(1).split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def _system_version(pkg: str) -> str | None:
    """An OS package's version (the Neuron runtime, collectives and driver are deb or rpm packages), from the
    `dpkg-query` (else `rpm`) found first on PATH."""
    cmd = (["dpkg-query", "-W", "-f=${Version}", pkg] if shutil.which("dpkg-query") else
           ["rpm", "-q", "--qf", "%{VERSION}", pkg] if shutil.which("rpm") else None)
    if cmd is None:
        return None
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def installed_lists() -> dict:
    """What a Neuron problem report needs beside the preflight table (AWS's bug template asks for the installed
    Neuron OS packages and pip packages): every installed Python distribution as `name==version` (what `pip list`
    shows, read from the same metadata without starting pip) and the Neuron OS packages as `dpkg-query -W
    'aws-neuronx*'` (else `rpm -qa 'aws-neuronx*'`) prints them, one per line; None where neither tool is here."""
    from importlib import metadata

    pip = sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions() if d.metadata["Name"]},
                 key=str.lower)
    cmd = (["dpkg-query", "-W", "aws-neuronx*"] if shutil.which("dpkg-query") else
           ["rpm", "-qa", "aws-neuronx*"] if shutil.which("rpm") else None)
    system = None
    if cmd is not None:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
            system = [" ".join(line.split()) for line in proc.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return {"pip": pip, "os": system, "os_from": " ".join(cmd[:2]) + " 'aws-neuronx*'" if cmd else None}


def _route(target: str) -> list[tuple[str, str, str]]:
    """torchtitan binds its device at import (common.device.route_torchtitan_device): route it before the checks."""
    import torch

    rows, dev = [], "cuda" if target == "cpu" and torch.cuda.is_available() else "cpu"
    if target == "trn2" and importlib.util.find_spec("torch_neuronx") is not None:
        try:
            import torch_neuronx  # noqa: F401  registers the "neuron" device, the dist and compile backends
            dev = "neuron"
        except Exception as e:  # a broken install: name it, keep checking the rest
            rows.append(("import torch_neuronx", f"{type(e).__name__}: {e}"[:120], ERROR))
    try:
        from common import device

        device.route_torchtitan_device(dev)
    except ImportError:
        pass  # no torchtitan: its rows below say so
    except RuntimeError as e:  # already imported for another device in this process
        rows.append(("torchtitan device routing", str(e)[:120], WARN))
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # a broken or shadowing torchtitan (raises anything, or calls sys.exit at import)
        rows.append(("import torchtitan", _failure(e), ERROR))
    return rows


def _failure(e: BaseException) -> str:
    """What an import or a lookup that failed did, in a row's few words: sys.exit() at import is named as such."""
    if isinstance(e, SystemExit):
        return f"the import called sys.exit({e.code!r})"[:120]
    return one_line(f"{type(e).__name__}: {e}")[:120]


def _resolve(obj, name: str):
    for part in name.split("."):
        obj = getattr(obj, part.removesuffix("()"))
        if part.endswith("()"):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                obj = obj()
    return obj


def _parameters(obj) -> dict | None:
    """The parameters of a function, class or nki.jit kernel (the function is its `.func`; some releases keep the
    signature as `.sign`, which torch_neuronx.wrap_nki reads); None when it takes **kwargs."""
    sig = getattr(obj, "sign", None)
    if not isinstance(sig, inspect.Signature):
        sig = inspect.signature(getattr(obj, "func", obj))
    params = sig.parameters
    return None if any(p.kind is p.VAR_KEYWORD for p in params.values()) else params


def _check_symbol(spec: str, keywords: tuple[str, ...]) -> tuple[str, str, str]:
    module, _, names = spec.partition(":")
    try:
        mod = importlib.import_module(module)
        objs, missing = [], []
        for name in names.split():
            try:
                objs.append(_resolve(mod, name))
            except AttributeError:
                missing.append(name)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if e.name == top and top == "nkilib":  # the kernel's module: which one a fix must bring
            return spec, f"not installed: {module} (nkilib, from neuronx-cc or nki-library)", ERROR
        return spec, (f"not installed: {PIP_NAME.get(top, top)}" if e.name == top else f"no module {e.name}"), ERROR
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # anything a broken module raises at import, sys.exit() included
        return spec, _failure(e), ERROR
    if missing:
        gone = any(name.endswith("model_spec") for name in missing)
        return spec, f"missing {', '.join(missing)}" + (f": {MODEL_SPEC_GONE}" if gone else ""), ERROR
    if not keywords:
        return spec, "found", OK
    try:
        params = _parameters(objs[0])
    except (TypeError, ValueError) as e:
        return spec, f"signature unreadable ({e})"[:120], ERROR
    absent = [k for k in keywords if params is not None and k not in params]
    if absent:
        return spec, f"does not take {', '.join(absent)}", ERROR
    return spec, f"takes {', '.join(keywords)}", OK


def _check_fields(spec: str, fields: tuple[str, ...]) -> tuple[str, str, str]:
    """Whether the dataclass `module:Class` has each field the scripts set (read from the class, nothing built)."""
    import dataclasses

    requirement = f"{spec} fields {' '.join(fields)}"
    module, _, name = spec.partition(":")
    try:
        cls = _resolve(importlib.import_module(module), name)
        # a dataclass's fields; another class: what its constructor takes
        have = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(_parameters(cls) or ())
    except ModuleNotFoundError as e:
        return requirement, f"no module {e.name}", ERROR
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # a missing attribute, or anything a broken module raises (sys.exit() included)
        return requirement, _failure(e), ERROR
    required = [f for f in fields if not f.endswith("?")]
    missing = [f for f in required if f not in have]
    if missing:
        gone = f": {MODEL_SPEC_GONE}" if "model_spec" in missing else ""
        return requirement, f"missing field {', '.join(missing)} in {cls.__module__}{gone}", ERROR
    optional = [f.removesuffix("?") for f in fields if f.endswith("?")]
    absent = [f for f in optional if f not in have]
    if absent:  # a CUDA setting this torchtitan does not have: the scripts leave it unset
        return requirement, f"no field {', '.join(absent)} in {cls.__module__}: left unset", INFO
    return requirement, "found", OK


def _neuron_backends() -> list[tuple[str, str, str, tuple]]:
    if "torch_neuronx" not in sys.modules:
        return []  # torch-neuronx missing: already an error row
    import torch._dynamo
    import torch.distributed as dist

    found = {"dist": ("torch.distributed backend 'neuron'", "neuron" in dist.Backend.backend_list),
             "compile": ("torch.compile backend 'neuron'", "neuron" in torch._dynamo.list_backends(exclude_tags=()))}
    return [(req, "registered" if ok else "missing", OK if ok else ERROR, NEURON_BACKENDS[kind])
            for kind, (req, ok) in found.items()]


def check_all(target: str) -> list[tuple[str, str, str, tuple]]:
    """The whole table: (requirement, found, verdict, the SCRIPTS keys that need it) for the `target` stack."""
    every = tuple(SCRIPTS)
    rows = [(*row, every) for row in _versions(target) + _route(target)]
    rows += [(*_check_symbol(spec, kw), users) for targets, spec, kw, users in SYMBOLS if target in targets]
    rows += [(*_check_fields(spec, fields), users) for spec, fields, users in FIELDS]
    if target == "trn2":
        rows += _neuron_backends()
    where = getattr(sys.modules.get("torchtitan"), "__file__", None)
    if where:  # a shadowing copy earlier on the path shows here
        rows.append(("torchtitan imported from", str(Path(where).parent), INFO, every))
    if target == "trn2":
        rows.append(("nkilib imported from", nkilib_source(), INFO, ("moe", "rope")))
        rows.append(("MoE kernels' nki.jit form", kernel_jit_form(), INFO, ("moe",)))
    return rows


def _unwrapped(kernel):
    """The Python function under a jit kernel object: its `func` (nki-library's test utilities unwrap nki's kernel
    objects so) or `__wrapped__`; None where neither leads to one."""
    for _ in range(4):
        if inspect.isfunction(kernel):
            return kernel
        kernel = getattr(kernel, "func", None) or getattr(kernel, "__wrapped__", None)
    return None


def _decorators(function) -> str | None:
    """The decorators in `function`'s source, as written (e.g. `@nki.jit(mode='trace')`); None if unreadable."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return " ".join("@" + ast.unparse(d) for d in node.decorator_list) or None


def jit_form(kernel) -> str:
    """How `kernel` comes, in words: a plain function (wrapped with nki.jit at launch) or a jit kernel object,
    with the decorators its source declares."""
    if inspect.isfunction(kernel):
        return "plain function, wrapped with nki.jit at launch"
    function = _unwrapped(kernel)
    declared = _decorators(function) if function is not None else None
    return (f"jit kernel object ({type(kernel).__name__}), launched as it is; "
            + (f"declared {declared}" if declared else "declaration not readable"))


def kernel_jit_form() -> str:
    """The installed MoE kernels' forms (common/kernels/moe_nki.py launches either: `launchable`), one line, e.g. "blockwise_mm_baseline_shard_hidden: jit
    kernel object (...), launched as it is; declared @nki.jit(mode='trace'); blockwise_mm_bwd: ...". Imports
    nothing without torch-neuronx; an import that fails is named, not raised."""
    if importlib.util.find_spec("torch_neuronx") is None:
        return "not checked: torch-neuronx is not installed"
    forms = []
    for module, name in (("nkilib.experimental.moe.forward.bwmm_shard_on_H", "blockwise_mm_baseline_shard_hidden"),
                         ("nkilib.experimental.moe.bwd.blockwise_mm_backward", "blockwise_mm_bwd")):
        try:
            kernel = getattr(importlib.import_module(module), name)
        except Exception as e:  # an import error of any kind is the preflight's finding: named, not raised
            forms.append(f"{name}: not importable from {module} ({type(e).__name__}: {e})")
            continue
        forms.append(f"{name}: {jit_form(kernel)}")
    return "; ".join(forms)


def nkilib_source() -> str:
    """Which nkilib `import nkilib` gets, without importing it: its folder and the distribution that installed it
    (neuronx-cc's bundled copy, validated with that compiler; or a standalone nki-library build, which replaces it)."""
    spec = importlib.util.find_spec("nkilib")
    if spec is None:
        return "not installed"
    folder = Path(next(iter(spec.submodule_search_locations or []), spec.origin or "")).resolve()
    owners = []
    for dist in metadata.packages_distributions().get("nkilib", []):
        try:
            files = metadata.distribution(dist).files or []
            located = metadata.distribution(dist).locate_file("")
        except metadata.PackageNotFoundError:
            continue
        if any(f.parts[:1] == ("nkilib",) for f in files) and (Path(located) / "nkilib").resolve() == folder:
            owners.append(f"{dist} {metadata.version(dist)}")
    return f"{folder} ({', '.join(owners) or 'no installed distribution: a folder on the path'})"


def check(target: str, script: str | None = None, wrap_nki: bool = False) -> list[tuple[str, str, str]]:
    """(requirement, found, verdict) for every requirement of the `target` stack ("cpu" or "trn2"), or only for
    what `script` (a SCRIPTS key) uses; `wrap_nki`: its kernels launch through torch_neuronx.wrap_nki."""
    uses = set(SCRIPTS) if script is None else {script, *(["wrap_nki"] if wrap_nki else [])}
    return [(r, f, v) for r, f, v, users in check_all(target) if uses & set(users) or script is None]


def problems(rows) -> list[str]:
    """One phrase per missing piece; packages missing altogether are named once, first; the missing ModelSpec's
    explanation once, in the first phrase that has it."""
    errors = [(r, f) for r, f, v in rows if v == ERROR]
    absent = list(dict.fromkeys(f.removeprefix("not installed: ") for _, f in errors if f.startswith("not installed")))
    phrases = [f"{r}: {f}" for r, f in errors if not f.startswith("not installed")]
    gone = [i for i, phrase in enumerate(phrases) if phrase.endswith(f": {MODEL_SPEC_GONE}")]
    for i in gone[1:]:
        phrases[i] = phrases[i].removesuffix(f": {MODEL_SPEC_GONE}")
    return ([f"not installed: {', '.join(absent)}"] if absent else []) + phrases


def format_table(rows, used_by: list[str] | None = None) -> str:
    """The table as text; with `used_by`, a last column naming the scripts that need each row."""
    w1, w2 = min(max(len(r[0]) for r in rows), 72), min(max(len(r[1]) for r in rows), 38)
    if used_by is None:
        lines = [f"{'requirement':<{w1}}  {'found':<{w2}}  verdict", "-" * (w1 + w2 + 11)]
        return "\n".join(lines + [f"{r:<{w1}}  {f:<{w2}}  {v}" for r, f, v in rows])
    lines = [f"{'requirement':<{w1}}  {'found':<{w2}}  verdict  used by", "-" * (w1 + w2 + 28)]
    return "\n".join(lines + [f"{r:<{w1}}  {f:<{w2}}  {v:<7}  {u}" for (r, f, v), u in zip(rows, used_by)])


def wants_neuron(requested_device: str) -> bool:
    """Whether a script's --device resolves to Trainium (auto picks neuron where torch-neuronx is installed)."""
    return requested_device == "neuron" or (requested_device == "auto"
                                            and importlib.util.find_spec("torch_neuronx") is not None)


def require_stack(target: str, script: str, wrap_nki: bool = False) -> list[tuple[str, str, str]]:
    """The check a script (a SCRIPTS key) runs before its process group starts, of what that script uses: a
    UserError naming every missing piece, else one `[preflight]` line (warnings named). Returns the table's rows."""
    rows = check(target, script, wrap_nki)
    missing = problems(rows)
    if missing:
        raise UserError(f"the {target} stack is not usable: {'; '.join(missing)} "
                        f"(python -m common.harness.preflight --target {target} prints the table)")
    warns = [f"{r} found {f}" for r, f, v in rows if v == WARN]
    print(f"[preflight] {target} stack: {len(rows)} checks passed" + (f"; warnings: {'; '.join(warns)}" if warns
                                                                      else ""), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=("cpu", "trn2"),
                        default="trn2" if importlib.util.find_spec("torch_neuronx") else "cpu",
                        help="stack to check (default: trn2 where torch-neuronx is installed, else cpu)")
    target = parser.parse_args(argv).target
    full = check_all(target)
    rows = [(r, f, v) for r, f, v, _ in full]
    used_by = [" ".join(SCRIPTS[u] if u in SCRIPTS else "(NKI_LAUNCH wrap_nki)" for u in users)
               if set(users) != set(SCRIPTS) else "all" for *_, users in full]
    print(format_table(rows, used_by), flush=True)
    if target == "trn2":  # AWS's own configs of the presets' layouts, field by field (tools/, in the repository)
        tool = Path(__file__).resolve().parents[2] / "tools" / "aws_config_diff.py"
        if importlib.util.find_spec("torchtitan_neuron") and tool.is_file():
            subprocess.run([sys.executable, "-m", "tools.aws_config_diff"], cwd=tool.parents[1], check=False)
        else:
            print("[preflight] AWS's own configs of these layouts beside the presets, field by field: "
                  "python -m tools.aws_config_diff", flush=True)
    missing = problems(rows)
    if missing:
        print(f"error: the {target} stack is not usable: {'; '.join(missing)}", file=sys.stderr, flush=True)
        return 2
    warned = sum(v == WARN for _, _, v in rows)
    label = f"trn2 (Neuron {trn2_stack()[0]})" if target == "trn2" else target
    print(f"[preflight] {label} stack: all {len(rows)} checks passed ({warned} version warnings)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
