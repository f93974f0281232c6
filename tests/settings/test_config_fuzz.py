"""Seeded fuzzing of recipe configs: every mutation validates, or is refused with one line naming the key.

Valid configs (the shipped tiny LoRA and QLoRA defaults, and one on the recipe's FSDP route) are mutated
one change at a time: a key dropped, retyped, set out of range, misspelled, given twice; FSDP keys combined
in ways that cannot work; tabs and broken YAML. Then every key (each recipe key, each key a shipped tiny config
sets, the preference keys on the DPO config) gets each edge value: empty string, empty list, NaN, infinities,
-1 and 0; the ones a run can use are listed with what they mean (`MEANINGFUL_EDGES`), any other must be refused.
Each result goes through the recipe's own config path
(`resolve_recipe_config`, `check_config`, `build_training_arguments`, as ``fsdp-peft validate`` and
every recipe run them) as if launched on 2 ranks. Anything but a `ConfigError` is a traceback a user would
see; a mutation that must be refused (duplicate, out of range, wrong type, misspelling, FSDP clash) and is
accepted is a silent acceptance. A sample of refusals also runs through the real ``fsdp-peft validate``.
"""

from __future__ import annotations

import dataclasses
import random
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_command
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.procedures.preference import PREFERENCE_PROCEDURE
from fsdp_peft.procedures.procedure import Procedure
from fsdp_peft.procedures.registry import check_config
from fsdp_peft.procedures.rl import GRPO_PROCEDURE
from fsdp_peft.procedures.sft import SFT_PROCEDURE
from fsdp_peft.settings.config import RecipeArguments, build_training_arguments, resolve_recipe_config
from fsdp_peft.settings.keys import training_field_types

MUTATIONS = 600
SEED = 20261130
BASES = {
    "lora": REPO / "configs" / "llama_lora" / "tiny.yaml",
    "qlora": REPO / "configs" / "llama_qlora" / "tiny.yaml",
}
FSDP_ROUTE = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}}
RECIPE_RANGES = {  # the project's own numeric keys and a value each must refuse
    "lora_r": 0,
    "max_seq_length": -8,
    "generate_max_new_tokens": 0,
    "generate_batch_size": -1,
    "generate_samples": -3,
    "generate_eval_samples": -1,
    "max_eval_samples": -1,
    "eval_split": 1.5,
    "lora_alpha": 0,
    "lora_dropout": 1.0,
}
OUT_OF_RANGE = {
    "max_steps": [0, -7],
    "learning_rate": [0.0, -1e-3, float("nan")],
    "adam_beta1": [1.5],
    "per_device_train_batch_size": [0],
    "gradient_accumulation_steps": [0],
    "warmup_steps": [-1],
    "logging_steps": [0],
    "save_steps": [-2],
    "save_total_limit": [0],
    "seed": [-1],
}
FSDP_CLASHES = [  # (values set, the key the message must name)
    ({"fsdp": None, "fsdp_config": {"version": 2}}, "fsdp_config"),
    ({"fsdp": "hybrid_shard auto_wrap", "fsdp_config": {"version": 2}}, "fsdp"),
    ({"fsdp": "full_shard shard_grad_op"}, "fsdp"),
    ({"fsdp": "full_shard auto_wrp"}, "fsdp"),
    ({"fsdp": True, "fsdp_config": {"versoin": 2}}, "fsdp_config"),
    ({"fsdp": True, "fsdp_config": {"version": 3}}, "fsdp_config"),
    ({"fsdp": True, "fsdp_config": {"reshard_after_forward": "sometimes"}}, "fsdp_config"),
    ({"fsdp": True, "fsdp_config": {"auto_wrap_policy": "TRANSFORMER_WRAP"}}, "fsdp_config"),
    ({"fsdp": True, "fsdp_config": {"version": 1, "auto_wrap_policy": "SIZE_BASED_WRAP"}}, "auto_wrap_policy"),
    ({"fsdp": True, "fsdp_config": "/no/such/fsdp.json"}, "fsdp_config"),
    ({"fsdp": True, "fsdp_config": {"xla": True}}, "fsdp_config"),
    ({"fsdp": True, "fsdp_config": {"min_num_params": -5}}, "fsdp_config"),
    ({"fsdp": True, "fsdp_config": {"cpu_offload": "maybe"}}, "fsdp_config"),
    ({"fsdp": True, "fsdp_config": {"fsdp_version": 2, "version": 2}}, "fsdp_config"),
    ({"fsdp": 42}, "fsdp"),
]


