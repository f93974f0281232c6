"""Online RL (GRPO) through TRL's `GRPOTrainer`, with the SFT trainer's FSDP behaviour and rollouts at unsharded speed.

The procedure of the GRPO recipes (`fsdp_peft.procedures.procedure.Procedure`). Its data: prompts and answers (every row
checked) and the reward functions (imported and tried on the first rows), before any weights load. Its score,
before and after training: held-out exact match and mean reward of greedy completions.

Rollouts are TRL's own sampling code with the same generation config and random state, run while every FSDP2
unit stays gathered (`fsdp_peft.tools.generation.parameters_gathered`: one all-gather per ``generate`` call, not one per
layer per decoded token as TRL's path does on a sharded model). With ``beta > 0`` the reference is the policy
with its adapter disabled, as in the DPO recipes (no second copy).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

from datasets import Dataset

from fsdp_peft.core._compat.trl_patches import trl_without_the_checkpointing_warning
from fsdp_peft.core.distributed import ranks
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import logger
from fsdp_peft.core.run_file_names import SAMPLES_FILE
from fsdp_peft.data.formats import Example, held_out_example, source_examples
from fsdp_peft.data.sources import data_sources
from fsdp_peft.data.templates import render_example_prompt
from fsdp_peft.data.tokenize import describe_dropped
from fsdp_peft.procedures.procedure import PlannedRows, Procedure, Setup
from fsdp_peft.procedures.rewards import check_reward_funcs, resolve_reward_funcs, reward_arguments
from fsdp_peft.procedures.trainer import trl_trainer
from fsdp_peft.settings.config import RecipeArguments
from fsdp_peft.settings.fsdp_settings import RuleContext
from fsdp_peft.settings.keys import unknown_choice
from fsdp_peft.tools.decoding import compiles_here
from fsdp_peft.tools.generation import (
    GenerationSettings,
    decode_step,
    generate_completions,
    parameters_gathered,
    parse_gather_budget,
)
from fsdp_peft.tools.plan import kv_cache_bytes_per_token
from fsdp_peft.tools.validation import trl_loss_types

# the keys only the GRPO recipes read (with beta and loss_type, which DPO/KTO read too, at GRPO's defaults here)
GRPO_KEYS = (
    "reward_funcs",
    "reward_weights",
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "steps_per_generation",
    "num_iterations",
    "epsilon",
    "epsilon_high",
    "scale_rewards",
    "mask_truncated_completions",
)
SCALE_REWARDS = ("group", "batch", "none")


class GatheredRollouts:
    """Mixed into TRL's `GRPOTrainer` (`fsdp_peft.procedures.trainer.trl_trainer`): rollouts with every FSDP2 unit
    gathered once per call, prompts tokenized as the recipes' own generation tokenizes them."""

    def __init__(
        self, *args, gather_budget: str = "auto", merged_adapter: bool = True, compiled: str = "auto", **kwargs
    ):
        self.gather_budget, self.merged_adapter, self.compiled = gather_budget, merged_adapter, compiled
        super().__init__(*args, **kwargs)

    def _tokenize_prompts(self, prompts: list):
        """Rendered prompts (chat template applied by `fsdp_peft.data`) tokenized without added special tokens, as
        SFT data and held-out generation tokenize them; chat prompts as TRL does."""
        if prompts and isinstance(prompts[0], str):
            return self.processing_class(text=prompts, add_special_tokens=False)["input_ids"], None, {}
        return super()._tokenize_prompts(prompts)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's sampling, unchanged, with the FSDP2 units kept gathered for the call (up to the gather budget), 4-bit
        layers dequantized and the adapter merged into them (`fsdp_peft.tools.generation.parameters_gathered`, unless
        generate_merged_adapter is false), and the decode step compiled over a static cache where it can be
        (`fsdp_peft.tools.generation.decode_step`, generate_compiled)."""
        arguments = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(*arguments)
        budget, dequantized = parse_gather_budget(self.gather_budget), compiles_here(self.model, self.compiled)
        with parameters_gathered(self.model_wrapped, budget, self.merged_adapter, dequantized) as whole:
            width = max((len(ids) for ids in prompt_ids), default=0)
            rows = len(prompt_ids)
            with decode_step(self.model, self.compiled, whole, width, self.max_completion_length, rows) as decoding:
                configured = self.generation_config
                self.generation_config = copy.deepcopy(configured)
                self.generation_config.update(**decoding)
                try:
                    return super()._generate_single_turn(*arguments)
                finally:
                    self.generation_config = configured

    def _generate_and_score_completions(self, inputs):
        """TRL's rollouts and scores, without the FutureWarning its checkpointing switches raise (in `_compat`)."""
        with trl_without_the_checkpointing_warning():
            return super()._generate_and_score_completions(inputs)


