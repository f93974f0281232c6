"""The FSDP settings this run trains with, resolved from every place FSDP can be asked for. The one reader.

FSDP can be asked for in three places, and this module resolves them into one `FsdpSettings`:

- the accelerate config given to ``accelerate launch --config_file`` (``fsdp_config:`` there), which the
  launcher hands each rank as ``ACCELERATE_USE_FSDP`` and ``FSDP_*`` environment variables;
- the recipe YAML's ``fsdp`` / ``fsdp_config`` (the Trainer-native route of the transformers FSDP guide), in
  every form ``TrainingArguments`` accepts: ``fsdp`` as a bool, an option string (``"full_shard auto_wrap"``)
  or a list; ``fsdp_config`` as a mapping or the path of a JSON file, keys with or without the ``fsdp_``
  prefix, accelerate's spellings (``offload_params``, ``sharding_strategy``) included;
- ``--fsdp`` / ``--fsdp_config`` on the command line, which override the YAML like any other key.

A key set by both the launcher and the recipe must agree (else one line names both); a key set by one
applies. Keys set by neither take the route's own default: transformers' when the recipe asks for FSDP,
accelerate's when only the launcher does. Validation, the trainer, loading and the planner all read this.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.strict_yaml import load_yaml_file
from fsdp_peft.core.xla import XLA_KEYS, on_xla, xla_fsdp_config

TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
SHARDING_STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")
FSDP_OPTIONS = (*SHARDING_STRATEGIES, "offload", "auto_wrap")
AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")
BACKWARD_PREFETCHES = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
BOOLEAN_KEYS = (
    "cpu_offload",
    "activation_checkpointing",
    "cpu_ram_efficient_loading",
    "use_orig_params",
    "sync_module_states",
    "forward_prefetch",
    "limit_all_gathers",
)
FSDP_CONFIG_KEYS = (
    "version",
    "reshard_after_forward",
    "auto_wrap_policy",
    "transformer_layer_cls_to_wrap",
    "min_num_params",
    "state_dict_type",
    "backward_prefetch",
    *BOOLEAN_KEYS,
)
ACCELERATE_SPELLINGS = {  # accelerate's key (``fsdp_`` prefix dropped) -> the transformers fsdp_config key
    "offload_params": "cpu_offload",
    "sharding_strategy": "reshard_after_forward",
    "transformer_cls_names_to_wrap": "transformer_layer_cls_to_wrap",
    "fsdp_version": "version",
}
LAUNCHER_VARIABLES = {  # fsdp_config key -> the variable `accelerate launch` exports for it
    "version": "FSDP_VERSION",
    "auto_wrap_policy": "FSDP_AUTO_WRAP_POLICY",
    "transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "min_num_params": "FSDP_MIN_NUM_PARAMS",
    "state_dict_type": "FSDP_STATE_DICT_TYPE",
    "cpu_offload": "FSDP_OFFLOAD_PARAMS",
    "activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
    "cpu_ram_efficient_loading": "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "use_orig_params": "FSDP_USE_ORIG_PARAMS",
    "forward_prefetch": "FSDP_FORWARD_PREFETCH",
    "backward_prefetch": "FSDP_BACKWARD_PREFETCH",
}
RECIPE_ROUTE, LAUNCHER_ROUTE = "recipe fsdp/fsdp_config", "accelerate config"


@dataclass(frozen=True)
class FsdpSettings:
    """The FSDP plugin settings this run trains with, resolved from every route, without building the plugin."""

    route: str
    version: int
    auto_wrap_policy: str
    transformer_layer_cls_to_wrap: tuple[str, ...]
    min_num_params: int
    reshard_after_forward: str  # FSDP2: "true"/"false"; FSDP1: the sharding strategy, lower case
    state_dict_type: str
    use_orig_params: bool
    offload_params: bool
    activation_checkpointing: bool
    cpu_ram_efficient_loading: bool


def launcher_asks_for_fsdp() -> bool:
    """Whether ``accelerate launch`` was given an accelerate config with ``distributed_type: FSDP``.

    The launcher always exports ``FSDP_VERSION`` with ``ACCELERATE_USE_FSDP``; an `Accelerator` handed a
    plugin (the recipe's route) sets only the latter, in this process, which is not a launcher's word.
    """
    env = os.environ
    return env.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and "FSDP_VERSION" in env


def truthy(value) -> bool:
    """Whether ``value`` says yes in the words accelerate's settings take (true, 1, yes, on; any case)."""
    return value is True or str(value).strip().lower() in TRUE_WORDS


def _as_bool(value, key: str) -> bool:
    if truthy(value):
        return True
    if value is False or str(value).strip().lower() in FALSE_WORDS:
        return False
    raise ConfigError(f"fsdp_config: {key}: expected true or false, got {value!r}")


def _choice(value, key: str, choices: tuple[str, ...], upper: bool = True) -> str:
    text = str(value).strip()
    text = text.upper() if upper else text.lower()
    if text in choices:
        return text
    close = difflib.get_close_matches(text, choices, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise ConfigError(f"fsdp_config: {key}: {value!r} is not one of {', '.join(choices)}{hint}")


def _fsdp_options(value) -> tuple[bool, list[str]]:
    """``fsdp`` as the Trainer reads it: ``(on, options)``; options are legacy strategy/offload words."""
    if value is None or value is False or value == "" or value == []:
        return False, []
    if value is True:
        return True, []
    if isinstance(value, str):
        if value.strip().lower() in TRUE_WORDS:
            return True, []
        if value.strip().lower() in FALSE_WORDS:
            return False, []
        items = value.split()
    elif isinstance(value, (list, tuple)):
        items = [str(item) for item in value]
    else:
        raise ConfigError(
            f"fsdp: expected true, an option string like 'full_shard auto_wrap', or a list of options; got {value!r}"
        )
    for item in items:
        if item.lower() not in FSDP_OPTIONS:
            close = difflib.get_close_matches(item.lower(), FSDP_OPTIONS, n=1, cutoff=0.5)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"fsdp: unknown option '{item}'; {hint}options are {', '.join(FSDP_OPTIONS)}")
    return True, [item.lower() for item in items]


def _unique_pairs(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ConfigError(f"fsdp_config: key '{repeated[0]}' given twice; keep one")
    return dict(pairs)


def asks_for_xla(training: dict) -> bool:
    """Whether the recipe's ``fsdp_config`` turns on an XLA key: the TPU route (`fsdp_peft.core.xla`)."""
    config = _read_fsdp_config(training.get("fsdp_config"))
    return any(config.get(key) or config.get(f"fsdp_{key}") for key in XLA_KEYS)


def _read_fsdp_config(value) -> dict:
    """``fsdp_config`` as a mapping: given inline, as a JSON text, or as the path of a JSON (or YAML) file."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    if not isinstance(value, str):
        raise ConfigError(f"fsdp_config: expected a mapping or the path of a JSON file, got {value!r}")
    text = value.strip()
    if text.startswith("{"):
        try:
            parsed = json.loads(text, object_pairs_hook=_unique_pairs)
        except json.JSONDecodeError as error:
            raise ConfigError(f"fsdp_config: not valid JSON: {error}") from None
        return parsed
    path = Path(text).expanduser()
    if not path.is_file():
        raise ConfigError(f"fsdp_config: file not found: {value}; give the path of a JSON file or a mapping")
    if path.suffix == ".json":
        try:
            parsed = json.loads(path.read_text(), object_pairs_hook=_unique_pairs)
        except json.JSONDecodeError as error:
            raise ConfigError(f"fsdp_config: {path}:{error.lineno}: not valid JSON: {error.msg}") from None
    else:
        parsed = load_yaml_file(path)
    if not isinstance(parsed, dict):
        raise ConfigError(f"fsdp_config: {path}: expected a mapping of key: value, got {type(parsed).__name__}")
    return parsed


def _canonical_fsdp_config(raw: dict) -> dict:
    """Keys without the ``fsdp_`` prefix, accelerate's spellings translated, each value checked and typed."""
    config: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in raw.items():
        name = str(key).removeprefix("fsdp_") if str(key) != "fsdp_version" else "version"
        name = ACCELERATE_SPELLINGS.get(name, name)
        if name in XLA_KEYS and not value:
            continue  # the Trainer fills these in as false
        if name in XLA_KEYS and on_xla():
            continue  # the Trainer's XLA FSDP route reads these: fsdp_peft.core.xla
        if name in XLA_KEYS:
            raise ConfigError(
                f"fsdp_config: {key}: the PyTorch/XLA (TPU) FSDP route needs an XLA device; set PJRT_DEVICE=TPU "
                "(docs/tpu.md), or remove the xla keys to use FSDP on GPUs (or the CPU mode)"
            )
        if name not in FSDP_CONFIG_KEYS:
            close = difflib.get_close_matches(name, FSDP_CONFIG_KEYS, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"fsdp_config: unknown key '{key}'; {hint}valid keys: {', '.join(FSDP_CONFIG_KEYS)}")
        if name in config:
            raise ConfigError(f"fsdp_config: '{given_as[name]}' and '{key}' both set {name}; keep one")
        config[name] = _checked_value(name, value, str(key))
        given_as[name] = str(key)
    return config


def _checked_value(name: str, value, key: str):
    if name == "version":
        if str(value).strip() not in ("1", "2"):
            raise ConfigError(f"fsdp_config: {key}: {value!r} is not an FSDP version; use 2 (FSDP2) or 1 (FSDP1)")
        return int(str(value).strip())
    if name in BOOLEAN_KEYS:
        return _as_bool(value, key)
    if name == "auto_wrap_policy":
        return _choice(value, key, AUTO_WRAP_POLICIES)
    if name == "state_dict_type":
        return _choice(value, key, STATE_DICT_TYPES)
    if name == "backward_prefetch":
        return _choice(value, key, BACKWARD_PREFETCHES)
    if name == "min_num_params":
        if isinstance(value, bool) or not str(value).strip().isdigit():
            raise ConfigError(f"fsdp_config: {key}: expected a whole number of parameters >= 0, got {value!r}")
        return int(str(value).strip())
    if name == "transformer_layer_cls_to_wrap":
        names = value.split(",") if isinstance(value, str) else value
        if (
            not isinstance(names, (list, tuple))
            or not names
            or not all(isinstance(n, str) and n.strip() for n in names)
        ):
            raise ConfigError(f"fsdp_config: {key}: expected a class name or a list of them, got {value!r}")
        return [n.strip() for n in names]
    if name == "reshard_after_forward":
        return _reshard_value(value, key)
    return value


def _reshard_value(value, key: str) -> str:
    """``reshard_after_forward`` (bool or a sharding strategy, accelerate's numbers included) as a word."""
    if isinstance(value, bool):
        return str(value).lower()
    text = str(value).strip().lower()
    if text.isdigit() and 1 <= int(text) <= len(SHARDING_STRATEGIES):
        return SHARDING_STRATEGIES[int(text) - 1]
    if text in TRUE_WORDS[1:] or text in FALSE_WORDS[1:]:
        return "true" if text in TRUE_WORDS else "false"
    if text in SHARDING_STRATEGIES:
        return text
    raise ConfigError(
        f"fsdp_config: {key}: {value!r} is not true/false nor a sharding strategy ({', '.join(SHARDING_STRATEGIES)})"
    )


def _reshard_for_version(reshard: str, version: int, where: str) -> str:
    """FSDP2 takes true/false (full_shard/shard_grad_op); FSDP1 a strategy (true/false as full/grad-op)."""
    if version == 2:
        mapping = {"full_shard": "true", "shard_grad_op": "false", "true": "true", "false": "false"}
        if reshard not in mapping:
            raise ConfigError(
                f"{where}: '{reshard}' is an FSDP1 sharding strategy; FSDP2 takes full_shard or shard_grad_op "
                "(reshard_after_forward true/false). For HSDP under FSDP2 use an accelerate config with a "
                "parallelism_config (configs/accelerate/hsdp_fsdp2.yaml), or set version: 1"
            )
        return mapping[reshard]
    return {"true": "full_shard", "false": "shard_grad_op"}.get(reshard, reshard)


def recipe_fsdp_config(training: dict) -> dict | None:
    """The recipe's ``fsdp``/``fsdp_config`` as one canonical fsdp_config (explicit keys only); ``None`` if off."""
    on, options = _fsdp_options(training.get("fsdp"))
    raw = training.get("fsdp_config")
    if not on:
        if raw:
            raise ConfigError("fsdp_config: set, but fsdp is off, so the Trainer would ignore it; add fsdp: true")
        return None
    config = _canonical_fsdp_config(_read_fsdp_config(raw))
    version = config.get("version", 2)
    strategies = [option for option in options if option in SHARDING_STRATEGIES]
    if len(strategies) > 1:
        raise ConfigError(f"fsdp: '{' '.join(options)}' names {len(strategies)} sharding strategies; keep one")
    if strategies:
        if "reshard_after_forward" in config and config["reshard_after_forward"] != strategies[0]:
            implied = _reshard_for_version(strategies[0], version, "fsdp")
            if _reshard_for_version(config["reshard_after_forward"], version, "fsdp_config") != implied:
                raise ConfigError(
                    f"fsdp: '{strategies[0]}' and fsdp_config reshard_after_forward: "
                    f"{config['reshard_after_forward']} disagree; keep one"
                )
        config["reshard_after_forward"] = strategies[0]
    if "offload" in options:
        config["cpu_offload"] = True
    if "reshard_after_forward" in config:
        config["reshard_after_forward"] = _reshard_for_version(config["reshard_after_forward"], version, "fsdp")
    return config


def launcher_fsdp_config() -> dict | None:
    """What the accelerate config passed (``FSDP_*`` variables) as fsdp_config keys; ``None`` without FSDP."""
    if not launcher_asks_for_fsdp():
        return None
    env = os.environ
    config: dict[str, Any] = {}
    for key, variable in LAUNCHER_VARIABLES.items():
        if variable in env and env[variable] not in ("", "None"):
            config[key] = _checked_value(key, env[variable], variable)
    config.setdefault("version", 1)  # accelerate's own default
    strategy = env.get("FSDP_SHARDING_STRATEGY") if config["version"] == 1 else None
    reshard = strategy or env.get("FSDP_RESHARD_AFTER_FORWARD")
    if reshard not in (None, "", "None"):
        config["reshard_after_forward"] = _reshard_for_version(
            _reshard_value(reshard, "FSDP_RESHARD_AFTER_FORWARD"), config["version"], "accelerate config"
        )
    return config


def merged_fsdp_config(training: dict) -> tuple[dict | None, str | None]:
    """The explicit FSDP keys of this run, the launcher's and the recipe's merged, and the route(s) they came from.

    A key both set must agree; otherwise one line names the two values and where each came from.
    """
    recipe, launcher = recipe_fsdp_config(training), launcher_fsdp_config()
    if recipe is None:
        return launcher, (LAUNCHER_ROUTE if launcher is not None else None)
    if launcher is None:
        return recipe, RECIPE_ROUTE
    recipe_with_version = {"version": 2, **recipe}  # the Trainer route's default version counts as said
    for key in sorted(set(launcher) & set(recipe_with_version)):
        if _comparable(launcher[key]) != _comparable(recipe_with_version[key]):
            raise ConfigError(
                f"fsdp_config: {key} is {recipe_with_version[key]!r} in the recipe but {launcher[key]!r} in the "
                f"accelerate config ({LAUNCHER_VARIABLES.get(key, 'FSDP_RESHARD_AFTER_FORWARD')}); make them agree, "
                "or set FSDP in one place only"
            )
    return {**launcher, **recipe_with_version}, f"{LAUNCHER_ROUTE} + {RECIPE_ROUTE}"


def _comparable(value):
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else value


TRAINER_DEFAULTS = {  # transformers 5.24 `TrainingArguments._process_fsdp_args`
    "version": 2,
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "state_dict_type": "FULL_STATE_DICT",
    "use_orig_params": True,
    "cpu_offload": False,
    "activation_checkpointing": False,
    "cpu_ram_efficient_loading": False,
    "min_num_params": 0,
}
LAUNCHER_DEFAULTS = {  # accelerate 1.15 `FullyShardedDataParallelPlugin`, for variables the launcher left out
    "version": 1,
    "auto_wrap_policy": "NO_WRAP",
    "use_orig_params": False,
    "cpu_offload": False,
    "activation_checkpointing": False,
    "cpu_ram_efficient_loading": False,
    "min_num_params": 0,
}


def fsdp_settings(training) -> FsdpSettings | None:
    """The FSDP settings of a run from its training values (a dict, or built `TrainingArguments`), or ``None``."""
    if not isinstance(training, dict):
        training = trainer_values(training)
    if on_xla():
        return None  # not torch FSDP: the Trainer's XLA FSDP route (fsdp_peft.core.xla)
    config, route = merged_fsdp_config(training)
    if config is None:
        return None
    defaults = TRAINER_DEFAULTS if RECIPE_ROUTE in route else LAUNCHER_DEFAULTS
    values = {**defaults, **config}
    version = int(values["version"])
    state_dict = values.get("state_dict_type") or ("FULL_STATE_DICT" if version == 1 else "SHARDED_STATE_DICT")
    reshard = values.get("reshard_after_forward", "true" if version == 2 else "full_shard")
    return FsdpSettings(
        route=route,
        version=version,
        auto_wrap_policy=values["auto_wrap_policy"],
        transformer_layer_cls_to_wrap=tuple(values.get("transformer_layer_cls_to_wrap") or ()),
        min_num_params=int(values["min_num_params"]),
        reshard_after_forward=reshard,
        state_dict_type=state_dict,
        use_orig_params=bool(values["use_orig_params"]),
        offload_params=bool(values["cpu_offload"]),
        activation_checkpointing=bool(values["activation_checkpointing"]),
        cpu_ram_efficient_loading=bool(values["cpu_ram_efficient_loading"]),
    )


@dataclass(frozen=True)
class RuleContext:
    """What every configuration rule reads (`fsdp_peft.tools.validation.RULES`: ``rule(context) -> problem or None``),
    computed once per validation: the FSDP settings are resolved here once, however many rules read them."""

    recipe: Any  # `fsdp_peft.settings.config.RecipeArguments`
    training: dict  # the ``TrainingArguments`` values
    procedure: Any  # the `fsdp_peft.procedures.procedure.Procedure` checked: rules ask its traits
    fsdp: FsdpSettings | None  # the resolved FSDP settings; None when FSDP is off or they do not resolve
    fsdp_problem: str | None = None  # why they do not resolve (one rule reports it; the others skip FSDP)
    others: tuple = ()  # the other procedures, whose keys this one's config must not set

    @property
    def fsdp_in_use(self) -> bool:
        """FSDP is on when the recipe sets ``fsdp`` or the accelerate launcher's config says FSDP."""
        return self.fsdp is not None or launcher_asks_for_fsdp()


def rule_context(recipe, training: dict, procedure, others: tuple = ()) -> RuleContext:
    """The context of one validation: the FSDP settings resolved once."""
    try:
        return RuleContext(recipe, training, procedure, fsdp_settings(training), others=others)
    except ConfigError as error:
        return RuleContext(recipe, training, procedure, None, str(error), others)


def trainer_values(args) -> dict:
    """The FSDP-relevant values of built `TrainingArguments`, as the recipe's training dict holds them."""
    return {"fsdp": args.fsdp or None, "fsdp_config": args.fsdp_config if args.fsdp else None}


def trainer_fsdp_arguments(training: dict) -> dict:
    """``fsdp``/``fsdp_config`` to build `TrainingArguments` with: the merged settings, in transformers' keys.

    When the recipe asks for FSDP, the launcher's explicit keys join its fsdp_config (the Trainer would
    otherwise replace them with its own defaults); when only the launcher does, nothing changes.
    """
    if on_xla():
        on, _ = _fsdp_options(training.get("fsdp"))
        return (
            {"fsdp": True, "fsdp_config": xla_fsdp_config(_read_fsdp_config(training.get("fsdp_config")))} if on else {}
        )
    config, route = merged_fsdp_config(training)
    if config is None or RECIPE_ROUTE not in route:
        return {}
    config = dict(config)
    if "transformer_layer_cls_to_wrap" in config:
        config["transformer_layer_cls_to_wrap"] = list(config["transformer_layer_cls_to_wrap"])
    return {"fsdp": True, "fsdp_config": config}


def mixed_precision_dtype(training: dict) -> str | None:
    """The autocast / FSDP parameter dtype from ``bf16``/``fp16`` or the launcher's ``mixed_precision``."""
    if training.get("bf16"):
        return "bfloat16"
    if training.get("fp16"):
        return "float16"
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    return {"bf16": "bfloat16", "fp16": "float16"}.get(launcher)
