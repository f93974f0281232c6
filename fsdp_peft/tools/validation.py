"""Every rule a recipe config must satisfy, checked before any process group, model or data is touched.

Each rule is a small function of one context (`fsdp_peft.settings.fsdp_settings.RuleContext`: recipe, training values,
procedure, the FSDP settings resolved once) returning a problem message (key, value, rule, fix) or ``None``.
`RULES` is the one registry of the rules every procedure shares (the variants' and mixtures of experts' rules,
defined beside what they guard, included), each with a guard: a predicate of the procedure's traits
(`fsdp_peft.procedures.procedure.Procedure`), never a list of names. A procedure's own rules are its own
(``Procedure.rules``) and follow the shared ones. `check_before_training` runs them for the recipe and for
``fsdp-peft validate`` alike, and reports every problem at once, in that order.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
from pathlib import Path
from typing import Callable

import torch
from transformers import TrainingArguments
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from fsdp_peft.core.distributed import ranks
from fsdp_peft.core.dtypes import DTYPES
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.safetensors_io import parse_size
from fsdp_peft.core.unreachable_hub import out_of_reach_noted
from fsdp_peft.core.xla import DEVICE_VARIABLE, gpu_only_fsdp_keys, on_xla, torch_xla_installed
from fsdp_peft.data.formats import DATA_FORMATS, source_examples
from fsdp_peft.data.packing import packed_rows_keep_their_order
from fsdp_peft.data.sources import DATA_EXTENSIONS, data_files_in, data_sources, is_local_path, read_source
from fsdp_peft.data.tokenize import TRUNCATIONS, nothing_left_to_train_on
from fsdp_peft.model.attention import architecture_problem, attention_problem, model_class_named
from fsdp_peft.model.kernels import kernels_problem
from fsdp_peft.model.loading import low_memory_loading_requested
from fsdp_peft.model.moe import (
    expert_adapters_are_plain_lora,
    expert_adapters_have_no_dropout,
    expert_adapters_run_under_fsdp2,
    experts_adapted,
    moe_keys_need_a_mixture_of_experts,
    moe_targets_reach_the_experts,
)
from fsdp_peft.model.paths import (
    cached_hub_model_names,
    checkpoint_quantization,
    hub_cache_dir,
    hub_model_cached,
    hub_offline,
    known_model_config,
    local_model_config,
    resolve_model_path,
    shipped_hub_config,
    shipped_hub_model_names,
)
from fsdp_peft.model.variants import (
    eva_forwards_the_loaded_model_before_sharding,
    eva_initialises_linear_layers_only,
    eva_keeps_the_configured_ranks,
    fsdp1_keeps_tied_embeddings_in_the_root,
    init_from_base_weights_needs_the_full_precision_base,
    new_special_tokens_are_new,
    new_tokens_train_as_trainable_tokens,
    trainable_tokens_and_their_embedding_copy_exclude_each_other,
    variant_keys_are_known,
)
from fsdp_peft.model.vision import auto_model_class, is_vision_config
from fsdp_peft.parallel.cpu_fsdp import USE_PARALLELISM_CONFIG
from fsdp_peft.parallel.fsdp_policies import decoder_layer_classes
from fsdp_peft.parallel.sequence_parallel import (
    sequence_split_fits_the_model,
    sequence_split_keeps_the_models_loss,
    sequence_split_runs_here,
)
from fsdp_peft.settings.checkpointing import CHECKPOINTING_KEYS
from fsdp_peft.settings.choices import (
    COMPILED_CHOICES,
    COMPILED_DECODING_HELP,
    GATHER_BUDGET_HELP,
    OFFLINE_MODEL_NAMES,
    SMOLLM2_HUB_ID,
    TINY_DATASET_NAME,
)
from fsdp_peft.settings.config import keys_set, unset_training_values
from fsdp_peft.settings.families import FAMILIES, family_for, lora_targets
from fsdp_peft.settings.fsdp_settings import (
    RuleContext,
    _fsdp_options,
    _read_fsdp_config,
    launcher_asks_for_fsdp,
    mixed_precision_dtype,
    rule_context,
    truthy,
)
from fsdp_peft.settings.keys import (
    field_types,
    ill_typed_keys,
    type_problems,
    unknown_choice,
    value_problems,
)
from fsdp_peft.tools.export import OUTPUT_DTYPES

GPU_ONLY_OPTIMIZER_MARKS = ("bnb", "8bit", "paged", "apex", "galore", "lomo")


def fsdp_gather_dtype(recipe, training: dict) -> str:
    """The dtype FSDP all-gathers parameters in: the mixed-precision dtype, else the stored dtype."""
    return mixed_precision_dtype(training) or recipe.torch_dtype


def _dtype_keys_are_known(context: RuleContext) -> str | None:
    recipe = context.recipe
    for key in ("torch_dtype", "bnb_4bit_compute_dtype", "fsdp_reduce_dtype"):
        value = getattr(recipe, key)
        if value not in DTYPES:
            return unknown_choice(key, value, DTYPES)
    if recipe.export_dtype not in OUTPUT_DTYPES:
        return unknown_choice("export_dtype", recipe.export_dtype, tuple(OUTPUT_DTYPES))
    return None


def _fsdp_settings_resolve(context: RuleContext) -> str | None:
    return context.fsdp_problem


def _quant_storage_is_floating_under_fsdp(context: RuleContext) -> str | None:
    recipe, training = context.recipe, context.training
    if not recipe.load_in_4bit or not context.fsdp_in_use:
        return None
    if recipe.bnb_4bit_quant_storage not in DTYPES:
        return (
            f"bnb_4bit_quant_storage: '{recipe.bnb_4bit_quant_storage}' cannot be sharded by FSDP; "
            f"set it to {fsdp_gather_dtype(recipe, training)} (the FSDP gather dtype)"
        )
    return None


def _quant_storage_matches_gather_dtype(context: RuleContext) -> str | None:
    recipe, training = context.recipe, context.training
    if not recipe.load_in_4bit or recipe.bnb_4bit_quant_storage not in DTYPES:
        return None
    gather = fsdp_gather_dtype(recipe, training)
    if recipe.bnb_4bit_quant_storage != gather:
        return (
            f"bnb_4bit_quant_storage: '{recipe.bnb_4bit_quant_storage}' differs from the dtype FSDP gathers in "
            f"('{gather}', from bf16/fp16/torch_dtype); FSDP would cast the packed 4-bit bytes. "
            f"Set bnb_4bit_quant_storage: {gather}"
        )
    return None


def _data_files_exist(context: RuleContext) -> str | None:
    recipe = context.recipe
    kinds = ", ".join(DATA_EXTENSIONS)
    for key in ("train_file", "eval_file"):
        value = getattr(recipe, key)
        path = Path(value).expanduser() if value is not None else None
        if path is not None and not path.exists():
            return f"{key}: file not found: {value} ({_where_looked()})"
        if path is not None and path.is_file() and path.suffix not in DATA_EXTENSIONS:
            return f"{key}: '{value}' is not a data file ({kinds}); convert it or point {key} at one"
        if path is not None and path.is_dir() and not data_files_in(path):
            return f"{key}: directory '{value}' holds no {kinds} files; point {key} at one or at such a directory"
    dataset = recipe.dataset
    if recipe.train_file is None and dataset != TINY_DATASET_NAME and is_local_path(dataset):
        path = Path(dataset).expanduser()
        if not path.exists():
            return (
                f"dataset: '{dataset}' is neither '{TINY_DATASET_NAME}' nor a directory or data file that exists "
                f"({_where_looked()}); fix the path, or name a hub dataset as owner/name"
            )
        if path.is_dir() and not any(data_files_in(p) for p in (path, path / "train") if p.is_dir()):
            return f"dataset: directory '{dataset}' holds no {kinds} files (nor a train/ directory of them)"
        if path.is_file() and path.suffix not in DATA_EXTENSIONS:
            return f"dataset: '{dataset}' is not a data file ({kinds}); convert it or point dataset at one"
    return None


def _where_looked() -> str:
    return f"looked beside the config file that sets it, then in the working directory {Path.cwd()}"


def _data_settings_are_known(context: RuleContext) -> str | None:
    recipe = context.recipe
    if recipe.data_format not in DATA_FORMATS:
        return f"data_format: '{recipe.data_format}' is not one of {', '.join(DATA_FORMATS)}"
    if recipe.truncation not in TRUNCATIONS:
        return f"truncation: '{recipe.truncation}' is not one of {', '.join(TRUNCATIONS)}"
    if not 0 <= recipe.eval_split < 1:
        return f"eval_split: {recipe.eval_split} is not a fraction in [0, 1); e.g. 0.05 holds out 5% of the train rows"
    return None


def _local_model_path_exists(context: RuleContext) -> str | None:
    recipe = context.recipe
    name = recipe.model_name_or_path
    if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().is_dir():
        return f"model_name_or_path: directory not found: {name}"
    return None


def _output_dir_can_hold_the_run(context: RuleContext) -> str | None:
    output_dir = context.training.get("output_dir")
    if output_dir and Path(output_dir).expanduser().exists() and not Path(output_dir).expanduser().is_dir():
        return f"output_dir: '{output_dir}' is a file, not a directory; point output_dir at a new or existing directory"
    return None


def _model_name_is_known(context: RuleContext) -> str | None:
    """A name that is no directory here and looks like an embedded model's (or, offline, a hub id not in the cache)
    would cost the launch its hub retries: one line now, with the closest names."""
    recipe = context.recipe
    name = recipe.model_name_or_path
    if name in OFFLINE_MODEL_NAMES or Path(name).expanduser().exists():
        return None
    close = difflib.get_close_matches(name, OFFLINE_MODEL_NAMES, n=1, cutoff=0.8)
    if "/" not in name and (close or name.startswith("tiny-")):
        suggestion = f"did you mean '{close[0]}'? " if close else ""
        return (
            f"model_name_or_path: '{name}' is no embedded model, directory or hub id; {suggestion}"
            f"the models that need no hub are {', '.join(OFFLINE_MODEL_NAMES)}"
        )
    if not hub_offline() or hub_model_cached(name) or name == SMOLLM2_HUB_ID:  # offline: the packaged copy
        return None
    if out_of_reach_noted() and shipped_hub_config(name) is not None:
        return None  # `fsdp-peft validate` of a shipped config on a machine without the model: the launch downloads
    known = difflib.get_close_matches(name, [*shipped_hub_model_names(), *cached_hub_model_names()], n=1, cutoff=0.8)
    suggestion = f"did you mean '{known[0]}'? " if known and known[0] != name else ""
    return (
        f"model_name_or_path: '{name}' is not in the Hugging Face cache ({hub_cache_dir()}) and the hub is offline "
        f"(HF_HUB_OFFLINE); {suggestion}download it first, point model_name_or_path at a local copy, or unset "
        "HF_HUB_OFFLINE"
    )


def _model_config_is_a_causal_lm(context: RuleContext) -> str | None:
    recipe = context.recipe
    name = recipe.model_name_or_path
    try:
        config = local_model_config(name, recipe.trust_remote_code)
    except OSError as error:
        if not (Path(resolve_model_path(name)).expanduser() / "config.json").is_file():
            return None  # not on this machine yet: loading it will tell
        return (
            f"model_name_or_path: the config of {name} does not load: {_first_line(error).rstrip('.')}; fix the "
            "file or point model_name_or_path at a complete copy of the model"
        )
    except ValueError as error:
        remote = "" if recipe.trust_remote_code else " (if its code lives in its hub repo: trust_remote_code: true)"
        return f"model_name_or_path: the config of {name} does not load: {_first_line(error)}{remote}"
    custom = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if is_vision_config(config):  # a vision-language model: one whose parts a family entry names
        if family_for(config.model_type).vision is None:
            known = ", ".join(f.name for f in FAMILIES if f.vision is not None)
            return (
                f"model_name_or_path: {name} is a '{config.model_type}' vision-language model, whose vision tower, "
                f"projector and layers fsdp_peft does not know (it knows {known}); use one of those (docs/vision.md)"
            )
        return None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not custom:
        return (
            f"model_name_or_path: {name} is a '{config.model_type}' model, which has no causal language model head "
            "in transformers; the recipes fine-tune decoder-only (causal) language models"
        )
    return None


VISION_ONLY_KEYS = ("lora_vision_tower", "train_projector")
# keys whose text-data meaning the vision procedure (fsdp_peft.procedures.vision_sft) does not have: (key, its default)
TEXT_ONLY_KEYS = (
    ("packing", False),
    ("eval_split", 0.0),
    ("data_format", "auto"),
    ("dataset_columns", None),
    ("completion_only_loss", True),
    ("use_chat_template", True),
    ("new_special_tokens", []),
    ("sequence_parallel_size", 1),
    ("eval_tasks", []),
)


def _vision_keys_fit_the_model(context: RuleContext) -> str | None:
    """A vision-language model trains through its SFT procedure with the keys it has (docs/vision.md); the vision
    keys need one."""
    recipe = context.recipe
    try:  # a shipped config's hub model: its published config, so that a login node checks it before any download
        config = known_model_config(recipe.model_name_or_path, recipe.trust_remote_code)
    except (OSError, ValueError):
        return None  # not here yet, or refused by `_model_config_is_a_causal_lm`
    name = recipe.model_name_or_path
    if not is_vision_config(config):
        asked = next((key for key in VISION_ONLY_KEYS if getattr(recipe, key)), None)
        return asked and f"{asked}: {name} is not a vision-language model (it has no vision tower); remove {asked}"
    if context.procedure.through_trl:
        return (
            f"model_name_or_path: {name} is a vision-language model; its preference and GRPO recipes are not built "
            "yet: fine-tune it with recipes/qwen_vl_lora.py or recipes/gemma3_vl_lora.py (docs/vision.md)"
        )
    if low_memory_loading_requested(context.training):
        return (
            f"fsdp_cpu_ram_efficient_loading: low-memory loading of the vision-language model {name} is not built "
            "(hub checkpoints name their tensors otherwise than the model): set it false (docs/vision.md)"
        )
    if context.fsdp is not None and context.fsdp.version == 1:
        return (
            f"fsdp: {name} is a vision-language model; under FSDP1 its embeddings are a unit of their own, and "
            "generate (which runs the vision tower before them) would gather units in another order on a rank "
            "without images: use FSDP2 (configs/accelerate/cpu_fsdp2.yaml, fsdp2.yaml)"
        )
    for key, default in TEXT_ONLY_KEYS:
        if getattr(recipe, key) != default and not (default is None and not getattr(recipe, key)):
            return (
                f"{key}: {getattr(recipe, key)} is not available for the vision-language model {name}; remove it "
                f"(default {default!r}; docs/vision.md says what its recipes read)"
            )
    return None


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _gather_budget_is_a_size(context: RuleContext) -> str | None:
    recipe = context.recipe
    if str(recipe.generate_gather_budget).strip().lower() in ("auto", "all", "none"):
        return None
    try:
        parse_size(recipe.generate_gather_budget, "generate_gather_budget")
    except ConfigError:
        return f"generate_gather_budget: '{recipe.generate_gather_budget}' is not {GATHER_BUDGET_HELP}"
    return None


def _compiled_decoding_is_a_choice(context: RuleContext) -> str | None:
    value = context.recipe.generate_compiled
    if value in COMPILED_CHOICES:
        return None
    return f"generate_compiled: '{value}' is not {COMPILED_DECODING_HELP}"


def _device_memory_is_a_size(context: RuleContext) -> str | None:
    value = context.recipe.device_memory
    if str(value).strip().lower() == "auto":
        return None
    try:
        parse_size(value, "device_memory")
    except ConfigError:
        return f"device_memory: '{value}' is not auto or a size like 20GiB (the memory of one device)"
    return None


def _compile_where_it_is_tested(context: RuleContext) -> str | None:
    if not context.recipe.compile:
        return None
    if context.training.get("torch_compile"):
        return "compile: true compiles each layer; torch_compile: true compiles the whole model again: keep one"
    if context.recipe.sequence_parallel_size > 1:
        return (
            f"compile: true with sequence_parallel_size {context.recipe.sequence_parallel_size}: the split's "
            "all-to-all inside each layer is not compiled yet; set compile: false"
        )
    if on_xla():
        return "compile: true on XLA: XLA compiles the whole step already; set compile: false"
    if experts_adapted(context.recipe):
        return (
            "compile: true with LoRA on the experts (lora_target_parameters): peft adds and removes a "
            "parametrization in each forward, which torch.compile cannot trace; set compile: false"
        )
    return None


def _kernels_run_here(context: RuleContext) -> str | None:
    recipe = context.recipe
    try:
        config = known_model_config(recipe.model_name_or_path, recipe.trust_remote_code)
    except (OSError, ValueError):
        config = None  # not here yet, or refused by `_model_config_is_a_causal_lm`
    return kernels_problem(recipe, context.training, context.procedure.through_trl, config)


def _fsdp_needs_several_processes(context: RuleContext) -> str | None:
    settings = context.fsdp
    if settings is not None and "recipe" in settings.route and ranks().world_size < 2:
        return (
            "fsdp: set in the config, but this is a single process; launch with "
            "`accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml ...` (or a GPU config), "
            "or remove fsdp/fsdp_config"
        )
    return None


def _one_activation_checkpointing(context: RuleContext) -> str | None:
    training = context.training
    settings = context.fsdp
    for key in CHECKPOINTING_KEYS:  # auto leaves it to FSDP's own (fsdp_peft.settings.checkpointing)
        if settings and settings.activation_checkpointing and training.get(key) is True:
            return (
                f"{key}: true together with FSDP's own activation_checkpointing checkpoints every "
                f"layer twice (and Trainer refuses it late); keep one: set {key}: false"
            )
    return None


def _hybrid_shard_shards_in_the_cpu_mode(context: RuleContext) -> str | None:
    settings = context.fsdp
    cpu_mode = not torch.accelerator.is_available()
    if settings and settings.version == 1 and settings.reshard_after_forward.startswith("hybrid") and cpu_mode:
        return (
            f"fsdp: {settings.reshard_after_forward} under FSDP1 shards within a node by its GPU count; in the CPU "
            "mode every rank would keep a full copy (measured: 0 parameters sharded); use full_shard"
        )
    return None


BNB_KEYS = ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage")


def _prequantized_base_is_trainable(context: RuleContext) -> str | None:
    recipe = context.recipe
    saved = checkpoint_quantization(recipe.model_name_or_path)
    if not saved:
        return None
    name, method = recipe.model_name_or_path, saved.get("quant_method")
    if method != "bitsandbytes" or not saved.get("load_in_4bit"):
        kind = "8-bit bitsandbytes" if method == "bitsandbytes" else f"{method}-quantized"
        return (
            f"model_name_or_path: {name} is a {kind} checkpoint; fsdp-peft trains on 16-bit bases or bitsandbytes "
            "4-bit ones: point it at the 16-bit original (with load_in_4bit: true for QLoRA)"
        )
    if not recipe.load_in_4bit:
        return (
            f"model_name_or_path: {name} is a pre-quantized bitsandbytes 4-bit checkpoint; set load_in_4bit: true "
            "(or point it at the 16-bit original for LoRA)"
        )
    storage = str(saved.get("bnb_4bit_quant_storage", "uint8")).removeprefix("torch.")
    if storage not in DTYPES and context.fsdp_in_use:
        return (
            f"model_name_or_path: {name} stores its 4-bit weights as {storage}, which FSDP cannot shard; quantize "
            "the 16-bit original on load instead (model_name_or_path: the original, load_in_4bit: true)"
        )
    for key in BNB_KEYS:
        want = str(saved.get(key, "")).removeprefix("torch.")
        if want and str(getattr(recipe, key)) != want:
            return (
                f"{key}: '{getattr(recipe, key)}' differs from the pre-quantized checkpoint {name} ('{want}'), "
                f"whose own settings transformers uses; set {key}: {want}"
            )
    settings = context.fsdp
    if settings and settings.cpu_ram_efficient_loading:
        return (
            f"cpu_ram_efficient_loading: low-memory loading quantizes a 16-bit checkpoint as it reads it, and "
            f"{name} is already 4-bit; set cpu_ram_efficient_loading: false"
        )
    return None


def _save_only_model_needs_full_state_dict(context: RuleContext) -> str | None:
    training = context.training
    settings = context.fsdp
    if settings and training.get("save_only_model") and "SHARDED" in settings.state_dict_type:
        return (
            "save_only_model: true cannot be resumed from with FSDP's SHARDED_STATE_DICT (Trainer refuses it); "
            "set save_only_model: false, or state_dict_type FULL_STATE_DICT"
        )
    return None


def _fsdp1_units_keep_adapters_apart(context: RuleContext) -> str | None:
    settings = context.fsdp
    if settings and settings.version == 1 and settings.auto_wrap_policy == "SIZE_BASED_WRAP":
        mixing = "" if settings.use_orig_params else " with use_orig_params: false"
        return (
            f"auto_wrap_policy: {settings.auto_wrap_policy} under FSDP1{mixing} would put frozen base weights and "
            "trainable adapters (of different dtypes) in one flat parameter; set auto_wrap_policy: "
            "TRANSFORMER_BASED_WRAP, which gives decoder layers and adapter leaves units of their own"
        )
    return None


def _save_strategy(training: dict) -> str:
    """``save_strategy`` as Trainer reads it (default ``steps``), lower case."""
    return str(training.get("save_strategy") or "steps").lower().removeprefix("savestrategy.")


def _fsdp2_size_based_wrap_shards_no_layer(context: RuleContext) -> str | None:
    settings = context.fsdp
    if settings and settings.version == 2 and settings.auto_wrap_policy == "SIZE_BASED_WRAP":
        return (
            "auto_wrap_policy: SIZE_BASED_WRAP under FSDP2: accelerate 1.15 shards every module above min_num_params, "
            "the decoder layers' ModuleList included, which fully_shard refuses (measured: ValueError), and below "
            "that no layer gets a unit; set auto_wrap_policy: TRANSFORMER_BASED_WRAP (one unit per decoder layer)"
        )
    return None


def _fsdp1_checkpoints_are_sharded(context: RuleContext) -> str | None:
    training = context.training
    settings = context.fsdp
    strategy = _save_strategy(training)
    if settings and settings.version == 1 and strategy != "no" and "SHARDED" not in settings.state_dict_type:
        return (
            f"save_strategy: '{strategy}' under FSDP1 with state_dict_type {settings.state_dict_type}: fsdp-peft "
            "saves and resumes FSDP1 checkpoints of adapters only as sharded state; set "
            "fsdp_state_dict_type: SHARDED_STATE_DICT (as configs/accelerate/fsdp1.yaml does), or save_strategy: 'no'"
        )
    return None


def _offload_needs_a_cpu_optimizer(context: RuleContext) -> str | None:
    training = context.training
    settings = context.fsdp
    optimizer = str(training.get("optim") or "adamw_torch")
    if settings and settings.offload_params and any(mark in optimizer for mark in GPU_ONLY_OPTIMIZER_MARKS):
        return (
            f"optim: '{optimizer}' steps on the GPU, but FSDP offload_params keeps parameters and gradients on the "
            "CPU; use optim: adamw_torch (or turn offloading off)"
        )
    return None


def _cpu_mode_cannot_load_on_rank_0_only(context: RuleContext) -> str | None:
    settings = context.fsdp
    cpu_mode = not torch.accelerator.is_available()
    if settings and settings.version == 1 and settings.cpu_ram_efficient_loading and cpu_mode:
        return (
            "cpu_ram_efficient_loading needs FSDP1's sync_module_states, which FSDP1 refuses for CPU tensors; "
            "in the CPU mode set cpu_ram_efficient_loading: false (or use FSDP2)"
        )
    return None


def _checkpoints_are_finished_by_one_rank(context: RuleContext) -> str | None:
    training = context.training
    strategy = _save_strategy(training)
    if context.fsdp_in_use and truthy(training.get("save_on_each_node", False)) and strategy != "no":
        return (
            "save_on_each_node: true with FSDP checkpoints: every rank writes its shard into one checkpoint "
            "directory and one rank completes it, so the first rank of each node would complete it too (they "
            "collide on a shared filesystem; on node-local disks no node holds a whole checkpoint); set "
            "save_on_each_node: false and put output_dir on a filesystem all nodes share"
        )
    return None


PARALLELISM_SIZES = ("DP_REPLICATE", "DP_SHARD", "TP", "CP", "SP")


def _parallelism_config_fills_the_launch(context: RuleContext) -> str | None:
    env = os.environ
    if env.get(USE_PARALLELISM_CONFIG, "false").lower() != "true" or "WORLD_SIZE" not in env:
        return None
    sizes = {name.lower(): int(env.get(f"PARALLELISM_CONFIG_{name}_SIZE", "1")) for name in PARALLELISM_SIZES}
    product = math.prod(sizes.values())
    world = int(env["WORLD_SIZE"])
    if product != world:
        named = " x ".join(f"{name}_size {size}" for name, size in sizes.items() if size > 1 or name.startswith("dp"))
        return (
            f"parallelism_config: {named} = {product} ranks, but this launch has {world} (num_processes); "
            "for HSDP set parallelism_config_dp_replicate_size to the number of nodes and "
            "parallelism_config_dp_shard_size to the processes per node"
        )
    return None


@functools.cache
def trl_loss_types(config_name: str) -> tuple[str, ...]:
    """The ``loss_type`` values the installed TRL's ``config_name`` (``DPOConfig``, ``KTOConfig``, ``GRPOConfig``)
    declares: the quoted names of its field's help ("Possible values are ..."), else the items its class docstring
    lists under ``loss_type`` (KTO's). Read from TRL, not copied from one release; a release that words them another
    way fails loudly here rather than refusing every loss."""
    import trl  # lazy: TRL takes seconds to import, and only the preference and GRPO recipes' rules read it

    config = getattr(trl, config_name)
    help_text = next(f for f in dataclasses.fields(config) if f.name == "loss_type").metadata.get("help", "")
    listed = re.search(r"values are:?(.*?)\.(?:\s|$)", help_text, re.S)
    values = re.findall(r"'(\w+)'", listed[1]) if listed else []
    if not values:
        doc = config.__doc__ or ""
        entry = doc[doc.find("loss_type (") :] if "loss_type (" in doc else ""
        values = re.findall(r'- `"(\w+)"`', re.split(r"\n\s*\n\s*\w+ \(`", entry, maxsplit=1)[0])
    if not values:
        raise RuntimeError(
            f"trl {trl.__version__}: the values of {config_name}.loss_type are neither in its help nor in its "
            "docstring's list; fsdp_peft.tools.validation.trl_loss_types must learn where this release keeps them"
        )
    return tuple(dict.fromkeys(values))


def _reference_is_the_adapter_disabled_model(context: RuleContext) -> str | None:
    recipe = context.recipe
    if recipe.ref_model:
        return (
            f"ref_model: {recipe.ref_model} would hold a second model beside the LoRA policy; remove it: the reference "
            "is the same sharded model with its adapter disabled (no second copy)"
        )
    return None


def _trl_recipes_run_off_xla(context: RuleContext) -> str | None:
    """The TPU route (`fsdp_peft.core.xla`) is built and tested for the recipes that train through the recipes' own
    Trainer only."""
    if on_xla():
        return (
            f"{DEVICE_VARIABLE}={os.environ[DEVICE_VARIABLE]}: the preference and GRPO recipes do not run on XLA (TPU) "
            "yet; run them on GPUs or CPUs (unset PJRT_DEVICE), or use a LoRA SFT recipe on TPU (docs/tpu.md)"
        )
    return None


def _trl_recipes_run_without_eva(context: RuleContext) -> str | None:
    recipe = context.recipe
    if recipe.init_lora_weights == "eva":
        return (
            "init_lora_weights: eva: its data pass (fsdp_peft.procedures.eva) reads SFT batches and the preference and "
            "GRPO recipes do not run it; use init_lora_weights: default (or another init), or an SFT recipe for EVA"
        )
    return None


def _xla_route_can_run(context: RuleContext) -> str | None:
    """On XLA (``PJRT_DEVICE`` set): LoRA only, no EVA, no harness tasks, the XLA FSDP keys only (no accelerate
    FSDP), torch_xla installed."""
    recipe, training = context.recipe, context.training
    if not on_xla():
        return None
    device = f"PJRT_DEVICE={os.environ[DEVICE_VARIABLE]}"
    if recipe.load_in_4bit:
        return (
            f"load_in_4bit: true on XLA ({device}): bitsandbytes has no XLA backend, so QLoRA cannot run on TPU; "
            "use a LoRA recipe (load_in_4bit: false), e.g. configs/llama_lora/tpu_v5e_8.yaml"
        )
    if recipe.init_lora_weights == "eva":  # fsdp_peft.procedures.eva: its pass is many small SVDs between forwards
        return f"init_lora_weights: eva on XLA ({device}): its data pass is built for CPUs and GPUs; use another init"
    if recipe.eval_tasks or recipe.eval_tasks_steps:  # fsdp_peft.tools.evaluation: built and tested on CPUs and GPUs
        return (
            f'eval_tasks: the harness does not run on XLA ({device}) yet; train without it (--eval_tasks "" '
            "--eval_tasks_steps 0) and evaluate the exported model with fsdp-peft eval on GPUs or CPUs (docs/eval.md)"
        )
    on, options = _fsdp_options(training.get("fsdp"))
    gpu_only = [o for o in options if o == "offload"] + (
        gpu_only_fsdp_keys(_read_fsdp_config(training.get("fsdp_config"))) if on else []
    )
    if gpu_only or launcher_asks_for_fsdp():
        named = f"fsdp_config: {gpu_only[0]}" if gpu_only else "accelerate config: distributed_type FSDP"
        return (
            f"{named}: torch FSDP (GPU) setting on XLA ({device}); the XLA route takes fsdp: true with "
            "xla_fsdp_v2, xla_fsdp_grad_ckpt, xla_fsdp_settings, transformer_layer_cls_to_wrap, min_num_params "
            "(docs/tpu.md); run the recipe with python, without accelerate launch"
        )
    if not torch_xla_installed():
        return (
            f"{device}: set, but torch_xla is not installed in this environment; use the TPU environment "
            "(requirements-tpu.txt, docs/tpu.md) or unset PJRT_DEVICE"
        )
    return None


def _attention_kernel_runs_here(context: RuleContext) -> str | None:
    recipe = context.recipe
    return attention_problem(recipe.attn_implementation)


def _architecture_has_the_attention_kernel(context: RuleContext) -> str | None:
    recipe = context.recipe
    model_class = model_class_named(recipe.model_name_or_path, recipe.trust_remote_code)
    return architecture_problem(recipe.attn_implementation, model_class)  # unknown class: transformers chooses


def _eval_tasks_are_harness_tasks(context: RuleContext) -> str | None:
    recipe = context.recipe
    if not recipe.eval_tasks:
        if recipe.eval_tasks_steps > 0:  # below 0: the key's range says so
            return (
                f"eval_tasks_steps: {recipe.eval_tasks_steps} but eval_tasks names no task; name the harness tasks "
                "to run (eval_tasks: [tiny_reverse]) or set eval_tasks_steps: 0"
            )
        return None
    from fsdp_peft.tools.eval_tasks import eval_tasks_problem  # lazy: the harness only for a config that names tasks

    return eval_tasks_problem(recipe.eval_tasks, ranks().world_size)


def every(procedure) -> bool:
    """The guard of a rule every procedure runs."""
    return True


def through_trl(procedure) -> bool:
    """The guard of a rule of the procedures that train through TRL's trainers."""
    return procedure.through_trl


def through_the_recipes_trainer(procedure) -> bool:
    """The guard of a rule of the procedures that train through the recipes' own Trainer (SFT)."""
    return not procedure.through_trl


def _keys_are_the_procedures(context: RuleContext) -> str | None:
    """A key that only other procedures read (``Procedure.keys``), set in this one's config, would be ignored: the
    config belongs to another recipe."""
    recipe, procedure = context.recipe, context.procedure
    set_here = keys_set(dataclasses.asdict(recipe))
    foreign = {
        key: [other.about for other in context.others if key in other.keys]
        for other in context.others
        for key in other.keys
        if key not in procedure.keys and key in set_here
    }
    if not foreign:
        return None
    readers = " or ".join(dict.fromkeys(about for abouts in foreign.values() for about in abouts))
    first = next(iter(foreign))
    named = ", ".join(foreign) if len(foreign) > 1 else f"{first}: {getattr(recipe, first)!r}"
    return (
        f"{named}: read by the {readers} recipes only, and this recipe trains {procedure.about}; launch a {readers} "
        f"recipe with this config (`fsdp-peft ls`), or remove {'them' if len(foreign) > 1 else 'it'}"
    )


# Every shared rule, with its guard, in the order its problems are reported.
RULES: dict[Callable, Callable[[object], bool]] = {
    _keys_are_the_procedures: every,
    _fsdp_settings_resolve: every,
    _dtype_keys_are_known: every,
    _quant_storage_is_floating_under_fsdp: every,
    _quant_storage_matches_gather_dtype: every,
    _data_files_exist: every,
    _data_settings_are_known: every,
    _output_dir_can_hold_the_run: every,
    _local_model_path_exists: every,
    _model_name_is_known: every,
    _model_config_is_a_causal_lm: every,
    _gather_budget_is_a_size: every,
    _device_memory_is_a_size: every,
    _compiled_decoding_is_a_choice: every,
    _compile_where_it_is_tested: every,
    _kernels_run_here: every,
    _fsdp_needs_several_processes: every,
    _one_activation_checkpointing: every,
    _hybrid_shard_shards_in_the_cpu_mode: every,
    _prequantized_base_is_trainable: every,
    _save_only_model_needs_full_state_dict: every,
    _fsdp1_units_keep_adapters_apart: every,
    _fsdp2_size_based_wrap_shards_no_layer: every,
    _fsdp1_checkpoints_are_sharded: every,
    _offload_needs_a_cpu_optimizer: every,
    _cpu_mode_cannot_load_on_rank_0_only: every,
    _checkpoints_are_finished_by_one_rank: every,
    _parallelism_config_fills_the_launch: every,
    _reference_is_the_adapter_disabled_model: through_trl,
    _trl_recipes_run_off_xla: through_trl,
    _trl_recipes_run_without_eva: through_trl,
    _xla_route_can_run: through_the_recipes_trainer,  # the TRL recipes refuse XLA outright
    variant_keys_are_known: every,
    eva_keeps_the_configured_ranks: every,
    eva_initialises_linear_layers_only: every,
    eva_forwards_the_loaded_model_before_sharding: every,
    init_from_base_weights_needs_the_full_precision_base: every,
    trainable_tokens_and_their_embedding_copy_exclude_each_other: every,
    fsdp1_keeps_tied_embeddings_in_the_root: every,
    new_special_tokens_are_new: every,
    new_tokens_train_as_trainable_tokens: every,
    expert_adapters_have_no_dropout: every,
    expert_adapters_are_plain_lora: every,
    expert_adapters_run_under_fsdp2: every,
    moe_keys_need_a_mixture_of_experts: every,
    moe_targets_reach_the_experts: every,
    _attention_kernel_runs_here: every,
    _architecture_has_the_attention_kernel: every,
    _eval_tasks_are_harness_tasks: every,
    sequence_split_runs_here: every,
    sequence_split_fits_the_model: every,
    sequence_split_keeps_the_models_loss: every,
    packed_rows_keep_their_order: every,
    _vision_keys_fit_the_model: every,
}


def config_problems(recipe, training: dict, procedure, others: tuple = ()) -> list[str]:
    """All problems found by the shared rules whose guard takes ``procedure`` (a
    `fsdp_peft.procedures.procedure.Procedure`), then by its own, in order, from one context; ``others``: the other
    procedures (`fsdp_peft.procedures.registry`), whose keys this one's config must not set."""
    context = rule_context(recipe, training, procedure, others)
    rules = [rule for rule, guard in RULES.items() if guard(procedure)] + list(procedure.rules)
    return [problem for rule in rules if (problem := rule(context))]


def model_structure_problems(recipe) -> list[str]:
    """Problems with the model's architecture (LoRA targets, decoder layers), found on a weightless copy
    built on the meta device from its config; none when the config is not on this machine."""
    name = recipe.model_name_or_path
    try:
        config = local_model_config(name, recipe.trust_remote_code)
    except (OSError, ValueError):
        return []  # not downloaded yet, or refused by `_model_config_is_a_causal_lm`
    try:
        with torch.device("meta"):
            model = auto_model_class(config).from_config(config, trust_remote_code=recipe.trust_remote_code)
    except ValueError:
        return []  # not a causal LM: `_model_config_is_a_causal_lm` says so
    problems = []
    targets = lora_targets(recipe.lora_target_modules, family_for(config.model_type))
    if targets != "all-linear":
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n, _ in model.named_modules())]
        if missing:
            problems.append(
                f"lora_target_modules: {missing} name no module of {name} ({config.model_type}); its linear "
                f"layers are {linear}: use those names, all-linear, or auto (the family's default)"
            )
    try:
        decoder_layer_classes(model)
    except ValueError as error:
        problems.append(f"{name}: {error}; name its decoder layer class in the accelerate config")
    return problems