DPO_BASE = REPO / "configs" / "llama_dpo" / "tiny.yaml"
GRPO_BASE = REPO / "configs" / "llama_grpo" / "tiny.yaml"
EDGE_VALUES = ["", [], float("nan"), float("inf"), float("-inf"), -1, 0]
MEANINGFUL_EDGES = {  # (key, edge value) a run can use, and what it means; every other edge value is refused
    ("seed", 0): "a seed",
    ("data_seed", 0): "a seed",
    ("dataloader_num_workers", 0): "load in the main process",
    ("eval_split", 0): "no held-out split",
    ("generate_samples", 0): "no generation after training",
    ("generate_eval_samples", 0): "no samples at evaluation",
    ("max_eval_samples", 0): "every held-out row evaluated",
    ("lora_dropout", 0): "no dropout",
    ("loss_chunk_tokens", 0): "the chunked loss off",
    ("warmup_steps", 0): "no warmup",
    ("weight_decay", 0): "no weight decay",
    ("max_steps", -1): "train num_train_epochs",
    ("new_special_tokens", ()): "no new tokens",
    ("trainable_token_indices", ()): "no trained token rows",
    ("lora_target_parameters", ()): "experts frozen (and nothing to adapt on a dense model)",
    ("router_aux_loss_coef", 0): "the router's load-balancing loss off",
    ("lora_modules_to_save", ()): "no trained copies",
    ("eval_tasks", ()): "no harness tasks after training",
    ("eval_tasks_steps", 0): "harness tasks at the end only",
    ("eval_tasks", ""): "no harness tasks after training (an empty name: none, as --eval_tasks '' says it)",
    ("lora_target_parameters", ""): "experts frozen (an empty name: none)",
    ("new_special_tokens", ""): "no new tokens (an empty name: none)",
    ("lora_modules_to_save", ""): "no trained copies",
    ("lora_rank_pattern", ""): "no per-module ranks",
    ("lora_alpha_pattern", ""): "no per-module alphas",
    ("ref_model", ""): "no separate reference (the adapter-disabled model is the reference)",
    ("adapter_name_or_path", ""): "a fresh adapter",
    ("dataset_columns", ""): "no renamed columns",
    ("top_k", 0): "no top-k filtering when sampling rollouts (TRL's default)",
    ("min_p", 0): "no min-p filtering when sampling rollouts",
}


def edge_mutations():
    """Yield ``(key, edge value, YAML text, procedure)``: every key with every value of `EDGE_VALUES`."""
    sft_keys = set(yaml.safe_load(BASES["lora"].read_text())) | set(yaml.safe_load(BASES["qlora"].read_text()))
    keys = sft_keys | {f.name for f in dataclasses.fields(RecipeArguments)}
    for key in sorted(keys):
        path, procedure = _procedure_base(key)
        base = yaml.safe_load(path.read_text())
        for value in EDGE_VALUES:
            yield key, value, _dump({**base, key: value}), procedure


def _procedure_base(key: str) -> tuple[Path, Procedure]:
    """The shipped config a key is mutated in, and the procedure whose rules check it: GRPO's own keys in the GRPO
    default, DPO's (``beta`` and ``loss_type`` included) in the DPO default, the rest in the SFT one."""
    if key in GRPO_PROCEDURE.recognised_by:
        return GRPO_BASE, GRPO_PROCEDURE
    if key in PREFERENCE_PROCEDURE.keys:
        return DPO_BASE, PREFERENCE_PROCEDURE
    return BASES["lora"], SFT_PROCEDURE


def _meaningful(key: str, value) -> bool:
    return (key, tuple(value) if isinstance(value, list) else value) in MEANINGFUL_EDGES


def _misspelled(key: str, rng: random.Random) -> str:
    i = rng.randrange(len(key) - 1)
    swapped = key[:i] + key[i + 1] + key[i] + key[i + 2 :]
    return swapped if swapped != key else key + "x"