def grpo_arguments(recipe: RecipeArguments) -> tuple[type, dict]:
    """TRL's ``GRPOConfig`` and the fields the recipe keys set (the shared ones at GRPO's defaults)."""
    from trl import GRPOConfig  # lazy: TRL only where a GRPO run starts (trainer.trl_trainer)

    return GRPOConfig, {
        "beta": recipe.beta,
        "loss_type": recipe.loss_type,
        "num_generations": recipe.num_generations,
        "max_completion_length": recipe.max_completion_length,
        "temperature": recipe.temperature,
        "top_p": recipe.top_p,
        "top_k": recipe.top_k,
        "min_p": recipe.min_p,
        "repetition_penalty": recipe.repetition_penalty,
        "steps_per_generation": recipe.steps_per_generation,
        "num_iterations": recipe.num_iterations,
        "epsilon": recipe.epsilon,
        "epsilon_high": recipe.epsilon_high,
        "scale_rewards": recipe.scale_rewards,
        "mask_truncated_completions": recipe.mask_truncated_completions,
        "reward_weights": recipe.reward_weights,
        "remove_unused_columns": False,  # the reward functions read the answer column
    }


def read_prompts(source, tokenizer, recipe: RecipeArguments) -> tuple[list[dict], list[Example]]:
    """Every row of ``source`` as ``{"prompt": rendered prompt, "answer": expected completion}``, and as the
    held-out examples generation scores (a chat ends before its last answer, which is the expected one). A prompt
    longer than ``max_seq_length`` tokens is refused (skipped with ``skip_invalid_rows``): the plan counts on it."""
    examples, dropped = source_examples(source, recipe.data_format, recipe.skip_invalid_rows)
    if dropped:
        logger.warning(f"{source}: skipped {describe_dropped(dropped)} rows (skip_invalid_rows: true)")
    examples = [held_out_example(example) for example in examples]
    if not examples:
        raise ConfigError(f"{source}: no row left to train on; fix the data")
    rows = [
        {"prompt": render_example_prompt(tokenizer, e, recipe.use_chat_template), "answer": e.completion}
        for e in examples
    ]
    lengths = [len(ids) for ids in tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]]
    too_long = [i for i, length in enumerate(lengths) if length > recipe.max_seq_length]
    if too_long and not recipe.skip_invalid_rows:
        raise ConfigError(
            f"{source}: row {too_long[0] + 1}: its prompt has {lengths[too_long[0]]} tokens, above max_seq_length "
            f"{recipe.max_seq_length} ({len(too_long)} such rows); raise max_seq_length, shorten the prompts, or "
            "set skip_invalid_rows: true"
        )
    if too_long:
        logger.warning(f"{source}: skipped {len(too_long)} rows whose prompt is longer than max_seq_length")
        kept = [i for i in range(len(rows)) if i not in set(too_long)]
        rows, examples = [rows[i] for i in kept], [examples[i] for i in kept]
    return rows, examples


def load_rl_data(recipe: RecipeArguments, tokenizer) -> tuple[Dataset, list[Example]]:
    """The training prompts (with answers for the rewards) and the held-out examples (eval data, else a split)."""
    train_source, eval_source = data_sources(recipe)
    rows, examples = read_prompts(train_source, tokenizer, recipe)
    if eval_source is not None:
        return Dataset.from_list(rows), read_prompts(eval_source, tokenizer, recipe)[1]
    held = int(len(rows) * recipe.eval_split)
    return Dataset.from_list(rows[held:]), examples[:held]