def data_row_problems(recipe, procedure) -> list[str]:
    """Problems with the local data's rows, found the way the launch's data step finds them (`read_source`, and for
    text SFT every row parsed as its format, bad rows counted under ``skip_invalid_rows``); hub datasets are read by
    the launch only."""
    try:
        sources = [source for source in data_sources(recipe) if source is not None and not source.hub]
    except ConfigError as error:
        return [str(error)]
    except OSError:
        return []  # a path that does not exist: `_data_files_exist` says so
    try:
        vision = is_vision_config(known_model_config(recipe.model_name_or_path, recipe.trust_remote_code))
    except (OSError, ValueError):
        vision = False
    problems = []
    for source in sources:
        try:
            if procedure.through_trl or vision:  # their rows are checked by their own readers at launch
                read_source(source)
                continue
            examples, dropped = source_examples(source, recipe.data_format, recipe.skip_invalid_rows)
            if not examples:
                problems.append(nothing_left_to_train_on(source, dropped))
        except ConfigError as error:
            problems.append(str(error))
    return problems


def _at_their_defaults(recipe, training: dict, keys: list[str]):
    """``recipe`` and ``training`` with ``keys`` at the values they take when no config sets them."""
    fields = {field.name for field in dataclasses.fields(recipe)}
    recipe = dataclasses.replace(recipe, **{key: getattr(type(recipe)(), key) for key in keys if key in fields})
    unset = unset_training_values()
    return recipe, {key: unset.get(key) if key in keys else value for key, value in training.items()}


