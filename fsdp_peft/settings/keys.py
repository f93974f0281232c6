"""Type, range and choice of every config key, checked the same way wherever the value came from.

A recipe config holds the project's keys (`fsdp_peft.settings.config.RecipeArguments`) and every
``TrainingArguments`` field. YAML hands values over as it parsed them and the command line as argparse
converted them, so each value is checked here against its field's type, its numeric range and, for
enumerated keys, the values the installed libraries accept (with the closest one suggested).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from enum import Enum
from typing import Any, Callable, Union

from transformers import HfArgumentParser, TrainingArguments
from transformers.trainer_utils import HubStrategy, IntervalStrategy, SaveStrategy, SchedulerType
from transformers.training_args import OptimizerNames

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.settings.checkpointing import AUTO, CHECKPOINTING_KEYS
from fsdp_peft.settings.choices import KERNELS
from fsdp_peft.settings.four_bit import QUANT_TYPES, STORAGE_DTYPES

# `fsdp_peft.settings.fsdp_settings` reads the FSDP keys
SKIPPED_TYPE_CHECK = ("fsdp", "fsdp_config", "parallelism_config")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "passive")

CHOICES: dict[str, tuple[str, ...]] = {
    "lr_scheduler_type": tuple(e.value for e in SchedulerType),
    "optim": tuple(e.value for e in OptimizerNames),
    "eval_strategy": tuple(e.value for e in IntervalStrategy),
    "logging_strategy": tuple(e.value for e in IntervalStrategy),
    "save_strategy": tuple(e.value for e in SaveStrategy),
    "hub_strategy": tuple(e.value for e in HubStrategy),
    "log_level": LOG_LEVELS,
    "log_level_replica": LOG_LEVELS,
    "bnb_4bit_quant_type": QUANT_TYPES,
    "bnb_4bit_quant_storage": STORAGE_DTYPES,
    "kernels": KERNELS,
}


def _at_least(bound: float, words: str = "") -> tuple[Callable[[float], bool], str]:
    return (lambda v: v >= bound), words or f"at least {bound:g}"


def _above(bound: float, words: str = "") -> tuple[Callable[[float], bool], str]:
    return (lambda v: v > bound), words or f"above {bound:g}"


def _fraction(closed_top: bool = False) -> tuple[Callable[[float], bool], str]:
    if closed_top:
        return (lambda v: 0 <= v <= 1), "in [0, 1]"
    return (lambda v: 0 <= v < 1), "in [0, 1)"


RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "lora_r": _above(0, "positive"),
    "max_seq_length": _above(0, "positive"),
    "generate_max_new_tokens": _above(0, "positive"),
    "generate_batch_size": _above(0, "positive"),
    "generate_samples": _at_least(0, "0 (no generation) or more"),
    "generate_eval_samples": _at_least(0, "0 (no generation) or more"),
    "max_eval_samples": _at_least(0, "0 (every held-out row) or more"),
    "eval_tasks_steps": _at_least(0, "0 (at the end only) or more"),
    "lora_alpha": _above(0),
    "lora_dropout": _fraction(),
    "loss_chunk_tokens": _at_least(0),
    "sequence_parallel_size": _at_least(1),
    "per_device_train_batch_size": _at_least(1),
    "per_device_eval_batch_size": _at_least(1),
    "gradient_accumulation_steps": _at_least(1),
    "max_steps": ((lambda v: v == -1 or v >= 1), "-1 (train num_train_epochs) or at least 1"),
    "num_train_epochs": _above(0),
    "learning_rate": _above(0),
    "warmup_steps": _at_least(0),
    "weight_decay": _at_least(0),
    "adam_beta1": _fraction(),
    "adam_beta2": _fraction(),
    "adam_epsilon": _above(0),
    "max_grad_norm": _at_least(0),
    "label_smoothing_factor": _fraction(),
    "logging_steps": _above(0),
    "save_steps": _above(0),
    "eval_steps": _above(0),
    "eval_delay": _at_least(0),
    "save_total_limit": _at_least(1),
    "seed": _at_least(0),
    "data_seed": _at_least(0),
    "dataloader_num_workers": _at_least(0),
    "dataloader_prefetch_factor": _at_least(1),
    "eval_accumulation_steps": _at_least(1),
    "torch_empty_cache_steps": _at_least(1),
    "neftune_noise_alpha": _above(0),
    "ddp_timeout": _at_least(1),
    "beta": _at_least(0),
    "num_generations": _at_least(2, "at least 2 (GRPO compares completions of one prompt)"),
    "max_completion_length": _above(0, "positive"),
    "temperature": _above(0),
    "top_p": ((lambda v: 0 < v <= 1), "in (0, 1]"),
    "top_k": _at_least(0),
    "min_p": ((lambda v: 0 <= v <= 1), "in [0, 1]"),
    "repetition_penalty": _above(0),
    "steps_per_generation": _at_least(1),
    "num_iterations": _at_least(1),
    "epsilon": _above(0),
    "epsilon_high": _above(0),
    "eva_rho": _at_least(1),
}
# Keys whose empty value (``""`` or ``[]``) no run can use, and the fix (an unset key takes its default instead).
NOT_EMPTY = {
    "model_name_or_path": "name a hub id, a local model directory or an embedded model (tiny-llama)",
    "output_dir": "name a directory (or remove the key for outputs/<recipe>)",
    "dataset_train_split": "name the split to train on (or remove the key for train)",
    "dataset_eval_split": "name a split (or remove the key: no evaluation split)",
    "dataset_config": "name the dataset's configuration (or remove the key for its default)",
    "lora_target_modules": "name the modules to adapt, or all-linear, or auto (the family's)",
    "report_to": "use none for no logging integration",
}
RANGE_HINTS = {
    "learning_rate": "e.g. 2e-4 for LoRA",
    "max_steps": "or remove it to train num_train_epochs",
    "lora_dropout": "e.g. 0.05",
    "loss_chunk_tokens": "0 turns the chunked loss off",
    "warmup_steps": "a step count, or a fraction of the steps below 1",
}


def field_types(*classes) -> dict[str, Any]:
    """``{key: type hint}`` of the init fields of the given dataclasses."""
    hints: dict[str, Any] = {}
    for cls in classes:
        resolved = typing.get_type_hints(cls)
        hints.update({f.name: resolved[f.name] for f in dataclasses.fields(cls) if f.init})
    # `auto` besides true/false: fsdp_peft.settings.checkpointing resolves it before the Trainer
    for key in CHECKPOINTING_KEYS:
        if key in hints:
            hints[key] = hints[key] | typing.Literal[AUTO]
    return hints


def _arms(hint) -> tuple:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _matches(value, hint) -> bool:
    """Whether ``value`` is acceptable for a field typed ``hint`` (lenient where argparse or the Trainer convert)."""
    for arm in _arms(hint):
        origin = typing.get_origin(arm)
        if arm is Any or arm is typing.Any:
            return True
        if arm is type(None):
            if value is None:
                return True
        elif arm is bool:
            if isinstance(value, bool):
                return True
        elif arm is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return True
        elif arm is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return True
        elif arm is str:
            if isinstance(value, str):
                return True
        elif isinstance(arm, type) and issubclass(arm, Enum):
            if isinstance(value, (str, arm)):
                return True
        elif origin is list:
            (item,) = typing.get_args(arm) or (Any,)
            if isinstance(value, list) and all(_matches(v, item) for v in value):
                return True
        elif origin is dict or arm is dict:
            if isinstance(value, dict):
                return True
        elif origin is typing.Literal:
            if value in typing.get_args(arm):
                return True
        else:
            return True  # a class argparse cannot produce (e.g. ParallelismConfig): left to its owner
    return False


def _describe_type(hint) -> str:
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "a string", type(None): "nothing"}
    parts = []
    for arm in _arms(hint):
        if typing.get_origin(arm) is list:
            parts.append("a list")
        elif typing.get_origin(arm) is dict or arm is dict:
            parts.append("a mapping")
        elif isinstance(arm, type) and issubclass(arm, Enum):
            parts.append("one of its names")
        elif typing.get_origin(arm) is typing.Literal:
            parts.append(" or ".join(repr(v) for v in typing.get_args(arm)))
        else:
            parts.append(names.get(arm, getattr(arm, "__name__", str(arm))))
    return " or ".join(dict.fromkeys(parts))


def plain_value(value):
    """A value as YAML writes it: enums by their value."""
    return value.value if isinstance(value, Enum) else value


@functools.cache
def _unset_training_keys() -> frozenset[str]:
    """``TrainingArguments`` keys the argument parser leaves ``None`` when not given (the Trainer fills them)."""
    defaults = vars(HfArgumentParser(TrainingArguments).parse_args([]))
    return frozenset(key for key, value in defaults.items() if value is None)


def key_problems(values: dict, hints: dict[str, Any]) -> list[str]:
    """One message per key whose value has the wrong type, is out of range, or is not an accepted choice."""
    return type_problems(values, hints) + value_problems(values, hints)


def _checked_keys(values: dict, hints: dict[str, Any]):
    for key, value in values.items():
        hint = hints.get(key)
        if hint is None or key in SKIPPED_TYPE_CHECK or (value is None and key in _unset_training_keys()):
            continue
        yield key, value, hint


def ill_typed_keys(values: dict, hints: dict[str, Any]) -> list[str]:
    """The keys whose value has the wrong type (`type_problems` says how)."""
    return [key for key, value, hint in _checked_keys(values, hints) if not _matches(value, hint)]


def type_problems(values: dict, hints: dict[str, Any]) -> list[str]:
    """One message per key whose value has the wrong type: what every later check assumes away."""
    problems = []
    for key, value, hint in _checked_keys(values, hints):
        if not _matches(value, hint):
            shown = "nothing (an empty value)" if value is None else f"{value!r} ({type(value).__name__})"
            problems.append(f"{key}: expected {_describe_type(hint)}, got {shown}")
    return problems


def value_problems(values: dict, hints: dict[str, Any]) -> list[str]:
    """One message per well-typed key whose value is empty where it must not be, out of range, or not a choice."""
    problems = []
    for key, value, hint in _checked_keys(values, hints):
        if not _matches(value, hint):
            continue  # a type problem
        if key in NOT_EMPTY and (value == "" or isinstance(value, list) and all(item == "" for item in value)):
            problems.append(f"{key}: empty; {NOT_EMPTY[key]}")
            continue
        if key in RANGES and isinstance(value, (int, float)) and not isinstance(value, bool):
            accepts, rule = RANGES[key]
            if not math.isfinite(value) or not accepts(value):
                hint_text = f" ({RANGE_HINTS[key]})" if key in RANGE_HINTS else ""
                problems.append(f"{key}: must be {rule}, got {value}{hint_text}")
        if key in CHOICES and value is not None:
            choice = str(plain_value(value))
            if choice not in CHOICES[key]:
                problems.append(unknown_choice(key, choice, CHOICES[key]))
    return problems


def unknown_choice(key: str, value: str, choices: tuple[str, ...]) -> str:
    """``key: 'value' is not one of ...; did you mean ...?`` (the list shortened when long)."""
    close = difflib.get_close_matches(str(value).lower(), choices, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    listed = ", ".join(choices) if len(choices) <= 12 else ", ".join(choices[:12]) + f", ... ({len(choices)} in all)"
    return f"{key}: '{value}' is not one of {listed}{hint}"


def training_field_types() -> dict[str, Any]:
    """The type hints of every ``TrainingArguments`` key."""
    return field_types(TrainingArguments)


def check_keys(recipe, training: dict) -> None:
    """Raise one `ConfigError` listing every key of wrong type, range or choice (one per line): what a command
    that reads the config without running it (``fsdp-peft plan``) checks."""
    values = {**dataclasses.asdict(recipe), **training}
    if problems := key_problems(values, field_types(type(recipe), TrainingArguments)):
        raise ConfigError("\n       ".join(problems))
