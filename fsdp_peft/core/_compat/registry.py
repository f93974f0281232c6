"""The registry: the upstream symbols fsdp-peft relies on (`UPSTREAM`), the releases it was verified with
(`VERIFIED`), the `patch` decorator every patch module registers its patches with (`PATCHES`), and the one-line
problems a release or a symbol outside them makes, which `fsdp_peft.core._compat.gate.check_upstream` raises."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from typing import Callable

from packaging.version import Version

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
        "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState.init",
        ("modules", "device", "mp_policy", "auto_reshard_after_forward"),
        "fsdp_peft.core._compat.torch_patches.fsdp2_forward_hooks_detached",
        "FSDP2's forward hooks, a graph break in every unit, are set aside while every unit is kept gathered for a "
        "compiled decode step",
        "FSDP2's forward hooks trace under torch.compile without a graph break",
        mentions=("_pre_forward_hook_handle", "_post_forward_hook_handle"),
    ),
    Upstream(
        "bitsandbytes.backends.default.ops:_try_torch_compile",
        ("func",),
        "fsdp_peft.core._compat.bitsandbytes_patches.bitsandbytes_compiling_module_spec",
        "bitsandbytes builds its torch.compile wrappers at import: dynamo and inductor load in every process",
        "bitsandbytes compiles lazily, on the first call",
        mentions=("torch.compile",),
    ),
    Upstream(
        "bitsandbytes.functional:dequantize_4bit",
        ("A", "quant_state"),
        "fsdp_peft.core._compat.bitsandbytes_patches.cpu_4bit_dequantization_block_aligned",
        "bitsandbytes' CPU 4-bit dequantization misplaces block scales for some shapes; the op is replaced on CPU",
        "bitsandbytes' CPU kernel indexes block scales by flat position",
        mentions=("torch.ops.bitsandbytes.dequantize_4bit",),
    ),
    Upstream(
        "transformers.trainer:update_fsdp_plugin_peft",
        ("model", "accelerator"),
        "fsdp_peft.core._compat.transformers_patches.trainer_peft_update_skipped",
        "Trainer's FSDP1-only PEFT update would overwrite fsdp-peft's policies",
        "transformers calls it under FSDP2 too with the same policies",
    ),
    Upstream(
        "transformers.trainer:load_fsdp_optimizer",
        ("fsdp_plugin", "accelerator", "optimizer", "model", "input_dir"),
        "fsdp_peft.core._compat.accelerate_patches.fsdp1_adapter_checkpoints",
        "FSDP1 sharded optimizer state is loaded into an empty template before the first step",
        "accelerate loads FSDP1 optimizer state from the checkpoint's own metadata",
    ),
    Upstream(
        "accelerate.utils.fsdp_utils:_get_model_state_dict",
        ("model", "adapter_only", "sd_options"),
        "fsdp_peft.core._compat.accelerate_patches.fsdp1_adapter_checkpoints",
        "FSDP1 renames modules, so peft finds no adapter tensors to checkpoint",
        "accelerate selects FSDP1 adapter tensors by unwrapped names",
    ),
    Upstream(
        "accelerate.utils.fsdp_utils:_set_model_state_dict",
        ("model", "state_dict", "adapter_only", "sd_options"),
        "fsdp_peft.core._compat.accelerate_patches.fsdp1_adapter_checkpoints",
        "the loading side of the same FSDP1 adapter checkpoints",
        "accelerate selects FSDP1 adapter tensors by unwrapped names",
    ),
    Upstream(
        "peft.peft_model:PeftModel.__init__",
        used_by="fsdp_peft.core._compat.peft_patches.peft_wrapped",
        why="peft reads transformers' deprecated is_gradient_checkpointing (a FutureWarning on every run)",
        remove_when="peft reads is_activation_checkpointing",
        mentions=("is_gradient_checkpointing",),
    ),
    Upstream(
        "accelerate.accelerator:fsdp2_prepare_model",
        ("accelerator", "model"),
        "fsdp_peft.core._compat.accelerate_patches.fsdp2_prepare_model_replaced (low-memory loading)",
        "weights stream into a skeleton model only after FSDP2 has sharded it",
        "accelerate's cpu_ram_efficient_loading supports bitsandbytes 4-bit (accelerate PR #3987)",
    ),
    Upstream(
        "accelerate.utils.fsdp_utils:fsdp2_prepare_model",
        ("accelerator", "model"),
        "fsdp_peft.core._compat.accelerate_patches.originals_released_while_sharding",
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
        "fsdp_peft.core._compat.peft_patches.adapters_created_off_meta",
        "peft moves new adapters to a meta base layer's device, losing their initial values",
        "peft keeps adapters of meta base layers materialised",
    ),
    Upstream(
        "peft.tuners.lora.model:LoraModel._replace_module",
        ("self", "parent", "child_name", "new_module", "child"),
        "fsdp_peft.core._compat.peft_patches.adapters_created_off_meta",
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
        "fsdp_peft.core._compat.peft_patches.dora_lora_weight_without_graph",
        "DoRA's weight norm calls the FSDP1 LoRA units a second time with autograd on; FSDP1 + mixed precision "
        "then leaves their gradients unreduced",
        "peft computes DoRA's (detached) LoRA weight without autograd",
        mentions=("x_eye",),
    ),
    Upstream(
        "peft.tuners.lora.dora:DoraLinearLayer.forward",
        ("self", "x", "lora_A", "lora_B", "scaling", "base_layer"),
        "fsdp_peft.core._compat.peft_patches.dora_lora_weight_without_graph",
        "the LoRA weight is used only detached (for the norm), so computing it without autograd changes no value",
        "peft computes DoRA's (detached) LoRA weight without autograd",
        mentions=("lora_weight=lora_weight.detach()",),
    ),
    Upstream(
        "peft.tuners.trainable_tokens.layer:TrainableTokensLayer.forward_adapters",
        ("self", "x", "active_adapters"),
        "fsdp_peft.core._compat.peft_patches.trainable_tokens_through_the_base_layer",
        "trainable tokens read the frozen embedding's weight without calling it, so its FSDP1 unit never gathers",
        "peft's trainable tokens call the base embedding (or FSDP1 gathers modules whose tensors are read)",
        mentions=("get_merged_weights", "F.embedding"),
    ),
    Upstream(
        "bitsandbytes.nn:Linear4bit.forward",
        ("self", "x"),
        "fsdp_peft.core._compat.bitsandbytes_patches.cpu_weight_repacking_disabled",
        "on CPU, eval-mode forwards repack the weight in place, corrupting FSDP's shared unsharded copy",
        "bitsandbytes repacks into a copy (bitsandbytes #1945)",
        mentions=("support_avx512bf16_for_cpu",),
    ),
    Upstream(
        "accelerate.state:PartialState._shared_state",
        (),
        "fsdp_peft.core._compat.accelerate_patches.state_switched_to_fsdp (CPU mode)",
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
        "fsdp_peft.cli.launcher_environment",
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
        "fsdp_peft.core._compat.accelerate_patches.context_parallel_hooks_skipped",
        "accelerate's ring-attention hooks drop every attention mask, generation's too",
        "accelerate attaches its hooks only inside its context-parallel context",
        mentions=("_attach_context_parallel_hooks",),
    ),
    Upstream(
        "transformers.trainer:Trainer._prepare_for_training",
        ("self", "max_steps", "train_dataloader", "resume_from_checkpoint"),
        "fsdp_peft.procedures.trainer.PeftFsdpTrainer; "
        "fsdp_peft.core._compat.transformers_patches.xla_fsdp_optimizer_created",
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
        "fsdp_peft.core._compat.transformers_patches.xla_fsdp_optimizer_created",
        "under XLA FSDP the optimizer is created for the model _wrap_model returns",
        "Trainer creates the delayed optimizer after XLA FSDP wrapping again (transformers 5.2 did)",
    ),
    Upstream(
        "torch.distributed.device_mesh:DeviceMesh.__init__",
        ("self", "device_type", "mesh"),
        "fsdp_peft.core._compat.torch_patches.process_groups_released",
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
        "fsdp_peft.core._compat.torch_patches.fsdp2_accumulation_skips_ungathered_parameters",
        "without gradient sync, FSDP2 converts the unsharded gradient of every parameter, gathered or not",
        "torch skips parameters that were never unsharded there",
        mentions=("_unsharded_param", "reduce_dtype"),
    ),
    Upstream(
        "torch.library:get_kernel",
        ("op", "dispatch_key"),
        "fsdp_peft.core._compat.torch_patches.cpu_bf16_products_in_fp32",
        "aten's own CPU kernels of the matrix products, called for every dtype but bf16 once they are replaced",
        "aten computes bf16 products through its fp32 GEMM where oneDNN has no bf16 one",
    ),
    # TRL's, checked in the processes that import trl (the preference and GRPO recipes)
    Upstream(
        "trl.trainer.grpo_trainer:GRPOTrainer._generate_single_turn",
        ("self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
        "fsdp_peft.procedures.rl.GatheredRollouts._generate_single_turn",
        "TRL's sampling is run unchanged, inside one FSDP2 gather of every unit",
        "TRL generates from FSDP2 models with their units gathered once per call",
        mentions=("unwrap_model_for_generation", "generation_config"),
    ),
    Upstream(
        "trl.trainer.grpo_trainer:GRPOTrainer._tokenize_prompts",
        ("self", "prompts"),
        "fsdp_peft.procedures.rl.GatheredRollouts._tokenize_prompts",
        "prompts the recipe has rendered are tokenized without added special tokens; the result is TRL's triple",
        "TRL tokenizes rendered string prompts without adding special tokens",
        mentions=("multimodal_fields",),
    ),
    Upstream(
        "trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions",
        ("self", "inputs"),
        "fsdp_peft.procedures.rl.GatheredRollouts._generate_and_score_completions",
        "TRL's rollouts run inside fsdp_peft.core._compat.trl_patches.trl_without_the_checkpointing_warning",
        "TRL reads is_activation_checkpointing",
        mentions=("disable_gradient_checkpointing",),
    ),
    Upstream(
        "trl.models.utils:disable_gradient_checkpointing",
        ("model", "gradient_checkpointing_kwargs"),
        "fsdp_peft.core._compat.trl_patches.trl_without_the_checkpointing_warning",
        "TRL reads transformers' deprecated is_gradient_checkpointing around reference forwards and rollouts",
        "TRL reads is_activation_checkpointing",
        mentions=("is_gradient_checkpointing",),
    ),
    Upstream(
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VLForConditionalGeneration.forward",
        ("self", "input_ids", "labels"),
        "fsdp_peft.core._compat.transformers_patches.loss_counts_every_ranks_tokens",
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
        return _window_problem(self.package, self.window, f"{self.function.__module__}.{self.function.__name__}")


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
