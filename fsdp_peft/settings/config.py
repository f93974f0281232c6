"""Recipe configuration: one flat YAML of `TrainingArguments` fields plus the project's own fields.

Precedence: built-in defaults < the YAML named by ``include:`` in the config (recursively) < the YAML
given with ``--config`` (or the recipe's default YAML) < ``--key value`` on the command line. Every key
is checked before anything heavy happens, so a typo is a one-line error naming the key and the closest
valid one, not a traceback after model loading. ``--print-config`` prints the resolved config and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from transformers import HfArgumentParser, TrainingArguments
from transformers.hf_argparser import string_to_bool

from fsdp_peft.core.dtypes import DTYPES, dtype_named, short_dtype_name
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.strict_yaml import load_yaml_file
from fsdp_peft.core.xla import on_xla
from fsdp_peft.settings.catalog import shipped_config
from fsdp_peft.settings.checkpointing import AUTO, CHECKPOINTING_KEYS
from fsdp_peft.settings.choices import COMPILED_DECODING_HELP, GATHER_BUDGET_HELP, TINY_DATASET_NAME, TINY_MODEL_NAME
from fsdp_peft.settings.families import AUTO_TARGETS
from fsdp_peft.settings.four_bit import DEFAULTS as FOUR_BIT
from fsdp_peft.settings.fsdp_settings import trainer_fsdp_arguments
from fsdp_peft.settings.keys import field_types, plain_value, type_problems


@dataclass
class RecipeArguments:
    """The project's keys: model, 4-bit quantization, LoRA, data and generation."""

    model_name_or_path: str = field(
        default=TINY_MODEL_NAME, metadata={"help": f"hub id or local path; '{TINY_MODEL_NAME}' is the embedded model"}
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "run the model's own Python code from its hub repo (only for models you trust)"},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "replace the run in output_dir (its checkpoints are removed) instead of refusing"},
    )
    torch_dtype: str = field(default="bfloat16", metadata={"help": f"dtype of the unquantized weights: {DTYPES}"})
    load_in_4bit: bool = field(default=False, metadata={"help": "QLoRA: load the base in 4 bits with bitsandbytes"})
    bnb_4bit_quant_type: str = field(default=FOUR_BIT.quant_type, metadata={"help": "nf4 or fp4"})
    bnb_4bit_use_double_quant: bool = field(
        default=FOUR_BIT.double_quant, metadata={"help": "quantize the quantization constants"}
    )
    bnb_4bit_compute_dtype: str = field(
        default=FOUR_BIT.compute_dtype, metadata={"help": f"dtype of 4-bit matmuls: {DTYPES}"}
    )
    bnb_4bit_quant_storage: str = field(
        default=FOUR_BIT.storage_dtype,
        metadata={"help": "dtype the packed 4-bit weights are stored in; must be FSDP's gather dtype"},
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)"})
    lora_dropout: float = field(default=0.05, metadata={"help": "dropout on the LoRA input"})
    adapter_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "start from a trained adapter's weights (an SFT run's output_dir, adapter/ or checkpoint), for "
            "SFT -> DPO or SFT -> GRPO; its rank, alpha and modules must be this recipe's"
        },
    )
    lora_target_modules: list[str] = field(
        default_factory=lambda: [AUTO_TARGETS],
        metadata={"help": "module names to adapt, 'all-linear', or 'auto' (the model family's default)"},
    )
    lora_target_parameters: list[str] = field(
        default_factory=lambda: [AUTO_TARGETS],
        metadata={
            "help": "mixture of experts: expert parameters to adapt (peft target_parameters, e.g. "
            "mlp.experts.down_proj); 'auto': every expert weight; []: experts frozen (docs/moe.md)"
        },
    )
    train_router: bool = field(
        default=False, metadata={"help": "mixture of experts: train the router (a full copy) next to the adapters"}
    )
    lora_vision_tower: bool = field(
        default=False,
        metadata={"help": "vision-language model: LoRA on the vision tower's linear layers too (docs/vision.md)"},
    )
    train_projector: bool = field(
        default=False,
        metadata={"help": "vision-language model: train the projector from image features to text (a full copy)"},
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "mixture of experts: weight of the router's load-balancing loss; unset: as the model's config "
            "says (output_router_logits, router_aux_loss_coef); 0: off"
        },
    )
    use_dora: bool = field(default=False, metadata={"help": "DoRA: a trained magnitude per output row"})
    use_rslora: bool = field(default=False, metadata={"help": "rsLoRA: scale alpha / sqrt(r), not alpha / r"})
    init_lora_weights: str = field(
        default="default",
        metadata={"help": "default, gaussian, pissa, pissa_niter_N, olora, loftq or eva (see docs/variants.md)"},
    )
    loftq_bits: int = field(default=4, metadata={"help": "loftq: bits of its quantization (2, 4, 8)"})
    loftq_iter: int = field(default=1, metadata={"help": "loftq: alternating steps"})
    eva_batches: int = field(default=16, metadata={"help": "eva: global training batches its SVD cycles over"})
    eva_tau: float = field(default=0.99, metadata={"help": "eva: stop once components move less (cosine >= tau)"})
    eva_rho: float = field(default=1.0, metadata={"help": "eva: rank redistribution (only 1: ranks as configured)"})
    lora_rank_pattern: dict | str | None = field(
        default=None, metadata={"help": "per-module rank, {name or regex: r}, e.g. {'o_proj': 8}"}
    )
    lora_alpha_pattern: dict | str | None = field(
        default=None, metadata={"help": "per-module alpha, {name or regex: alpha}"}
    )
    lora_modules_to_save: list[str] = field(
        default_factory=list, metadata={"help": "modules trained whole next to the adapters, e.g. lm_head"}
    )
    trainable_token_indices: list[int] = field(
        default_factory=list, metadata={"help": "token ids whose embedding rows are trained (new special tokens)"}
    )
    new_special_tokens: list[str] = field(
        default_factory=list, metadata={"help": "tokens added to the tokenizer, their rows trained (docs/variants.md)"}
    )
    dataset: str = field(
        default=TINY_DATASET_NAME,
        metadata={"help": f"'{TINY_DATASET_NAME}' (embedded), a local data file or directory, or a hub dataset id"},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "hub dataset: configuration name"})
    dataset_train_split: str = field(default="train", metadata={"help": "hub dataset: split to train on"})
    dataset_eval_split: str | None = field(default=None, metadata={"help": "hub dataset: split to evaluate on"})
    dataset_columns: dict | None = field(
        default=None,
        metadata={"help": "columns renamed before the format is read, e.g. {question: prompt, answer: completion}"},
    )
    train_file: str | None = field(
        default=None, metadata={"help": ".jsonl/.json/.parquet/.csv file or directory of them; wins over dataset"}
    )
    eval_file: str | None = field(default=None, metadata={"help": "held-out file or directory; wins over dataset"})
    data_format: str = field(
        default="auto", metadata={"help": "auto (from the columns), prompt_completion, instruction, messages, sharegpt"}
    )
    eval_split: float = field(
        default=0.0, metadata={"help": "fraction of train rows held out when no eval data is given"}
    )
    max_seq_length: int = field(
        default=1024, metadata={"help": "tokens per example (per packed row with packing; GRPO: per prompt)"}
    )
    truncation: str = field(default="right", metadata={"help": "longer examples: right, left (cut) or drop"})
    completion_only_loss: bool = field(default=True, metadata={"help": "loss only on completions / assistant turns"})
    packing: bool = field(default=False, metadata={"help": "pack examples into max_seq_length rows, kept apart"})
    attn_implementation: str = field(
        default="auto",
        metadata={"help": "sdpa, eager, flash_attention_2/3, flex_attention, a hub kernel (org/name), or auto"},
    )
    loss_chunk_tokens: int = field(
        default=512,
        metadata={"help": "chunked loss: labelled tokens per chunk (no full logits), e.g. 512; 0: model's own loss"},
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata={"help": "ranks that split each row (Ulysses, FSDP2; docs/long-context.md); 1: no split"},
    )
    compile: bool = field(
        default=False,
        metadata={
            "help": "compile each decoder layer's training forward with torch.compile (fsdp_peft.model.compiled)"
        },
    )
    kernels: str = field(
        default="none",
        metadata={
            "help": "fused training kernels: none, or liger (Liger-Kernel's RMSNorm, RoPE, SwiGLU and fused linear "
            "cross-entropy; CUDA GPUs; pip install 'fsdp-peft[kernels]'; docs/activations.md)"
        },
    )
    skip_invalid_rows: bool = field(default=False, metadata={"help": "drop and count bad rows instead of failing"})
    use_chat_template: bool = field(
        default=True, metadata={"help": "render prompts with the tokenizer's chat template"}
    )
    fsdp_reduce_dtype: str = field(default="float32", metadata={"help": f"dtype FSDP reduces gradients in: {DTYPES}"})
    export_merged: bool = field(
        default=False, metadata={"help": "after training, write merged full weights to output_dir/merged"}
    )
    export_dtype: str = field(default="bf16", metadata={"help": "dtype of the merged export: bf16, fp16 or fp32"})
    generate_samples: int = field(
        default=200, metadata={"help": "held-out prompts to generate after training; 0: none"}
    )
    generate_max_new_tokens: int = field(default=32, metadata={"help": "new tokens per generated completion"})
    generate_batch_size: int = field(default=32, metadata={"help": "prompts per generate call on each rank"})
    device_memory: str = field(
        default="auto",
        metadata={
            "help": "memory of one device that activation_checkpointing: auto plans within: auto (a GPU's total "
            "memory; on CPU none, so nothing is checkpointed) or a size like 20GiB"
        },
    )
    generate_gather_budget: str = field(
        default="auto",
        metadata={"help": "FSDP2: gathered weights generate may keep for the whole call: " + GATHER_BUDGET_HELP},
    )
    generate_merged_adapter: bool = field(
        default=True,
        metadata={
            "help": "generation computes with the LoRA adapter merged into the weights for each call (one matmul a "
            "layer instead of three, equal up to rounding; FSDP2-gathered and unsharded full-precision layers); "
            "false: unmerged, as in training"
        },
    )
    generate_compiled: str = field(
        default="auto",
        metadata={"help": "generation's decode step: " + COMPILED_DECODING_HELP + " (docs/generation.md)"},
    )
    generate_eval_samples: int = field(
        default=4, metadata={"help": "held-out prompts completed and shown at each evaluation; 0: none"}
    )
    max_eval_samples: int = field(
        default=0,
        metadata={"help": "held-out rows each evaluation's loss is computed on (the first N); 0: all of them"},
    )
    eval_tasks: list[str] = field(
        default_factory=list,
        metadata={
            "help": "lm-evaluation-harness tasks run on the trained, still-sharded model at the end (names or task "
            "YAML paths, as fsdp-peft eval's --tasks); figures in results.json, files in output_dir/eval"
        },
    )
    eval_tasks_steps: int = field(
        default=0,
        metadata={
            "help": "also run eval_tasks every N optimizer steps during training (figures logged as "
            "harness/<task>/<metric>, files in output_dir/eval/step-N); 0: at the end only"
        },
    )
    beta: float | None = field(
        default=None,
        metadata={
            "help": "preference recipes: strength of the pull towards the reference (default 0.1); GRPO: weight of "
            "the KL term to the reference (default 0.0: no reference pass)"
        },
    )
    loss_type: str | None = field(
        default=None,
        metadata={"help": "preference recipes: TRL's DPO/KTO loss (default sigmoid = DPO); GRPO: its loss (dapo)"},
    )
    precompute_ref_log_probs: bool = field(
        default=False, metadata={"help": "preference recipes: reference log-probs computed once before training"}
    )
    ref_model: str | None = field(
        default=None, metadata={"help": "preference recipes: a separate reference model (not with LoRA: refused)"}
    )

    reward_funcs: list[str] = field(
        default_factory=list,
        metadata={"help": "GRPO: reward functions: exact_answer, math_answer, math_format, or module:function"},
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "GRPO: one weight per reward function (default: 1.0 each)"}
    )
    num_generations: int = field(default=8, metadata={"help": "GRPO: completions sampled per prompt (a group)"})
    max_completion_length: int = field(default=256, metadata={"help": "GRPO: new tokens per sampled completion"})
    temperature: float = field(default=1.0, metadata={"help": "GRPO: sampling temperature of the rollouts"})
    top_p: float = field(default=1.0, metadata={"help": "GRPO: nucleus sampling of the rollouts (1.0: off)"})
    top_k: int = field(default=0, metadata={"help": "GRPO: top-k sampling of the rollouts (0: off)"})
    min_p: float | None = field(default=None, metadata={"help": "GRPO: min-p sampling of the rollouts"})
    repetition_penalty: float = field(default=1.0, metadata={"help": "GRPO: repetition penalty (1.0: off)"})
    steps_per_generation: int | None = field(
        default=None, metadata={"help": "GRPO: optimizer micro-steps per rollout batch (default: the accumulation)"}
    )
    num_iterations: int = field(default=1, metadata={"help": "GRPO: updates per rollout batch (mu)"})
    epsilon: float = field(default=0.2, metadata={"help": "GRPO: clipping range of the probability ratio"})
    epsilon_high: float | None = field(default=None, metadata={"help": "GRPO: upper clipping range (DAPO)"})
    scale_rewards: str = field(default="group", metadata={"help": "GRPO: advantage scaling: group, batch or none"})
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "GRPO: completions cut at max_completion_length do not count in the loss"}
    )

    def __post_init__(self):
        # One dtype vocabulary: every dtype key takes float32 or fp32 (bfloat16 or bf16, ...), kept in one spelling
        # each; what names no dtype stays as given, for validation to refuse by name.
        self.torch_dtype = dtype_named(self.torch_dtype) or self.torch_dtype
        self.bnb_4bit_compute_dtype = dtype_named(self.bnb_4bit_compute_dtype) or self.bnb_4bit_compute_dtype
        self.bnb_4bit_quant_storage = dtype_named(self.bnb_4bit_quant_storage) or self.bnb_4bit_quant_storage
        self.fsdp_reduce_dtype = dtype_named(self.fsdp_reduce_dtype) or self.fsdp_reduce_dtype
        self.export_dtype = short_dtype_name(self.export_dtype) or self.export_dtype
        self.generate_compiled = str(self.generate_compiled).strip().lower()  # YAML's true/false arrive as bools