def held_out_rewards(
    model, tokenizer, examples, recipe, functions, names, device, samples_path: Path | None = None
) -> dict | None:
    """Greedy completions of the held-out prompts: exact match and each reward function's mean (rank 0; with
    ``samples_path``, one JSON line per prompt there)."""
    if not examples:
        return None
    prompts = [render_example_prompt(tokenizer, e, recipe.use_chat_template) for e in examples]
    settings = dataclasses.replace(GenerationSettings.from_recipe(recipe), max_new_tokens=recipe.max_completion_length)
    completions = generate_completions(model, tokenizer, prompts, settings, device)
    if completions is None:
        return None
    answers = [e.completion for e in examples]
    rows = [{"prompt": p, "answer": a} for p, a in zip(prompts, answers)]
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    arguments = reward_arguments(rows, completions, ids)
    means = {}
    for function, name in zip(functions, names):
        values = [v for v in function(**arguments) if v is not None]
        means[name] = sum(values) / len(values) if values else None
    hits = [c.strip() == a.strip() for c, a in zip(completions, answers)]
    if samples_path is not None:
        rows = [
            {"prompt": e.prompt, "expected": a, "generated": c, "exact": h}
            for e, a, c, h in zip(examples, answers, completions, hits)
        ]
        samples_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    exact = sum(hits) / len(examples)
    return {"prompts": len(examples), "exact_match": exact, "rewards": means}


def _load(recipe: RecipeArguments, tokenizer, training) -> tuple[Dataset, list[Example], list]:
    """The prompts, the held-out examples and the reward functions, imported and tried on the first rows: all before
    any weights load."""
    train_data, held_out = load_rl_data(recipe, tokenizer)
    functions = resolve_reward_funcs(recipe.reward_funcs)
    first = [train_data[i] for i in range(min(2, len(train_data)))]
    ids = [tokenizer(row["answer"], add_special_tokens=False)["input_ids"] for row in first]
    check_reward_funcs(functions, recipe.reward_funcs, first, ids)
    return train_data, held_out, functions


def rollout_trainer() -> type:
    """TRL's `GRPOTrainer` with the recipes' behaviour and `GatheredRollouts` (built on first use: TRL only where a
    GRPO run starts); the GRPO check in tests/distributed/ and benchmarks/grpo_rollouts.py put a subclass here."""
    return trl_trainer("GRPOTrainer", GatheredRollouts)


def _trainer(setup: Setup, shared: dict):
    train_data, _, functions = setup.data
    generation = {"gather_budget": setup.recipe.generate_gather_budget}
    generation["merged_adapter"] = setup.recipe.generate_merged_adapter
    generation["compiled"] = setup.recipe.generate_compiled
    return rollout_trainer()(setup.model, reward_funcs=functions, train_dataset=train_data, **generation, **shared)


def _score(setup: Setup, model, samples_path: Path | None = None) -> dict | None:
    recipe, (_, held_out, functions) = setup.recipe, setup.data
    samples = held_out[: recipe.generate_samples]
    names, device = recipe.reward_funcs, setup.training.device
    return held_out_rewards(model, setup.tokenizer, samples, recipe, functions, names, device, samples_path)


def _after(trainer, setup: Setup, before: dict | None, output_dir: Path) -> dict:
    after = _score(setup, trainer.model, output_dir / SAMPLES_FILE)
    return {"loss_name": "GRPO", "held_out_before": before, "held_out_after": after}


def summary_lines(results: dict, output_dir: Path) -> list[str]:
    """A GRPO run's own summary lines: greedy completions of the held-out prompts scored, before and after."""
    before, after = results["held_out_before"], results["held_out_after"]
    if after is None:
        return []
    lines = [f"held-out prompts: {after['prompts']} (greedy completions)"]
    scores = [("exact match", before and before["exact_match"], after["exact_match"])]
    scores += [
        (f"reward {name}", before and before["rewards"][name], value) for name, value in after["rewards"].items()
    ]
    for label, was, now in scores:
        shown = "n/a (resumed)" if before is None else "n/a" if was is None else f"{was:.3f}"
        lines.append(f"  {label}: before {shown}, after {'n/a' if now is None else f'{now:.3f}'}")
    lines.append(f"samples: {output_dir / SAMPLES_FILE}")
    return lines


def _rl_loss_is_known(context: RuleContext) -> str | None:
    recipe = context.recipe
    if recipe.loss_type is not None and recipe.loss_type not in trl_loss_types("GRPOConfig"):
        return unknown_choice("loss_type", recipe.loss_type, trl_loss_types("GRPOConfig"))
    if recipe.scale_rewards not in SCALE_REWARDS:
        return unknown_choice("scale_rewards", recipe.scale_rewards, SCALE_REWARDS)
    return None


