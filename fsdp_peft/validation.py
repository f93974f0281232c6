"""Every rule a recipe config must satisfy, checked before any process group, model or data is touched.

Each rule is a small function returning a problem message (key, value, rule, fix) or ``None``;
`check_before_training` runs them all and reports every problem at once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from fsdp_peft.errors import ConfigError
from fsdp_peft.tiny import TINY_DATASET_NAME

FLOATING_DTYPES = ("float32", "bfloat16", "float16")


def fsdp_in_use(training: dict) -> bool:
    """FSDP is on when the YAML sets ``fsdp`` or the accelerate launcher's config says FSDP."""
    return bool(training.get("fsdp")) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def mixed_precision_dtype(training: dict) -> str | None:
    """The autocast / FSDP parameter dtype from ``bf16``/``fp16`` or the launcher's ``mixed_precision``."""
    if training.get("bf16"):
        return "bfloat16"
    if training.get("fp16"):
        return "float16"
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    return {"bf16": "bfloat16", "fp16": "float16"}.get(launcher)


def fsdp_gather_dtype(recipe, training: dict) -> str:
    """The dtype FSDP all-gathers parameters in: the mixed-precision dtype, else the stored dtype."""
    return mixed_precision_dtype(training) or recipe.torch_dtype


def _dtype_keys_are_known(recipe, training) -> str | None:
    for key in ("torch_dtype", "bnb_4bit_compute_dtype", "fsdp_reduce_dtype"):
        value = getattr(recipe, key)
        if value not in FLOATING_DTYPES:
            return f"{key}: '{value}' is not one of {', '.join(FLOATING_DTYPES)}"
    return None


def _quant_storage_is_floating_under_fsdp(recipe, training) -> str | None:
    if not recipe.load_in_4bit or not fsdp_in_use(training):
        return None
    if recipe.bnb_4bit_quant_storage not in FLOATING_DTYPES:
        return (
            f"bnb_4bit_quant_storage: '{recipe.bnb_4bit_quant_storage}' cannot be sharded by FSDP; "
            f"set it to {fsdp_gather_dtype(recipe, training)} (the FSDP gather dtype)"
        )
    return None


def _quant_storage_matches_gather_dtype(recipe, training) -> str | None:
    if not recipe.load_in_4bit or recipe.bnb_4bit_quant_storage not in FLOATING_DTYPES:
        return None
    gather = fsdp_gather_dtype(recipe, training)
    if recipe.bnb_4bit_quant_storage != gather:
        return (
            f"bnb_4bit_quant_storage: '{recipe.bnb_4bit_quant_storage}' differs from the dtype FSDP gathers in "
            f"('{gather}', from bf16/fp16/torch_dtype); FSDP would cast the packed 4-bit bytes. "
            f"Set bnb_4bit_quant_storage: {gather}"
        )
    return None


def _qlora_base_dtype_matches_storage(recipe, training) -> str | None:
    if not recipe.load_in_4bit or not fsdp_in_use(training) or mixed_precision_dtype(training):
        return None
    if recipe.torch_dtype != recipe.bnb_4bit_quant_storage:
        return (
            f"torch_dtype: '{recipe.torch_dtype}' differs from bnb_4bit_quant_storage "
            f"'{recipe.bnb_4bit_quant_storage}' and no bf16/fp16 mixed precision unifies them; "
            f"FSDP units would mix dtypes. Set torch_dtype: {recipe.bnb_4bit_quant_storage} or bf16: true"
        )
    return None


def _data_files_exist(recipe, training) -> str | None:
    for key in ("train_file", "eval_file"):
        value = getattr(recipe, key)
        if value is not None and not Path(value).expanduser().is_file():
            return f"{key}: file not found: {value}"
    if recipe.train_file is None and recipe.dataset != TINY_DATASET_NAME:
        directory = Path(recipe.dataset).expanduser()
        if not (directory / "train.jsonl").is_file():
            return (
                f"dataset: '{recipe.dataset}' is neither '{TINY_DATASET_NAME}' nor a directory holding "
                f"train.jsonl; set dataset to such a directory or set train_file"
            )
    return None


def _local_model_path_exists(recipe, training) -> str | None:
    name = recipe.model_name_or_path
    if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().is_dir():
        return f"model_name_or_path: directory not found: {name}"
    return None


def _positive_sizes(recipe, training) -> str | None:
    for key in ("lora_r", "max_seq_length", "generate_max_new_tokens", "generate_batch_size"):
        if getattr(recipe, key) <= 0:
            return f"{key}: must be positive, got {getattr(recipe, key)}"
    if recipe.generate_samples < 0:
        return f"generate_samples: must be 0 (no generation) or more, got {recipe.generate_samples}"
    return None


def _fsdp_needs_several_processes(recipe, training) -> str | None:
    if training.get("fsdp") and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return (
            "fsdp: set in the config, but this is a single process; launch with "
            "`accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml ...` (or a GPU config), "
            "or remove fsdp/fsdp_config"
        )
    return None


RULES: list[Callable] = [
    _dtype_keys_are_known,
    _quant_storage_is_floating_under_fsdp,
    _quant_storage_matches_gather_dtype,
    _qlora_base_dtype_matches_storage,
    _data_files_exist,
    _local_model_path_exists,
    _positive_sizes,
    _fsdp_needs_several_processes,
]


def config_problems(recipe, training: dict) -> list[str]:
    """All problems found by the rules, in rule order."""
    return [problem for rule in RULES if (problem := rule(recipe, training))]


def check_before_training(recipe, training: dict) -> None:
    """Raise one `ConfigError` listing every problem (one per line)."""
    problems = config_problems(recipe, training)
    if problems:
        raise ConfigError("\n       ".join(problems))