def check_before_training(
    recipe, training: dict, procedure, with_model_structure: bool = False, others: tuple = ()
) -> None:
    """Raise one `ConfigError` listing every problem of a ``procedure`` run (one per line; ``others``: as for
    `config_problems`); ``with_model_structure``
    (``fsdp-peft validate``) also checks the model's architecture (`model_structure_problems`) and the data's rows
    (`data_row_problems`), which the launch checks in its own steps.

    Wrong types come first; the rules, which combine keys and assume well-typed ones, then see those keys at their
    defaults, so that every other problem is listed with them. Values out of range or choice follow.
    """
    values, hints = {**dataclasses.asdict(recipe), **training}, field_types(type(recipe), TrainingArguments)
    typed, ill_typed = type_problems(values, hints), ill_typed_keys(values, hints)
    if ill_typed:
        recipe, training = _at_their_defaults(recipe, training, ill_typed)
        values = {**dataclasses.asdict(recipe), **training}
    problems = value_problems(values, hints) + config_problems(recipe, training, procedure, others)
    problems += model_structure_problems(recipe) + data_row_problems(recipe, procedure) if with_model_structure else []
    # an ill-typed key's type line speaks for it: what the rules say of its default is not the user's problem
    problems = typed + [problem for problem in problems if problem.split(":", 1)[0] not in ill_typed]
    if problems:
        raise ConfigError("\n       ".join(problems))