def _rl_has_rewards(context: RuleContext) -> str | None:
    recipe = context.recipe
    names = [recipe.reward_funcs] if isinstance(recipe.reward_funcs, str) else list(recipe.reward_funcs or ())
    if not names or not all(str(name).strip() for name in names):
        return (
            f"reward_funcs: {recipe.reward_funcs!r} names no reward function; GRPO needs at least one (exact_answer, "
            "math_answer, math_format, or module:function)"
        )
    if recipe.reward_weights is not None and len(recipe.reward_weights) != len(recipe.reward_funcs):
        return (
            f"reward_weights: {len(recipe.reward_weights)} weights for {len(recipe.reward_funcs)} reward functions; "
            "give one weight per function, or none (1.0 each)"
        )
    return None


def _rl_groups_fill_the_batch(context: RuleContext) -> str | None:
    """TRL samples each prompt ``num_generations`` times inside one generation batch (every rank's rows
    over ``steps_per_generation`` micro-steps); a group must not be cut."""
    recipe, training = context.recipe, context.training
    if recipe.num_generations < 2:  # out of keys.RANGES: said there
        return None
    per_rank = int(training.get("per_device_train_batch_size") or 8)
    steps = recipe.steps_per_generation or int(training.get("gradient_accumulation_steps") or 1)
    batch = per_rank * ranks().world_size * steps
    if batch % recipe.num_generations:
        return (
            f"num_generations: {recipe.num_generations} does not divide the generation batch of {batch} completions "
            f"(per_device_train_batch_size {per_rank} x {ranks().world_size} ranks x steps_per_generation {steps}); "
            "change one of them"
        )
    return None


def _rl_checkpoints_on_generation_boundaries(context: RuleContext) -> str | None:
    """TRL regenerates rollouts every ``steps_per_generation x num_iterations`` micro-steps and keeps the batch in
    memory between; a checkpoint does not hold it, so a run resumed mid-cycle would train on new rollouts where the
    uninterrupted one reuses the old. Checkpoints on cycle boundaries resume exactly (the RNG states restored)."""
    recipe, training = context.recipe, context.training
    if str(training.get("save_strategy") or "steps") != "steps":
        return None
    accumulation = int(training.get("gradient_accumulation_steps") or 1)
    cycle = (recipe.steps_per_generation or accumulation) * recipe.num_iterations
    save_steps = float(training.get("save_steps") or 500)  # below 1: a fraction of the run, not checked here
    if save_steps >= 1 and int(save_steps) * accumulation % cycle:
        return (
            f"save_steps: {save_steps:g} puts checkpoints inside a rollout cycle of {cycle} micro-steps "
            f"(steps_per_generation x num_iterations), which a resume cannot repeat; use a multiple of "
            f"{cycle // math.gcd(cycle, accumulation)} optimizer steps"
        )
    return None


def _rollouts(recipe, training: dict, model_config, compute_bytes: int, per_rank: int, tokens: int) -> PlannedRows:
    """A row is a prompt and one sampled completion; the rollouts' KV cache is held beside the activations."""
    sequence = recipe.max_seq_length + recipe.max_completion_length
    sampled = per_rank * (recipe.steps_per_generation or int(training.get("gradient_accumulation_steps") or 1))
    note = (
        f"GRPO: each rank samples {sampled} completions per generate call (per_device_train_batch_size x "
        "steps_per_generation), prompts counted at max_seq_length tokens plus max_completion_length; the "
        "other ranks' base shards (gathered for the call, up to generate_gather_budget) and the KV cache are "
        "counted beside the activations (generation and training do not overlap, so the total is an upper "
        "bound); log-probs come from TRL's fused head, as for DPO"
    )
    cache = sampled * sequence * kv_cache_bytes_per_token(model_config, compute_bytes)
    return PlannedRows(per_rank * sequence, cache, note)


GRPO_PROCEDURE = Procedure(
    name="rl",
    about="GRPO",
    load_data=_load,
    trainer=_trainer,
    before=lambda trainer, setup, model: _score(setup, model),
    after=_after,
    summary_lines=summary_lines,
    arguments=grpo_arguments,
    keys=(*GRPO_KEYS, "beta", "loss_type", "ref_model"),
    defaults={"beta": 0.0, "loss_type": "dapo"},  # TRL's GRPOConfig's
    recognised_by=GRPO_KEYS,
    rules=(_rl_loss_is_known, _rl_has_rewards, _rl_groups_fill_the_batch, _rl_checkpoints_on_generation_boundaries),
    through_trl=True,
    planned_rows=_rollouts,
    samples_rollouts=True,
)
