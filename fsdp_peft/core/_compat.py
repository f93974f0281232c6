"""Every place fsdp-peft patches, overrides or reads a private part of another library, in one module.

Each patch is one function here whose docstring says what it replaces, why, where upstream stands, and
when to remove it. Private parts that other modules only read or override (Trainer's private methods,
FSDP2 unit state) are listed in `UPSTREAM` with what the code relies on. `check_upstream` runs when a recipe
or an ``fsdp-peft`` command starts: a library outside the versions this was verified with, or a symbol
that moved or changed its signature, stops the run with one line, before any work; never a patch that
silently stops applying. ``FSDP_PEFT_UNVERIFIED=1`` lifts the version gate (symbols are still checked), for
trying newer releases as ``.ci/run`` does.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from packaging.version import Version
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

from fsdp_peft.core.errors import ConfigError

VERIFIED = {  # package: (lowest verified, first unverified) release
    "torch": ("2.13.0", "2.14"),
    "transformers": ("5.24.0", "5.25"),
    "accelerate": ("1.15.0", "1.16"),
    "peft": ("0.21.2", "0.22"),
    "bitsandbytes": ("0.50.2", "0.51"),
}
VERIFIED_WITH_TORCH_XLA = {  # the TPU route's own environment (docs/tpu.md): torch-xla pins its torch
    "torch": ("2.9.0", "2.10"),
    "torch_xla": ("2.9.0", "2.10"),
}
UNVERIFIED_VARIABLE = "FSDP_PEFT_UNVERIFIED"
FSDP2_ACCUMULATED_GRAD = "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.to_accumulated_grad_if_needed"


def verified_releases() -> dict[str, tuple[str, str]]:
    """The releases this environment must hold: the TPU route's torch where torch_xla is installed, and trl's
    window in a process that has imported it."""
    releases = {**VERIFIED, **(TRL_VERIFIED if "trl" in sys.modules else {})}
    if importlib.util.find_spec("torch_xla") is None:
        return releases
    return {**releases, **VERIFIED_WITH_TORCH_XLA}


class CompatError(ConfigError):
    """An upstream library is not what fsdp-peft was verified with: one line naming it and the fix."""


@dataclass(frozen=True)
class Upstream:
    """One private (or patched) upstream symbol and what fsdp-peft relies on."""

    path: str  # "module:attribute.attribute"
    relies_on: tuple[str, ...] = ()  # parameter names of the callable
    used_by: str = ""
    why: str = ""
    remove_when: str = ""
    mentions: tuple[str, ...] = ()  # names its source must still use (an attribute it reads, a **kwargs key)

    @property
    def package(self) -> str:
        return self.path.split(".", 1)[0].split(":", 1)[0]


UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "bitsandbytes.backends.default.ops:_try_torch_compile",
        ("func",),
        "fsdp_peft.core._compat.bitsandbytes_compiling_module_spec",
        "bitsandbytes builds its torch.compile wrappers at import: dynamo and inductor load in every process",
        "bitsandbytes compiles lazily, on the first call",
        mentions=("torch.compile",),
    ),
    Upstream(
        "bitsandbytes.functional:dequantize_4bit",
        ("A", "quant_state"),
        "fsdp_peft.core._compat.cpu_4bit_dequantization_block_aligned",
        "bitsandbytes' CPU 4-bit dequantization misplaces block scales for some shapes; the op is replaced on CPU",
        "bitsandbytes' CPU kernel indexes block scales by flat position",
        mentions=("torch.ops.bitsandbytes.dequantize_4bit",),
    ),
    Upstream(
        "transformers.trainer:update_fsdp_plugin_peft",
        ("model", "accelerator"),
        "fsdp_peft.core._compat.trainer_peft_update_skipped",
        "Trainer's FSDP1-only PEFT update would overwrite fsdp-peft's policies",
        "transformers calls it under FSDP2 too with the same policies",
    ),
    Upstream(
        "transformers.trainer:load_fsdp_optimizer",
        ("fsdp_plugin", "accelerator", "optimizer", "model", "input_dir"),
        "fsdp_peft.core._compat.fsdp1_adapter_checkpoints",
        "FSDP1 sharded optimizer state is loaded into an empty template before the first step",
        "accelerate loads FSDP1 optimizer state from the checkpoint's own metadata",
    ),
    Upstream(
        "accelerate.utils.fsdp_utils:_get_model_state_dict",
        ("model", "adapter_only", "sd_options"),
        "fsdp_peft.core._compat.fsdp1_adapter_checkpoints",
        "FSDP1 renames modules, so peft finds no adapter tensors to checkpoint",
        "accelerate selects FSDP1 adapter tensors by unwrapped names",
    ),
    Upstream(
        "accelerate.utils.fsdp_utils:_set_model_state_dict",
        ("model", "state_dict", "adapter_only", "sd_options"),
        "fsdp_peft.core._compat.fsdp1_adapter_checkpoints",
        "the loading side of the same FSDP1 adapter checkpoints",
        "accelerate selects FSDP1 adapter tensors by unwrapped names",
    ),
    Upstream(
        "peft.peft_model:PeftModel.__init__",
        used_by="fsdp_peft.core._compat.peft_wrapped",
        why="peft reads transformers' deprecated is_gradient_checkpointing (a FutureWarning on every run)",
        remove_when="peft reads is_activation_checkpointing",
        mentions=("is_gradient_checkpointing",),
    ),
    Upstream(
        "accelerate.accelerator:fsdp2_prepare_model",
        ("accelerator", "model"),
        "fsdp_peft.core._compat.fsdp2_prepare_model_replaced (low-memory loading)",
        "weights stream into a skeleton model only after FSDP2 has sharded it",
        "accelerate's cpu_ram_efficient_loading supports bitsandbytes 4-bit (accelerate PR #3987)",
    ),
    Upstream(
        "accelerate.utils.fsdp_utils:fsdp2_prepare_model",
        ("accelerator", "model"),
        "fsdp_peft.core._compat.originals_released_while_sharding",
        "its state dict of the unsharded model, read only by low-memory loading, holds every weight while FSDP2 shards",
        "accelerate takes that state dict in its low-memory branch only",
        mentions=(
            "original_sd = model.state_dict()",
            "if fsdp2_plugin.cpu_ram_efficient_loading and not model_has_params4bit",
        ),
    ),
    Upstream(
        "peft.tuners.tuners_utils:BaseTunerLayer._move_adapter_to_device_of_base_layer",
        ("self", "adapter_name", "device"),
        "fsdp_peft.core._compat.adapters_created_off_meta",
        "peft moves new adapters to a meta base layer's device, losing their initial values",
        "peft keeps adapters of meta base layers materialised",
    ),
    Upstream(
        "peft.tuners.lora.model:LoraModel._replace_module",
        ("self", "parent", "child_name", "new_module", "child"),
        "fsdp_peft.core._compat.adapters_created_off_meta",
        "the same move, done again when the LoRA layer replaces the base module",
        "peft keeps adapters of meta base layers materialised",
    ),
    Upstream(
        "peft.tuners.lora.layer:Linear.__init__",
        ("base_layer", "adapter_name", "config", "r", "lora_alpha"),
        "fsdp_peft.model.residual (PiSSA/OLoRA on a 4-bit base)",
        "peft's own pissa_init/olora_init run on one checkpoint tensor at a time, inside a lone LoRA layer",
        "peft offers PiSSA/OLoRA initialisation of a single weight as a function",
        mentions=("update_layer",),
    ),
    Upstream(
        "peft.utils.loftq_utils:_low_rank_decomposition",
        ("weight", "reduced_rank"),
        "fsdp_peft.model.residual (LoftQ on a 4-bit base)",
        "LoftQ's SVD split of the quantization error, run with the run's own 4-bit settings on any device",
        "peft's LoftQ runs off CUDA with the caller's quantization settings",
        mentions=('"L"', '"R"'),
    ),
    Upstream(
        "peft.tuners.lora.dora:DoraLinearLayer.get_lora_weight",
        ("self", "lora_A", "lora_B", "adapter_name"),
        "fsdp_peft.core._compat.dora_lora_weight_without_graph",
        "DoRA's weight norm calls the FSDP1 LoRA units a second time with autograd on; FSDP1 + mixed precision "
        "then leaves their gradients unreduced",
        "peft computes DoRA's (detached) LoRA weight without autograd",
        mentions=("x_eye",),
    ),
    Upstream(
        "peft.tuners.lora.dora:DoraLinearLayer.forward",
        ("self", "x", "lora_A", "lora_B", "scaling", "base_layer"),
        "fsdp_peft.core._compat.dora_lora_weight_without_graph",
        "the LoRA weight is used only detached (for the norm), so computing it without autograd changes no value",
        "peft computes DoRA's (detached) LoRA weight without autograd",
        mentions=("lora_weight=lora_weight.detach()",),
    ),
    Upstream(
        "peft.tuners.trainable_tokens.layer:TrainableTokensLayer.forward_adapters",
        ("self", "x", "active_adapters"),
        "fsdp_peft.core._compat.trainable_tokens_through_the_base_layer",
        "trainable tokens read the frozen embedding's weight without calling it, so its FSDP1 unit never gathers",
        "peft's trainable tokens call the base embedding (or FSDP1 gathers modules whose tensors are read)",
        mentions=("get_merged_weights", "F.embedding"),
    ),
    Upstream(
        "bitsandbytes.nn:Linear4bit.forward",
        ("self", "x"),
        "fsdp_peft.core._compat.cpu_weight_repacking_disabled",
        "on CPU, eval-mode forwards repack the weight in place, corrupting FSDP's shared unsharded copy",
        "bitsandbytes repacks into a copy (bitsandbytes #1945)",
        mentions=("support_avx512bf16_for_cpu",),
    ),
    Upstream(
        "accelerate.state:PartialState._shared_state",
        (),
        "fsdp_peft.core._compat.state_switched_to_fsdp (CPU mode)",
        "accelerate builds FSDP state only on accelerators; the CPU mode switches MULTI_CPU to FSDP",
        "accelerate supports FSDP on CPU (gloo)",
    ),
    Upstream(
        "accelerate.parallelism_config:ParallelismConfig._validate_accelerator",
        ("self", "accelerator"),
        "fsdp_peft.parallel.cpu_fsdp.apply_parallelism_config_on_cpu",
        "HSDP on CPU: the mesh accelerate refuses to build on a MULTI_CPU state",
        "accelerate supports FSDP on CPU (gloo)",
    ),
    Upstream(
        "accelerate.commands.launch:_validate_launch_command",
        ("args",),
        "fsdp_peft.tools.cli.launcher_environment",
        "`fsdp-peft validate/plan --accelerate-config` derive each rank's environment as the launcher would",
        "accelerate exposes the launch environment publicly",
    ),
    Upstream(
        "transformers.trainer:Trainer._prepare_context_parallel_inputs",
        ("self", "model", "inputs"),
        "fsdp_peft.procedures.trainer.PeftFsdpTrainer (fsdp_peft.parallel.sequence_parallel.split_for_training)",
        "sequence parallelism splits each row for Ulysses where Trainer prepares its ring-attention buffers",
        "transformers offers a Ulysses split for FSDP2 (accelerate #4209 adds one)",
    ),
    Upstream(
        "transformers.trainer:Trainer._track_num_input_tokens",
        ("self", "inputs"),
        "fsdp_peft.procedures.trainer.PeftFsdpTrainer (fsdp_peft.parallel.sequence_parallel.tokens_counted_once)",
        "the count sums every rank's rows; a sequence group's ranks hold the same rows",
        "transformers counts a context-parallel group's rows once",
    ),
    Upstream(
        "accelerate.accelerator:Accelerator._prepare_cp",
        ("self",),
        "fsdp_peft.core._compat.context_parallel_hooks_skipped",
        "accelerate's ring-attention hooks drop every attention mask, generation's too",
        "accelerate attaches its hooks only inside its context-parallel context",
        mentions=("_attach_context_parallel_hooks",),
    ),
    Upstream(
        "transformers.trainer:Trainer._prepare_for_training",
        ("self", "max_steps", "train_dataloader", "resume_from_checkpoint"),
        "fsdp_peft.procedures.trainer.PeftFsdpTrainer; fsdp_peft.core._compat.xla_fsdp_optimizer_created",
        "FSDP policies for PEFT are set between Accelerator creation and wrapping; XLA FSDP delays optimizer creation"
        " and prepares only the optimizer when the model came back wrapped",
        "transformers applies PEFT-aware FSDP2 policies itself and creates the delayed optimizer after XLA FSDP"
        " wrapping again (transformers 5.2 did)",
        mentions=("is_fsdp_xla_enabled", "delay_optimizer_creation", "use_accelerator_prepare"),
    ),
    Upstream(
        "transformers.trainer:Trainer._save_checkpoint",
        ("self", "model", "trial"),
        "fsdp_peft.procedures.trainer.PeftFsdpTrainer",
        "checkpoints are staged and appear only when complete",
        "transformers writes checkpoints atomically",
    ),
    Upstream(
        "transformers.trainer:Trainer._get_output_dir",
        ("self", "trial"),
        "fsdp_peft.procedures.trainer.PeftFsdpTrainer._save_checkpoint",
        "checkpoints are written into a staging directory first",
        "transformers writes checkpoints atomically",
    ),
    Upstream(
        "transformers.trainer:Trainer._move_model_to_device",
        ("self", "model", "device"),
        "fsdp_peft.procedures.trainer.PeftFsdpTrainer",
        "a low-memory skeleton must not be moved before FSDP shards it",
        "accelerate's cpu_ram_efficient_loading supports bitsandbytes 4-bit",
    ),
    Upstream(
        "transformers.trainer:Trainer._run_epoch",
        ("self", "model", "epoch", "train_dataloader", "steps_in_epoch"),
        "fsdp_peft.procedures.trainer.PeftFsdpTrainer",
        "a run resumed at max_steps would train one more step",
        "Trainer checks max_steps before the first step of a resumed epoch",
    ),
    Upstream(
        "torch.distributed.fsdp:FSDPModule._get_fsdp_state",
        ("self",),
        "fsdp_peft.tools.generation (gather budget)",
        "generation keeps FSDP2 units gathered for a whole generate call",
        "FSDP2 exposes per-unit gathered size and reshard settings",
    ),
    Upstream(
        "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState._lazy_init",
        ("self",),
        "fsdp_peft.tools.generation (gather budget)",
        "the per-group reshard settings generation saves and restores",
        "FSDP2 exposes per-unit gathered size and reshard settings",
        mentions=("_fsdp_param_group", "_auto_reshard_after_forward"),  # torch 2.13: _fsdp_param_groups
    ),
    Upstream(
        "transformers.trainer:Trainer._load_from_checkpoint",
        ("self", "resume_from_checkpoint", "model"),
        "fsdp_peft.procedures.trainer.PeftFsdpTrainer (fsdp_peft.core.xla.load_spmd_checkpoint)",
        "an XLA FSDP v2 checkpoint holds wrapped names, which Trainer loads non-strictly into the unwrapped model",
        "Trainer saves or loads XLA FSDP v2 checkpoints by the unwrapped names",
    ),
    Upstream(
        "transformers.trainer:Trainer._wrap_model",
        ("self", "model", "training", "dataloader"),
        "fsdp_peft.core._compat.xla_fsdp_optimizer_created",
        "under XLA FSDP the optimizer is created for the model _wrap_model returns",
        "Trainer creates the delayed optimizer after XLA FSDP wrapping again (transformers 5.2 did)",
    ),
    Upstream(
        "torch.distributed.device_mesh:DeviceMesh.__init__",
        ("self", "device_type", "mesh"),
        "fsdp_peft.core._compat.process_groups_released",
        "every DeviceMesh holds its process groups in _pg_registry, past destroy_process_group",
        "destroy_process_group releases the device meshes' groups (their native threads joined)",
        mentions=("_pg_registry",),
    ),
    Upstream(
        "transformers.quantizers.base:HfQuantizer.__init__",
        ("self", "quantization_config"),
        "fsdp_peft.model.loading.model_skeleton",
        "a skeleton gets transformers' own 4-bit module replacement, as for a 16-bit checkpoint",
        "transformers builds quantized skeletons on meta",
        mentions=("pre_quantized",),
    ),
    Upstream(
        "transformers.quantizers.base:HfQuantizer.preprocess_model",
        ("model", "dtype"),
        "fsdp_peft.model.loading.model_skeleton",
        "the module replacement itself (Linear -> Linear4bit) on the meta skeleton",
        "transformers builds quantized skeletons on meta",
    ),
    Upstream(
        FSDP2_ACCUMULATED_GRAD,
        ("self",),
        "fsdp_peft.core._compat.fsdp2_accumulation_skips_ungathered_parameters",
        "without gradient sync, FSDP2 converts the unsharded gradient of every parameter, gathered or not",
        "torch skips parameters that were never unsharded there",
        mentions=("_unsharded_param", "reduce_dtype"),
    ),
    # TRL's, checked in the processes that import trl (the preference and GRPO recipes)
    Upstream(
        "trl.trainer.grpo_trainer:GRPOTrainer._generate_single_turn",
        ("self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
        "fsdp_peft.procedures.rl.RolloutTrainer._generate_single_turn",
        "TRL's sampling is run unchanged, inside one FSDP2 gather of every unit",
        "TRL generates from FSDP2 models with their units gathered once per call",
        mentions=("unwrap_model_for_generation", "generation_config"),
    ),
    Upstream(
        "trl.trainer.grpo_trainer:GRPOTrainer._tokenize_prompts",
        ("self", "prompts"),
        "fsdp_peft.procedures.rl.RolloutTrainer._tokenize_prompts",
        "prompts the recipe has rendered are tokenized without added special tokens; the result is TRL's triple",
        "TRL tokenizes rendered string prompts without adding special tokens",
        mentions=("multimodal_fields",),
    ),
    Upstream(
        "trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions",
        ("self", "inputs"),
        "fsdp_peft.procedures.rl.RolloutTrainer._generate_and_score_completions",
        "TRL's rollouts run inside fsdp_peft.core._compat.trl_without_the_checkpointing_warning",
        "TRL reads is_activation_checkpointing",
        mentions=("disable_gradient_checkpointing",),
    ),
    Upstream(
        "trl.models.utils:disable_gradient_checkpointing",
        ("model", "gradient_checkpointing_kwargs"),
        "fsdp_peft.core._compat.trl_without_the_checkpointing_warning",
        "TRL reads transformers' deprecated is_gradient_checkpointing around reference forwards and rollouts",
        "TRL reads is_activation_checkpointing",
        mentions=("is_gradient_checkpointing",),
    ),
    Upstream(
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VLForConditionalGeneration.forward",
        ("self", "input_ids", "labels"),
        "fsdp_peft.core._compat.loss_counts_every_ranks_tokens",
        "Qwen2.5-VL says accepts_loss_kwargs = False, yet its forward hands **kwargs on to its loss function",
        "Qwen2.5-VL's class no longer sets accepts_loss_kwargs = False",
        mentions=("self.loss_function(", "**kwargs"),
    ),
    Upstream(
        "transformers.conversion_mapping:get_model_conversion_mapping",
        ("model",),
        "fsdp_peft.model.vision.names_as_loaded",
        "the renamings transformers applies to a checkpoint's keys while loading (the hub's older VLM layouts)",
        "export reads checkpoints through transformers' own loader",
    ),
    Upstream(
        "transformers.core_model_loading:rename_source_key",
        ("source_key", "weight_renamings", "weight_converters", "base_model_prefix", "meta_state_dict"),
        "fsdp_peft.model.vision.names_as_loaded",
        "one stored key renamed as transformers' loader renames it",
        "export reads checkpoints through transformers' own loader",
    ),
)
TRL_VERIFIED = {"trl": ("1.16.0", "1.17")}  # checked where trl is imported: its recipes, not SFT or the CLI


@dataclass(frozen=True)
class Patch:
    """One patch function of this module, the upstream release window it was verified in, and (where a look at
    upstream's code can tell) whether upstream still needs it."""

    function: Callable
    package: str
    verified: tuple[str, str] | None = None  # (lowest verified, first unverified) release; None: the package's own
    still_needed: Callable[[], bool] | None = None  # else a test of the patch's own shows upstream's behaviour

    @property
    def window(self) -> tuple[str, str]:
        """The releases the patch was verified with: those fsdp-peft was verified with, unless the patch says."""
        return self.verified or {**VERIFIED, **TRL_VERIFIED}[self.package]

    def window_problem(self) -> str | None:
        return _window_problem(self.package, self.window, f"fsdp_peft.core._compat.{self.function.__name__}")


PATCHES: list[Patch] = []


def patch(package: str, still_needed: Callable[[], bool] | None = None, verified: tuple[str, str] | None = None):
    """Register the decorated function in `PATCHES`: a patch of ``package``, verified with the releases `VERIFIED`
    names for it (or ``verified``, a window of its own)."""

    def register(function):
        PATCHES.append(Patch(function, package, verified, still_needed))
        return function

    return register


def _source_of(path: str) -> str:
    return _source(_resolve(path))


def _resolve(path: str):
    module_name, _, attributes = path.partition(":")
    value = importlib.import_module(module_name)
    for attribute in attributes.split("."):
        value = getattr(value, attribute)
    return value


def upstream_problem(entry: Upstream) -> str | None:
    """Why ``entry`` no longer holds (gone, or not what fsdp-peft relies on), else ``None``."""
    version = importlib.metadata.version(entry.package)
    where = f"{entry.package} {version}: {entry.path.replace(':', '.')}"
    try:
        value = _resolve(entry.path)
    except (ImportError, AttributeError):
        return f"{where} is gone; fsdp-peft relies on it ({entry.why})"
    missing = []
    if entry.relies_on:
        try:
            parameters = inspect.signature(value).parameters
        except (TypeError, ValueError):
            parameters = {}
        missing += [name for name in entry.relies_on if name not in parameters]
    if entry.mentions:
        source = _source(value)
        missing += [name for name in entry.mentions if name not in source]
    if missing:
        return f"{where} no longer has {', '.join(missing)}; fsdp-peft relies on it ({entry.why})"
    return None


def _source(value) -> str:
    try:
        return inspect.getsource(value)
    except (OSError, TypeError):
        return ""


def version_problem(package: str) -> str | None:
    return _window_problem(package, {**TRL_VERIFIED, **verified_releases()}[package], "fsdp-peft")


def _window_problem(package: str, window: tuple[str, str], verified_by: str) -> str | None:
    """One line when the installed ``package`` lies outside ``window`` (lowest verified, first unverified release),
    which ``verified_by`` (fsdp-peft, or one of its patches) was verified in; else ``None``."""
    lowest, unverified = window
    installed = importlib.metadata.version(package)
    release = Version(Version(installed).base_version)
    if Version(lowest) <= release < Version(unverified):
        return None
    return (
        f"{package} {installed} is outside the versions {verified_by} was verified with ({lowest} to below "
        f"{unverified}); install a verified one (pip install -e .), or set {UNVERIFIED_VARIABLE}=1 to try it"
    )


@functools.cache
def _checked() -> bool:
    xla_environment = "torch_xla" in verified_releases()  # its torch is torch-xla's; it never runs torch FSDP
    checked = [e for e in UPSTREAM if e.package in sys.modules or e.package != "trl"]  # trl: where imported
    problems = [upstream_problem(e) for e in checked if not (xla_environment and e.package == "torch")]
    if os.environ.get(UNVERIFIED_VARIABLE) != "1":  # lifts the release windows; the symbols are still checked
        problems = [version_problem(p) for p in verified_releases()] + problems
        patches = [p for p in PATCHES if p.package != "trl" or "trl" in sys.modules]  # trl's: where it is imported
        problems += [p.window_problem() for p in patches if not (xla_environment and p.package == "torch")]
    problems = [problem for problem in problems if problem]
    if problems:
        raise CompatError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return True


def fsdp_param_groups(state) -> list:
    """An FSDP2 unit's parameter groups: torch 2.13 keeps a list (``_fsdp_param_groups``), torch 2.11 (what the GPU
    images this was checked on ship) one group or None (``_fsdp_param_group``)."""
    if hasattr(state, "_fsdp_param_groups"):
        return state._fsdp_param_groups
    return [group] if (group := state._fsdp_param_group) is not None else []


def check_upstream() -> None:
    """Stop with one line when an upstream library is not what fsdp-peft's patches were verified with."""
    _checked()


@patch(
    "transformers",
    still_needed=lambda: "update_fsdp_plugin_peft(" in _source_of("transformers.trainer:Trainer._prepare_for_training"),
)
@contextlib.contextmanager
def trainer_peft_update_skipped():
    """Replaces ``transformers.trainer.update_fsdp_plugin_peft`` with a no-op while Trainer prepares the model.

    Why: Trainer calls it on the FSDP1 path only, after fsdp-peft set the PEFT-aware policies
    (`fsdp_peft.parallel.fsdp_policies.configure_fsdp_for_peft`), and would replace them with peft's lambda policy.
    Upstream: transformers 5.24 calls it only when ``delay_optimizer_creation`` (FSDP1).
    Remove when: transformers applies the same PEFT-aware policies under both FSDP versions.
    """
    import transformers.trainer  # lazy: patch target, resolved when patched

    original = transformers.trainer.update_fsdp_plugin_peft
    transformers.trainer.update_fsdp_plugin_peft = lambda model, accelerator: None
    try:
        yield
    finally:
        transformers.trainer.update_fsdp_plugin_peft = original


@patch("accelerate")
@contextlib.contextmanager
def context_parallel_hooks_skipped(accelerator):
    """Replaces ``Accelerator._prepare_cp`` of ``accelerator`` with a pass-through while the model is prepared.

    Why: sequence parallelism (`fsdp_peft.parallel.sequence_parallel`) takes accelerate's context-parallel mesh, data
    split and loss scaling, but not its ring attention; accelerate 1.15's ``_prepare_cp`` hooks every
    ``self_attn`` to drop its attention mask for good, which would make left-padded generation and evaluation
    attend to padding. Ulysses splits and masks inside its own attention, only while a split is active.
    Remove when: accelerate attaches those hooks only inside its context-parallel context.
    """
    accelerator._prepare_cp = lambda *args: args
    try:
        yield
    finally:
        del accelerator._prepare_cp


def _vision_models_refusing_loss_kwargs() -> bool:
    from transformers import Qwen2_5_VLForConditionalGeneration  # lazy: only vision runs need it

    return Qwen2_5_VLForConditionalGeneration.accepts_loss_kwargs is False


@patch("transformers", still_needed=_vision_models_refusing_loss_kwargs)
def loss_counts_every_ranks_tokens(trainer, vision: bool) -> None:
    """Sets ``trainer.model_accepts_loss_kwargs`` when ``vision`` (the model is a vision-language model of a known
    family) and its class says it takes no loss kwargs.

    Why: transformers 5.24's Qwen2.5-VL sets ``accepts_loss_kwargs = False`` although its forward hands ``**kwargs``
    on to ``self.loss_function``; Trainer then passes no ``num_items_in_batch``, each rank divides by its own
    labelled tokens, and 2 ranks whose rows differ in answer length train other gradients than one process on the
    same rows when the rows' answer lengths differ (docs/compat.md#the-measurements).
    Remove when: the class no longer sets the attribute to False.
    """
    model = trainer.accelerator.unwrap_model(trainer.model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if vision and getattr(type(base), "accepts_loss_kwargs", True) is False:
        trainer.model_accepts_loss_kwargs = True


@patch("accelerate")
@contextlib.contextmanager
def fsdp1_adapter_checkpoints(trainable_names: list[str], adapter: str):
    """Replaces accelerate's FSDP model-state selection and transformers' FSDP optimizer loading, for FSDP1
    sharded checkpoints (``SHARDED_STATE_DICT``) of a PEFT model, so they hold and restore the adapter and its
    optimizer state.

    Why, two gaps in accelerate 1.15's FSDP1 path:
    - accelerate selects a PEFT model's checkpoint tensors through peft, which finds adapter tensors by module
      names; FSDP1's wrappers change those names, so none were found and none saved. Here they are selected by
      their unwrapped names and stored under peft's keys (adapter name dropped), the keys FSDP2 checkpoints have.
    - accelerate loads FSDP1 optimizer state into a template made from the optimizer's current state, which is
      empty before the first step, so nothing was restored and Adam restarted from zero
      (docs/compat.md#the-measurements). Here the template comes from the checkpoint's own metadata.
    Remove when: accelerate selects FSDP1 adapter tensors by unwrapped names and loads optimizer state from
    the checkpoint's metadata.
    """
    import accelerate.utils.fsdp_utils as fsdp_utils  # lazy: patch target, resolved when patched
    import transformers.trainer  # lazy: patch target, resolved when patched

    # the adapter name dropped, inside a name or at its end (``trainable_tokens_delta.default``)
    by_key = {re.sub(rf"\.{re.escape(adapter)}(?=\.|$)", "", name): name for name in trainable_names}
    original_get, original_set = fsdp_utils._get_model_state_dict, fsdp_utils._set_model_state_dict
    original_load_optimizer = transformers.trainer.load_fsdp_optimizer

    def fsdp1_sharded(model, adapter_only: bool, sd_options) -> bool:
        if not adapter_only or sd_options is not None or not isinstance(model, FSDP):  # options mean FSDP2
            return False
        return FSDP.get_state_dict_type(model).state_dict_type == StateDictType.SHARDED_STATE_DICT

    def get_model_state_dict(model, adapter_only=False, sd_options=None):
        if not fsdp1_sharded(model, adapter_only, sd_options):
            return original_get(model, adapter_only=adapter_only, sd_options=sd_options)
        state = model.state_dict()
        return {key: state[name] for key, name in by_key.items() if name in state}

    def set_model_state_dict(model, state_dict, adapter_only=False, sd_options=None):
        if not fsdp1_sharded(model, adapter_only, sd_options):
            return original_set(model, state_dict, adapter_only=adapter_only, sd_options=sd_options)
        missing = sorted(set(by_key) - set(state_dict))
        if missing:
            raise ConfigError(
                f"checkpoint lacks {len(missing)} adapter tensors (e.g. {missing[0]}); it cannot be resumed"
            )
        return model.load_state_dict({by_key[key]: value for key, value in state_dict.items()}, strict=False)

    def load_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, input_dir, **kwargs):
        if fsdp_plugin.fsdp_version != 1 or fsdp_plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT:
            return original_load_optimizer(fsdp_plugin, accelerator, optimizer, model, input_dir, **kwargs)
        accelerator.wait_for_everyone()
        configs = (fsdp_plugin.state_dict_config, fsdp_plugin.optim_state_dict_config)
        with FSDP.state_dict_type(model, fsdp_plugin.state_dict_type, *configs):
            reader = dcp.FileSystemReader(str(Path(input_dir) / f"{fsdp_utils.OPTIMIZER_NAME}_0"))
            state = load_sharded_optimizer_state_dict(model.state_dict(), "optimizer", reader)["optimizer"]
            optimizer.load_state_dict(
                FSDP.optim_state_dict_to_load(model=model, optim=optimizer, optim_state_dict=state)
            )
        accelerator.wait_for_everyone()

    fsdp_utils._get_model_state_dict, fsdp_utils._set_model_state_dict = get_model_state_dict, set_model_state_dict
    transformers.trainer.load_fsdp_optimizer = load_fsdp_optimizer
    try:
        yield
    finally:
        fsdp_utils._get_model_state_dict, fsdp_utils._set_model_state_dict = original_get, original_set
        transformers.trainer.load_fsdp_optimizer = original_load_optimizer


@patch("peft")
@contextlib.contextmanager
def adapters_created_off_meta():
    """Replaces peft's ``BaseTunerLayer._move_adapter_to_device_of_base_layer`` and ``LoraModel._replace_module``
    while adapters are attached to a low-memory skeleton (meta base weights), so LoRA weights stay on the CPU.

    Why: peft moves new adapter weights to the base layer's device, for a skeleton the meta device, which drops
    their initial values. Creation, initialisation and dtype casts are unchanged, so they draw the same random
    numbers and give the same values as on a loaded model; only the final moves to meta are undone. Trainable
    tokens copy their rows out of the (meta) base weight: they become empty CPU tensors, filled by the loader.
    Only entered for skeleton models (`fsdp_peft.model.modeling.attach_lora`); a loaded model never sees it.
    Remove when: peft keeps the adapters of meta base layers materialised.
    """
    from peft.tuners.lora.model import LoraModel  # lazy: patch target, resolved when patched
    from peft.tuners.tuners_utils import BaseTunerLayer  # lazy: patch target, resolved when patched

    original_move = BaseTunerLayer._move_adapter_to_device_of_base_layer
    original_replace = LoraModel._replace_module

    def move(self, adapter_name, device=None):
        base_device, _ = self._get_base_layer_device_and_dtype(self.get_base_layer())
        if device is None and base_device is not None and base_device.type == "meta":
            device = torch.device("cpu")
            _adapter_tensors_off_meta(self, adapter_name)
        return original_move(self, adapter_name, device=device)

    def replace(self, parent, child_name, new_module, child):
        kept = [(m, n, p) for m in new_module.modules() for n, p in m.named_parameters(recurse=False) if not p.is_meta]
        original_replace(self, parent, child_name, new_module, child)
        for module, name, parameter in kept:
            if getattr(module, name).is_meta:
                module._parameters[name] = parameter

    BaseTunerLayer._move_adapter_to_device_of_base_layer = move
    LoraModel._replace_module = replace
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = original_move
        LoraModel._replace_module = original_replace


def _adapter_tensors_off_meta(layer, adapter_name: str) -> None:
    """Adapter tensors peft copied out of meta base weights (trainable tokens: the base rows) become empty CPU
    tensors of their shape; the low-memory loader fills them (`fsdp_peft.model.loading.load_sharded_weights`)."""
    for attribute in (*layer.adapter_layer_names, *layer.other_param_names):
        container = getattr(layer, attribute, None)
        if not isinstance(container, torch.nn.Module) or adapter_name not in container:
            continue
        value = container[adapter_name]
        if isinstance(value, torch.Tensor) and value.is_meta:
            empty = torch.empty_like(value, device="cpu")
            trainable = isinstance(value, torch.nn.Parameter)
            container[adapter_name] = torch.nn.Parameter(empty, value.requires_grad) if trainable else empty


@patch("accelerate")
@contextlib.contextmanager
def fsdp2_prepare_model_replaced(replacement: Callable[[Callable], Callable]):
    """Replaces ``accelerate.accelerator.fsdp2_prepare_model`` by ``replacement(original)`` meanwhile.

    Why: low-memory loading (`fsdp_peft.model.loading.weights_loaded_after_sharding`) streams the weights into a
    skeleton right after FSDP2 sharded it, inside `Accelerator.prepare`; accelerate's own
    ``cpu_ram_efficient_loading`` skips models holding bitsandbytes ``Params4bit`` (every rank then holds a
    full 4-bit copy while loading).
    Remove when: accelerate's low-memory loading handles bitsandbytes 4-bit (accelerate PR #3987).
    """
    import accelerate.accelerator as accelerate_module  # lazy: patch target, resolved when patched

    original = accelerate_module.fsdp2_prepare_model
    accelerate_module.fsdp2_prepare_model = replacement(original)
    try:
        yield
    finally:
        accelerate_module.fsdp2_prepare_model = original


@patch("accelerate")
@contextlib.contextmanager
def originals_released_while_sharding():
    """Meanwhile accelerate's FSDP2 preparation frees each unit's unsharded weights as ``fully_shard`` replaces them.

    Why: accelerate takes ``model.state_dict()`` before sharding and holds it until it returns, though only its
    low-memory branch (``cpu_ram_efficient_loading`` without 4-bit weights) reads it: every unsharded weight stays
    allocated beside the new shards, so each rank peaks at its whole model plus its shards
    (docs/compat.md#the-measurements). The state dict is empty here unless that branch will read it.
    Remove when: accelerate takes the state dict in its low-memory branch only.
    """

    def releasing(original):
        def prepare(accelerator, model):
            plugin = accelerator.state.fsdp_plugin
            four_bit = any(type(p).__name__ == "Params4bit" for p in model.parameters())
            if plugin.cpu_ram_efficient_loading and not four_bit:  # accelerate's low-memory branch reads it
                return original(accelerator, model)
            model.state_dict = lambda *args, **kwargs: {}  # an instance attribute over the method, this call only
            try:
                return original(accelerator, model)
            finally:
                del model.state_dict

        return prepare

    with fsdp2_prepare_model_replaced(releasing):
        yield


@patch("peft")
def dora_lora_weight_without_graph(model: torch.nn.Module) -> int:
    """Replaces ``get_lora_weight`` of every DoRA linear layer of ``model`` (on the instance) by the same
    computation under ``torch.no_grad()``; returns how many.

    Why: DoRA's forward computes ``B @ A`` by calling the ``lora_A``/``lora_B`` modules on an identity matrix,
    only to take the weight norm of ``W + scale * B @ A`` detached. Under FSDP1 those modules are units of their
    own, so each is run twice per forward with autograd on; with bf16/fp16 mixed precision FSDP1 then hands
    AdamW unreduced, full-size low-precision gradients (docs/compat.md#the-measurements). Without autograd the second
    call builds no graph and registers no backward hooks; every value is the same (the result is used detached).
    Upstream: peft 0.21 ``DoraLinearLayer.get_lora_weight`` / ``forward`` (``lora_weight.detach()``).
    Remove when: peft computes DoRA's detached LoRA weight without autograd.
    """
    from peft.tuners.lora.dora import DoraLinearLayer  # lazy: patch target, resolved when patched

    patched = 0
    for module in model.modules():
        if type(module) is DoraLinearLayer:  # not the embedding/conv subclasses, whose weight may carry grad
            module.get_lora_weight = _without_grad(module.get_lora_weight)
            patched += 1
    return patched


@patch("peft")
def trainable_tokens_through_the_base_layer(model: torch.nn.Module) -> int:
    """Replaces ``forward_adapters`` of every trainable-token layer of ``model`` (on the instance) by one that
    calls the frozen embedding (or untied output head) and puts the trained rows over its output; returns how many.

    Why: peft's forward reads ``base_layer.weight`` directly (``index_copy`` of the trained rows into it, then
    ``F.embedding``, or ``F.linear`` for a head) and never calls the base layer. Under FSDP1 (flat parameters)
    the trained rows and the frozen weight cannot share a unit, and a unit whose module is not called is never
    gathered, so the read found a freed shard. Here the base layer is called (its unit gathers) and the trained
    tokens' rows come from the delta: the same values (rows copied, in the weight's dtype; a head's trained
    columns of the output are ``x @ delta.T``) and the same gradients (each trained row gets the sum over its
    positions). peft's own path still serves a disabled or merged layer, a ``max_norm``/``scale_grad_by_freq``/
    ``sparse`` embedding and a head with a bias (peft's ``F.linear`` leaves the bias out).
    Upstream: peft 0.21 ``TrainableTokensLayer.forward_adapters`` / ``get_merged_weights``.
    Remove when: peft's trainable tokens call the base layer.
    """
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer  # lazy: patch target, resolved when patched

    patched = 0
    for module in model.modules():
        if type(module) is TrainableTokensLayer and isinstance(module.base_layer, torch.nn.Embedding):
            module.forward_adapters = functools.partial(_trained_rows_over_the_base_output, module)
            patched += 1
        elif type(module) is TrainableTokensLayer and isinstance(module.base_layer, torch.nn.Linear):
            module.forward_adapters = functools.partial(_trained_columns_over_the_head_output, module)
            patched += 1
    return patched


def _peft_path_serves(layer, active_adapters, head: bool) -> bool:
    base = layer.base_layer  # under FSDP1 the unit around the embedding or head: attributes are the module's
    if layer.disable_adapters or not active_adapters or layer.merged:
        return True
    if head:
        return base.bias is not None
    return base.max_norm is not None or base.scale_grad_by_freq or base.sparse


def _trained_rows_over_the_base_output(layer, x: torch.Tensor, active_adapters, *args, **kwargs) -> torch.Tensor:
    base = layer.base_layer
    if _peft_path_serves(layer, active_adapters, head=False):
        return type(layer).forward_adapters(layer, x, active_adapters, *args, **kwargs)
    layer._check_overlapping_tokens(active_adapters)
    result = base(x)  # called: FSDP1 gathers the frozen embedding's unit
    embed_scale = layer._get_embed_scale()
    for adapter in active_adapters:
        indices = torch.tensor(layer.token_indices[adapter], device=x.device)
        slots = torch.full((base.num_embeddings,), -1, dtype=torch.long, device=x.device)
        slots[indices] = torch.arange(len(indices), device=x.device)  # trained row of each token id, or -1
        slot = slots[x]
        padding = base.padding_idx
        padding_slot = int(slots[padding]) if padding is not None and int(slots[padding]) >= 0 else None
        rows = torch.nn.functional.embedding(
            slot.clamp(min=0), layer.trainable_tokens_delta[adapter].to(result), padding_idx=padding_slot
        )
        if embed_scale is not None:
            rows = rows * embed_scale.to(rows.dtype)
        result = torch.where((slot >= 0).unsqueeze(-1), rows, result)
    return result


def _trained_columns_over_the_head_output(layer, x: torch.Tensor, active_adapters, *args, **kwargs) -> torch.Tensor:
    if _peft_path_serves(layer, active_adapters, head=True):
        return type(layer).forward_adapters(layer, x, active_adapters, *args, **kwargs)
    layer._check_overlapping_tokens(active_adapters)
    result = layer.base_layer(x)  # called: FSDP1 gathers the frozen head's unit
    for adapter in active_adapters:
        indices = torch.tensor(layer.token_indices[adapter], device=x.device)
        columns = torch.nn.functional.linear(x, layer.trainable_tokens_delta[adapter].to(result.dtype))
        result = result.index_copy(-1, indices, columns)
    return result


def _without_grad(function: Callable) -> Callable:
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with torch.no_grad():
            return function(*args, **kwargs)

    return wrapper


@patch(
    "bitsandbytes",
    still_needed=lambda: "support_avx512bf16_for_cpu" in _source_of("bitsandbytes.nn:Linear4bit.forward"),
)
def cpu_weight_repacking_disabled(model: torch.nn.Module) -> int:
    """Sets bitsandbytes' ``Linear4bit.support_avx512bf16_for_cpu`` to False on every 4-bit layer; returns how many.

    Why: on CPU, ``Linear4bit.forward`` in eval mode repacks ``weight.data`` in place for its AVX512-BF16
    kernel and flags the shared ``quant_state``. Under FSDP that hits the unsharded copy and every later
    forward is wrong (docs/compat.md#the-measurements).
    GPU runs never take this path. `UPSTREAM` checks that ``forward`` still reads the switch.
    Remove when: bitsandbytes repacks into a copy, not in place.
    """
    changed = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            changed += 1
    return changed


@patch("accelerate")
def state_switched_to_fsdp(state, fsdp_version: int) -> None:
    """Sets accelerate's ``distributed_type`` to FSDP in both the `AcceleratorState` and the shared
    ``PartialState._shared_state`` (every later ``AcceleratorState()`` re-copies the latter).

    Why: accelerate builds FSDP state only on accelerators; a CPU launch asking for FSDP silently becomes
    DDP. FSDP1 also compares its compute device ``cpu`` with accelerate's ``cpu:0``, so the device is set too.
    Remove when: accelerate supports FSDP on CPU over gloo.
    """
    from accelerate import PartialState  # lazy: patch target, resolved when patched
    from accelerate.utils import DistributedType  # lazy: patch target, resolved when patched

    for values in (state.__dict__, PartialState._shared_state):
        values["distributed_type"] = DistributedType.FSDP
        if fsdp_version == 1:
            values["device"] = torch.device("cpu")


@patch("transformers")
@contextlib.contextmanager
def xla_fsdp_optimizer_created(trainer):
    """Replaces ``trainer._wrap_model`` (on this instance) by one that, under XLA FSDP, creates the optimizer
    for the wrapped model when Trainer has none yet.

    Why: under XLA FSDP (v1 and v2) ``Trainer._prepare_for_training`` delays optimizer creation until the
    model is wrapped, but since transformers 5.3 ``_wrap_model`` no longer assigns the wrapped model to
    ``self.model``, so the branch that creates it is skipped and ``create_scheduler`` fails with
    ``'NoneType' object has no attribute 'param_groups'``. transformers 5.2 ran unpatched; 5.24 needs it
    (tests/xla/test_xla_recipes.py checks both: needed, and applied).
    Remove when: Trainer creates the delayed optimizer after XLA FSDP wrapping again.
    """
    original = trainer._wrap_model

    def wrap_then_create_optimizer(model, *args, **kwargs):
        wrapped = original(model, *args, **kwargs)
        if trainer.is_fsdp_xla_enabled and trainer.optimizer is None and wrapped is not trainer.model:
            trainer.create_optimizer(wrapped)
        return wrapped

    trainer._wrap_model = wrap_then_create_optimizer
    try:
        yield
    finally:
        del trainer._wrap_model


CHECKPOINTING_ALIAS_WARNING = "`is_gradient_checkpointing` is deprecated"  # transformers 5.24's FutureWarning


@contextlib.contextmanager
def checkpointing_alias_quiet():
    """Inside, transformers' FutureWarning for the deprecated ``is_gradient_checkpointing`` alone is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=CHECKPOINTING_ALIAS_WARNING, category=FutureWarning)
        yield


@patch(
    "peft",
    still_needed=lambda: "is_gradient_checkpointing" in _source_of("peft.peft_model:PeftModel.__init__"),
)
def peft_wrapped(model: torch.nn.Module, config, **kwargs):
    """peft's ``get_peft_model(model, config, **kwargs)`` without the one FutureWarning it raises on every run.

    Why: transformers 5.24 renamed ``is_gradient_checkpointing`` to ``is_activation_checkpointing`` and warns
    on the old name; peft 0.21's ``PeftModel.__init__`` reads the old one, so every run printed
    "`is_gradient_checkpointing` is deprecated" once per rank, a warning no user can act on.
    Only that warning is silenced, only here; `UPSTREAM` checks that peft still reads the old name.
    Remove when: peft reads ``is_activation_checkpointing``.
    """
    from peft import get_peft_model  # lazy: every command imports _compat; peft (and bitsandbytes) only model builders

    with checkpointing_alias_quiet():
        return get_peft_model(model, config, **kwargs)


@patch(
    "trl",
    still_needed=lambda: "is_gradient_checkpointing" in _source_of("trl.models.utils:disable_gradient_checkpointing"),
)
@contextlib.contextmanager
def trl_without_the_checkpointing_warning():
    """Silences transformers' FutureWarning for ``is_gradient_checkpointing`` (that one alone) while TRL's trainers
    compute a loss, build (DPO: precompute reference log-probs), score held-out pairs, or make and score GRPO rollouts
    (`fsdp_peft.procedures.trainer.ReferenceWithoutCopy`, `fsdp_peft.procedures.preference.held_out_preference`,
    `fsdp_peft.procedures.rl.RolloutTrainer`).

    Why: TRL 1.16 reads the deprecated name in ``unwrap_model_for_generation`` and ``disable_gradient_checkpointing``
    around every reference forward and rollout batch, so each DPO, KTO and GRPO run printed "`is_gradient_checkpointing`
    is deprecated" on every rank, a warning no user can act on. `UPSTREAM` checks that TRL still reads the old name.
    Remove when: TRL reads ``is_activation_checkpointing``.
    """
    with checkpointing_alias_quiet():
        yield


PROCESS_GROUP_THREADS = ("pt_gloo", "gloo_", "pt_nccl")  # name prefixes of c10d's native threads (Linux)


@patch("torch")
def process_groups_released() -> list[str]:
    """Drops what every `DeviceMesh` still holds of its process groups after ``destroy_process_group``, so that the
    groups are destructed (their native threads joined) now, while the interpreter is whole; returns the names of
    process-group threads still running (Linux; empty where it cannot tell).

    Why: torch 2.13's ``destroy_process_group`` unregisters the groups and shuts their backends down, but each
    `DeviceMesh` keeps its groups in ``_pg_registry``, and DTensor's sharding-propagation cache keeps the mesh
    of every DTensor a run created, so the gloo group of an FSDP2 run is never destructed: its 2 worker threads
    and its TCP loop thread were still running at interpreter exit in every recipe run (under gdb its destructor
    never ran), left to race interpreter finalization and the C++ static destructors. That is the state in
    which finished runs aborted at exit ("terminate called without an active exception", SIGABRT). Cleared
    registries are rebuilt from the group names if a mesh is used again; once the model is gone, nothing
    else holds the group. tests/distributed/process_group_release_check.py shows both states.
    Remove when: ``destroy_process_group`` alone joins the threads of an FSDP2 run's group.
    """

    gc.collect()  # the model and trainer of the run: reference cycles
    for mesh in [o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)]:  # type(): no __class__ lookups
        mesh._pg_registry.clear()
    gc.collect()
    return process_group_threads()


@patch(
    "torch",
    still_needed=lambda: (
        "self._unsharded_param.grad is None" in _source(inspect.unwrap(_resolve(FSDP2_ACCUMULATED_GRAD)))
    ),
)
def fsdp2_accumulation_skips_ungathered_parameters() -> None:
    """Makes FSDP2's ``FSDPParam.to_accumulated_grad_if_needed`` return at once for a parameter its unit never
    gathered (idempotent; for every FSDP2 model of the process).

    Why: TRL 1.16's fused log-prob head (DPO, KTO, GRPO) reads ``lm_head.weight`` without calling the head's
    forward, so the output head's own FSDP2 unit (accelerate carves it) is never gathered by its hooks and its
    ``FSDPParam`` never gets an ``_unsharded_param``. On a micro-step without gradient sync (gradient
    accumulation) with a reduce dtype set (bf16 mixed precision: QLoRA), torch's final post-backward callback
    converts every unit's unsharded gradient to the reduce dtype and fails with "'FSDPParam' object has no
    attribute '_unsharded_param'" (docs/compat.md#the-measurements). A
    parameter that was never gathered has no unsharded gradient to convert (the frozen head has none at all).
    Remove when: torch skips parameters that were never unsharded there.
    """
    original = FSDPParam.to_accumulated_grad_if_needed
    if getattr(original, "skips_ungathered", False):
        return

    @functools.wraps(original)
    def skipping_ungathered(self) -> None:
        if not hasattr(self, "_unsharded_param"):  # never gathered: no unsharded gradient
            return
        original(self)

    skipping_ungathered.skips_ungathered = True
    FSDPParam.to_accumulated_grad_if_needed = skipping_ungathered


BITSANDBYTES_COMPILING_MODULE = "bitsandbytes.backends.default.ops"
BITSANDBYTES_CPU_MODULE = "bitsandbytes.backends.cpu.ops"
DEQUANTIZE_4BIT = "bitsandbytes::dequantize_4bit"


@contextlib.contextmanager
def torch_compile_deferred():
    """``torch.compile(fn, **options)`` inside returns a function that compiles ``fn`` with those options on its first
    call, as ``torch.compile`` itself does, but without loading the compiler (dynamo, inductor) until then."""
    compile_now = torch.compile

    def deferred(model=None, **options):
        if model is None:  # used as ``@torch.compile(**options)``
            return lambda function: deferred(function, **options)
        compiled = []

        @functools.wraps(model)
        def compiled_on_first_call(*args, **kwargs):
            if not compiled:
                compiled.append(compile_now(model, **options))
            return compiled[0](*args, **kwargs)

        return compiled_on_first_call

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = compile_now


@contextlib.contextmanager
def cpu_4bit_dequantization_fixed_after():
    """Runs the body (bitsandbytes' CPU backend registering its kernels), then fixes its 4-bit dequantization."""
    yield
    cpu_4bit_dequantization_block_aligned()


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader (every other attribute passes through), executing it inside ``around()``."""

    def __init__(self, loader, around: Callable[[], contextlib.AbstractContextManager]):
        self.loader, self.around = loader, around

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        with self.around():
            self.loader.exec_module(module)


BITSANDBYTES_IMPORTS = {  # bitsandbytes module: what its execution runs inside (fsdp_peft/__init__.py's finder)
    BITSANDBYTES_COMPILING_MODULE: torch_compile_deferred,
    BITSANDBYTES_CPU_MODULE: cpu_4bit_dequantization_fixed_after,
}


@patch(
    "bitsandbytes",
    still_needed=lambda: "torch.compile(fn" in _source_of("bitsandbytes.backends.default.ops:_try_torch_compile"),
)
def bitsandbytes_compiling_module_spec(name: str, path, target=None):
    """The import spec of a module of `BITSANDBYTES_IMPORTS` with its loader wrapped (``fsdp_peft/__init__.py`` asks
    for it as the module is imported); ``None`` (import as is) for any other module or outside the verified window.

    Why: bitsandbytes 0.50 wraps four default-backend kernels in ``torch.compile`` at import time
    (``_try_torch_compile``), which loads dynamo's tracer and inductor in every process that imports peft, even
    when those kernels never run (on GPUs the CUDA backend serves them): a sixth of a rank's imports on CPU
    (docs/compat.md#the-measurements). Compiling on the first call is what ``torch.compile`` does anyway, and
    bitsandbytes' wrapper still falls back to the eager kernel if that compile fails. The CPU backend's module is
    wrapped too, so that `cpu_4bit_dequantization_block_aligned` replaces its 4-bit dequantization as soon as it is
    registered.
    Remove when: bitsandbytes compiles its default kernels lazily (and the CPU patch is gone).
    """
    around = BITSANDBYTES_IMPORTS.get(name)
    if around is None or version_problem("bitsandbytes"):
        return None
    spec = importlib.machinery.PathFinder.find_spec(name, path, target)
    if spec is not None and spec.loader is not None:
        spec.loader = _PatchingLoader(spec.loader, around)
    return spec


_CPU_DEQUANTIZATION: dict = {}  # "original": bitsandbytes' own CPU kernel, "library": the registration that replaced it


def bitsandbytes_cpu_dequantize_4bit():
    """bitsandbytes' own CPU kernel of ``dequantize_4bit`` (the replaced one, once patched); called with a dispatch key
    set and the op's arguments (``A, absmax, blocksize, quant_type, shape, dtype``)."""
    if "original" in _CPU_DEQUANTIZATION:
        return _CPU_DEQUANTIZATION["original"]
    return torch.library.get_kernel(DEQUANTIZE_4BIT, "CPU")


def _misplaces_block_scales() -> bool:
    """bitsandbytes' own CPU kernel on the smallest failing shape (two rows of 96 values, blocks of 64): does the
    result differ from the same bytes dequantized in block-aligned rows? (tests/test_four_bit.py holds both against
    the reference decoder.)"""
    import bitsandbytes.functional as bnb_functional  # lazy: only QLoRA needs bitsandbytes

    weight = torch.linspace(-1, 1, 192).reshape(2, 96)
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=False)
    kernel, keys = bitsandbytes_cpu_dequantize_4bit(), torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    shaped = kernel.call_boxed(keys, packed, state.absmax, 64, "nf4", [2, 96], torch.float32)
    aligned = kernel.call_boxed(keys, packed, state.absmax, 64, "nf4", [3, 64], torch.float32)
    return not torch.equal(shaped, aligned.view(2, 96))


@patch("bitsandbytes", still_needed=_misplaces_block_scales)
def cpu_4bit_dequantization_block_aligned() -> None:
    """Replaces bitsandbytes' CPU kernel of ``bitsandbytes::dequantize_4bit`` with one that calls it on the same values
    viewed as rows of one block each (or one row, when the blocks do not divide them) and views the result in the
    asked shape (idempotent; process-wide; CUDA and every other device keep their own kernels).

    Why: bitsandbytes 0.50's CPU kernel assigns block scales wrongly when a row of the asked shape does not start on a
    block boundary and its length is a multiple of 16 (``[128, 96]``, ``[8, 128, 96]``, ``[64, 32]`` in blocks of 64;
    one row, or one block in all, is right): every ``Linear4bit`` with such an input width and every 4-bit expert of
    such a width computed with wrong weights on CPU, nearly three times a right NF4 round trip's error
    (docs/compat.md#the-measurements). The values and their scales are right; only their pairing is not. Rows that
    are whole blocks are the case the kernel gets right, at the shaped call's speed (a single row would run on one
    thread). ``Linear4bit``'s forward and backward, bitsandbytes' no-grad ``gemm_4bit`` and ``dequantize_4bit`` all
    reach the kernel through the op, so all of them are fixed.
    Remove when: bitsandbytes' CPU kernel indexes block scales by the value's flat position (`_misplaces_block_scales`
    turns false).
    """
    if "original" in _CPU_DEQUANTIZATION:
        return
    original = torch.library.get_kernel(DEQUANTIZE_4BIT, "CPU")

    def block_aligned(keys, A, absmax, blocksize, quant_type, shape, dtype):
        count = math.prod(shape)
        rows = [count // blocksize, blocksize] if count % blocksize == 0 else [count]
        return original.call_boxed(keys, A, absmax, blocksize, quant_type, rows, dtype).view(shape)

    library = torch.library.Library("bitsandbytes", "IMPL")
    with warnings.catch_warnings():  # torch warns that a kernel is overridden: that is the point
        warnings.simplefilter("ignore")
        library.impl(DEQUANTIZE_4BIT.split("::")[1], block_aligned, "CPU", with_keyset=True, allow_override=True)
    _CPU_DEQUANTIZATION.update(original=original, library=library)


def process_group_threads() -> list[str]:
    """The names of this process's native threads that belong to a process group (Linux ``/proc``; else empty)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return []
    names = []
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(PROCESS_GROUP_THREADS):
            names.append(name)
    return sorted(names)