def _dump(values: dict) -> str:
    return yaml.safe_dump(values, sort_keys=False)


def mutations(rng: random.Random):
    """Yield ``(kind, base name, YAML text, must_refuse, key the message must name)``."""
    hints = training_field_types()
    for _ in range(MUTATIONS):
        base_name = rng.choice([*BASES, "fsdp"])
        values = yaml.safe_load(BASES["lora" if base_name == "fsdp" else base_name].read_text())
        if base_name == "fsdp":
            values.update(FSDP_ROUTE)
        kind = rng.choice(["drop", "retype", "range", "misspell", "duplicate", "fsdp", "tab", "syntax"])
        key = rng.choice(sorted(values))
        if kind == "drop":
            values.pop(key)
            yield kind, base_name, _dump(values), False, None
        elif kind == "retype":
            value = rng.choice([[1, 2], {"nested": 1}, "not-a-value", True, 3.25, None])
            allowed_container = re.search(r"\b(list|dict)\b", str(hints.get(key, ""))) or key in (
                "lora_target_modules",
                "fsdp",
                "fsdp_config",
            )
            must = isinstance(value, (list, dict)) and not allowed_container
            values[key] = value
            yield kind, base_name, _dump(values), must, key if must else None
        elif kind == "range":
            table = {**{k: [v] for k, v in RECIPE_RANGES.items()}, **OUT_OF_RANGE}
            key = rng.choice(sorted(table))
            values[key] = rng.choice(table[key])
            yield kind, base_name, _dump(values), True, key
        elif kind == "misspell":
            wrong = _misspelled(key, rng)
            values[wrong] = values.pop(key)
            yield kind, base_name, _dump(values), True, wrong
        elif kind == "duplicate":
            text = _dump(values) + _dump({key: values[key]})
            yield kind, base_name, text, True, key
        elif kind == "fsdp":
            clash, named = rng.choice(FSDP_CLASHES)
            values.update(clash)
            yield kind, base_name, _dump({k: v for k, v in values.items() if v is not None}), True, named
        elif kind == "tab":
            text = _dump({**values, "fsdp_config": {"version": 2}}).replace("\n  version", "\n\tversion")
            yield kind, base_name, text, True, None
        else:
            text = _dump(values).replace(f"{key}:", f"{key}: [unclosed", 1)
            yield kind, base_name, text, True, None


def validate_as_the_recipe_does(config: Path, monkeypatch, procedure: Procedure = SFT_PROCEDURE) -> None:
    """The recipe's config path on 2 launched ranks (torchrun's WORLD_SIZE), as `fsdp-peft validate` runs it."""
    recipe, training_values, options = resolve_recipe_config(["--config", str(config)], config, "outputs")
    with monkeypatch.context() as launched:
        launched.setenv("WORLD_SIZE", "2")
        check_config(procedure.with_defaults(recipe), training_values, procedure)
    build_training_arguments(training_values, options.config)


def test_mutated_configs_validate_or_are_refused_with_one_line_naming_the_key(tmp_path, monkeypatch, capsys):
    for key in [k for k in __import__("os").environ if k.startswith(("FSDP_", "ACCELERATE_"))]:
        monkeypatch.delenv(key)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rng = random.Random(SEED)
    outcomes, messages, tracebacks, silent, unnamed, multiline = Counter(), Counter(), [], [], [], []
    for number, (kind, base, text, must_refuse, named) in enumerate(mutations(rng)):
        config = tmp_path / f"m{number}.yaml"
        config.write_text(text)
        try:
            validate_as_the_recipe_does(config, monkeypatch)
        except ConfigError as error:
            message = str(error)
            outcomes[kind, "refused"] += 1
            messages[re.sub(r"/tmp/\S+?m\d+\.yaml", "CONFIG", message)] += 1
            if "\n" in message:
                multiline.append((kind, message))
            if named and named not in message:
                unnamed.append((kind, named, message))
            if kind in ("tab", "syntax", "duplicate") and not re.search(rf"{re.escape(str(config))}:\d+: ", message):
                unnamed.append((kind, "file:line", message))
        except (SystemExit, KeyboardInterrupt):
            raise
        except Exception as error:  # a traceback a user would see
            tracebacks.append((kind, text, repr(error)))
        else:
            outcomes[kind, "accepted"] += 1
            if must_refuse:
                silent.append((kind, text))
    with capsys.disabled():
        print(f"\n{MUTATIONS} mutations: {dict(sorted(outcomes.items()))}; {len(messages)} distinct messages")
    assert sum(outcomes.values()) + len(tracebacks) == MUTATIONS >= 500
    assert not tracebacks, tracebacks[:3]
    assert not silent, silent[:3]
    assert not unnamed, unnamed[:3]
    assert not multiline, multiline[:3]
    assert all(outcomes[kind, "refused"] > 0 for kind in ("range", "misspell", "duplicate", "fsdp", "tab", "syntax"))
    assert outcomes["drop", "accepted"] > 0  # dropping a key falls back to its default