def keys_set(values: dict) -> set[str]:
    """The recipe keys of ``values`` set to something other than their default: what makes a config a procedure's
    (`fsdp_peft.procedures.registry`). An empty value where the default is empty too (``ref_model: ""`` for none)
    counts as unset, and so does every key at its default (``--print-config`` writes them all)."""
    defaults = dataclasses.asdict(RecipeArguments())
    return {
        key for key, value in values.items() if key in defaults and value != defaults[key] and (value or defaults[key])
    }


class _Parser(HfArgumentParser):
    """An argument parser whose errors are `ConfigError`s (one line) instead of usage dumps."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for action in self._actions:
            if action.dest in CHECKPOINTING_KEYS:  # `auto` too: fsdp_peft.settings.checkpointing resolves it
                action.type = _bool_or_auto

    def error(self, message: str):
        named = re.match(r"argument --(\w+)(?:/--[\w-]+)*: (.*)", message)
        if named:
            raise KeyValueError(named[1], f"{named[1]}: {named[2]}")
        raise ConfigError(message)


class KeyValueError(ConfigError):
    """A value the parser cannot read for ``key`` (``lora_alpha: many``)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def _bool_or_auto(text: str) -> bool | str:
    return AUTO if str(text).strip().lower() == AUTO else string_to_bool(text)