def test_every_key_takes_an_edge_value_as_meant_or_refuses_it_with_one_line(tmp_path, monkeypatch, capsys):
    for key in [k for k in __import__("os").environ if k.startswith(("FSDP_", "ACCELERATE_"))]:
        monkeypatch.delenv(key)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    accepted, refused, tracebacks, silent, unnamed, multiline = set(), 0, [], [], [], []
    for number, (key, value, text, procedure) in enumerate(edge_mutations()):
        config = tmp_path / f"e{number}.yaml"
        config.write_text(text)
        try:
            validate_as_the_recipe_does(config, monkeypatch, procedure)
        except ConfigError as error:
            refused += 1
            if "\n" in str(error):
                multiline.append((key, value, str(error)))
            if key not in str(error):
                unnamed.append((key, value, str(error)))
        except (SystemExit, KeyboardInterrupt):
            raise
        except Exception as error:  # a traceback a user would see
            tracebacks.append((key, value, repr(error)))
        else:
            accepted.add((key, tuple(value) if isinstance(value, list) else value))
            if not _meaningful(key, value):
                silent.append((key, value))
    total = number + 1
    with capsys.disabled():
        print(f"\n{total} edge values: {refused} refused, {len(accepted)} accepted as meant")
    assert total >= 500 and total + MUTATIONS >= 1000  # with the random mutations: over a thousand
    assert not tracebacks, tracebacks[:3]
    assert not silent, silent[:5]
    assert not unnamed, unnamed[:3]
    assert not multiline, multiline[:3]
    assert accepted == set(MEANINGFUL_EDGES)  # each listed meaning is still taken (the list is not stale)


@pytest.mark.parametrize("kind", ["duplicate", "range", "fsdp", "syntax"])
def test_fsdp_peft_validate_exits_2_with_one_line_for_a_mutation(kind, tmp_path):
    rng = random.Random(SEED + 1)
    text = next(t for k, _, t, must, _ in mutations(rng) if k == kind and must)
    config = tmp_path / "mutated.yaml"
    config.write_text(text)
    two_ranks = tmp_path / "two_ranks.yaml"  # an accelerate config without FSDP: the recipe's fsdp keys decide
    two_ranks.write_text("distributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: 2\nmixed_precision: 'no'\n")
    command = [
        sys.executable,
        "-m",
        "fsdp_peft.cli",
        "validate",
        str(config),
        "--accelerate-config",
        str(two_ranks),
        "--recipe",
        "llama_lora",
    ]
    result = run_command(command, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("kind", ["duplicate", "range", "misspell"])
def test_validate_and_the_recipe_give_the_same_message_for_the_same_bad_config(kind, tmp_path):
    rng = random.Random(SEED + 2)
    text = next(t for k, base, t, must, _ in mutations(rng) if k == kind and must and base != "fsdp")
    config = tmp_path / "mutated.yaml"
    config.write_text(text)
    validate = run_command(
        [sys.executable, "-m", "fsdp_peft.cli", "validate", str(config), "--recipe", "llama_lora"], timeout=300
    )
    recipe = run_command(
        [sys.executable, str(REPO / "recipes" / "llama_lora.py"), "--config", str(config)], timeout=300
    )
    assert validate.returncode == recipe.returncode == 2
    assert validate.stderr.strip().splitlines() == recipe.stderr.strip().splitlines()
    assert len(validate.stderr.strip().splitlines()) == 1 and validate.stderr.startswith("error: ")