@functools.cache
def unset_training_values() -> dict:
    """Each ``TrainingArguments`` value as parsed when neither YAML nor command line sets it (the parser's
    default, which is not always the field's: ``include_num_input_tokens_seen`` parses as ``False``)."""
    return vars(_Parser((TrainingArguments,)).parse_args([]))


def known_keys() -> list[str]:
    """Every key a recipe YAML or command line may set."""
    return [f.name for cls in (RecipeArguments, TrainingArguments) for f in dataclasses.fields(cls) if f.init]


def _unknown_key_error(key: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, known_keys(), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else "; run with --help to list the valid keys"
    return ConfigError(f"{where}: unknown key '{key}'{hint}")


INCLUDE_KEY = "include"
DATA_PATH_KEYS = ("dataset", "train_file", "eval_file")  # read beside the config file that sets them
LIST_KEYS = (
    "lora_target_modules",
    "lora_target_parameters",
    "lora_modules_to_save",
    "new_special_tokens",
    "reward_funcs",
    "reward_weights",
    "eval_tasks",
)


def read_yaml_config(path: Path, included_from: tuple[Path, ...] = (), problems: list[str] | None = None) -> dict:
    """Load a recipe YAML, its ``include:`` base first, and check that every key is known (all at once); with
    ``problems`` (`fsdp-peft validate`), unknown keys are added to it and left out instead of stopping there."""
    if not path.is_file():
        where = f"{included_from[-1]}: include" if included_from else "--config"
        raise ConfigError(f"{where}: file not found: {path}")
    values = load_yaml_file(path)
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value, got {type(values).__name__}")
    valid = set(known_keys())
    unknown = [_unknown_key_error(str(key), str(path)) for key in values if key not in valid and key != INCLUDE_KEY]
    if unknown and problems is None:
        raise ConfigError("\n       ".join(map(str, unknown)))
    if unknown:
        problems += map(str, unknown)
        values = {key: value for key, value in values.items() if key in valid or key == INCLUDE_KEY}
    values = {key: _beside_the_config(value, path) if key in DATA_PATH_KEYS else value for key, value in values.items()}
    if INCLUDE_KEY not in values:
        return values
    base = _include_path(values.pop(INCLUDE_KEY), path)
    if base.resolve() in {p.resolve() for p in (*included_from, path)}:
        raise ConfigError(f"{path}: include: {base} includes itself (through {' -> '.join(map(str, included_from))})")
    return {**read_yaml_config(base, (*included_from, path), problems), **values}


def config_files(path: Path) -> list[Path]:
    """``path`` and the files its ``include:`` chain names, outermost first, as far as they read (`read_yaml_config`
    reports what does not)."""
    files = [Path(path)]
    while files[-1].is_file():
        try:
            values = load_yaml_file(files[-1])
            if not isinstance(values, dict) or INCLUDE_KEY not in values:
                break
            base = _include_path(values[INCLUDE_KEY], files[-1])
        except ConfigError:
            break
        if base.resolve() in {file.resolve() for file in files}:
            break
        files.append(base)
    return files


def _beside_the_config(value, config: Path):
    """A relative data path in a config file means the file's directory (as ``include:`` does), where it exists there;
    else it is left to the working directory, as a command-line value is."""
    if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute() or value.startswith("~"):
        return value
    beside = config.parent / value
    return str(beside) if beside.exists() else value


def _include_path(value, including: Path) -> Path:
    """``include:`` is a path relative to the including file, else a shipped config name (``fsdp-peft ls``)."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{including}: include: expected the path of one YAML file, got {value!r}")
    relative = including.parent / Path(value).expanduser()
    return relative if relative.is_file() else (shipped_config(value) or relative)


def _check_cli_keys(argv: list[str]) -> None:
    valid = set(known_keys())
    for token in argv:
        if not token.startswith("--") or token == "--help":
            continue
        key = token[2:].split("=", 1)[0].replace("-", "_")
        if key not in valid and not (key.startswith("no_") and key[3:] in valid):
            raise _unknown_key_error(key, "command line")


def resolve_recipe_config(
    argv: list[str], default_config: Path, default_output_dir: str, problems: list[str] | None = None
) -> tuple[RecipeArguments, dict, argparse.Namespace]:
    """The recipe arguments, the ``TrainingArguments`` values (not yet checked or built) and the options
    (``--config``, ``--print-config``). With ``problems`` (`fsdp-peft validate`, which lists every problem at
    once), a config's unknown keys and values the parser cannot read are added to it and left at their defaults."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=default_config)
    pre.add_argument("--print-config", "--print_config", action="store_true")
    options, rest = pre.parse_known_args(argv)
    values = read_yaml_config(options.config, problems=problems)
    _check_cli_keys(rest)

    while True:  # with problems: once more without each key the parser cannot read from the config
        parser = _Parser((RecipeArguments, TrainingArguments), allow_abbrev=False)
        parser.set_defaults(**values)
        try:
            namespace, leftover = parser.parse_known_args(rest)
            break
        except KeyValueError as unreadable:
            if problems is None or unreadable.key not in values:
                raise
            hints = field_types(RecipeArguments, TrainingArguments)
            problems += type_problems({unreadable.key: values.pop(unreadable.key)}, hints) or [str(unreadable)]
    if leftover:
        raise ConfigError(f"command line: unexpected argument '{leftover[0]}'; overrides are written --key value")
    parsed = vars(namespace)
    for key in LIST_KEYS:
        if isinstance(parsed.get(key), str):
            parsed[key] = [parsed[key]]  # `lora_target_modules: all-linear` means a one-item list
        if parsed.get(key) == [""]:
            parsed[key] = []  # `--eval_tasks ""` on the command line: none (a YAML list key set to [])
    recipe_fields = {f.name for f in dataclasses.fields(RecipeArguments)}
    recipe_args = RecipeArguments(**{k: v for k, v in parsed.items() if k in recipe_fields})
    training_values = {k: v for k, v in parsed.items() if k not in recipe_fields}
    if training_values.get("output_dir") is None:
        training_values["output_dir"] = default_output_dir
    if not torch.accelerator.is_available() and not on_xla():
        training_values["use_cpu"] = True  # no accelerator: the CPU mode (bf16 autocast included)
    return recipe_args, training_values, options


def build_training_arguments(
    training_values: dict, source: Path, arguments_class: type[TrainingArguments] = TrainingArguments, **extra
) -> TrainingArguments:
    """``TrainingArguments`` (or a subclass such as TRL's ``DPOConfig``, given its ``extra`` fields) from
    resolved values; its own refusals become `ConfigError`s naming ``source``."""
    try:
        return arguments_class(**{**training_values, **trainer_fsdp_arguments(training_values), **extra})
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{source}: {error}") from None


def resolved_config_yaml(recipe: RecipeArguments, training_values: dict, source: Path) -> str:
    """The resolved config as a YAML that ``--config`` accepts: every project key, then every
    ``TrainingArguments`` key whose value differs from the one an empty config gets."""
    defaults = vars(_Parser((RecipeArguments, TrainingArguments), allow_abbrev=False).parse_args([]))
    training = {
        key: plain_value(value)
        for key, value in training_values.items()
        if plain_value(value) != plain_value(defaults.get(key, dataclasses.MISSING))
    }
    header = (
        f"# resolved from {source} (includes, then command-line overrides, applied)\n"
        "# TrainingArguments keys not listed keep their defaults\n"
    )
    body = yaml.safe_dump({**dataclasses.asdict(recipe), **training}, sort_keys=False, default_flow_style=None)
    return header + body
