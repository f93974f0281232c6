"""Preference tuning, the procedure of the DPO/KTO recipes (`fsdp_peft.procedures.procedure.Procedure`): DPO through
TRL's `DPOTrainer`, KTO through its `KTOTrainer`, with the SFT trainer's FSDP behaviour for PEFT.

Its data: preference pairs (or rated completions for KTO), every row checked before any weights load. Its
trainer: TRL's, the reference being the policy itself with its adapter disabled: the same sharded base, no second
copy (`fsdp_peft.procedures.trainer.ReferenceWithoutCopy`). With ``precompute_ref_log_probs`` the reference log-probs
are computed once, before training. Its score, before and after training: held-out rewards and log-probs, and greedy
generation compared with both answers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from datasets import load_from_disk

from fsdp_peft.core._compat.trl_patches import trl_without_the_checkpointing_warning
from fsdp_peft.core.run_file_names import SAMPLES_FILE
from fsdp_peft.data.preference import PreferenceExample, load_preference_data, render_pair
from fsdp_peft.model.loading import low_memory_loading_requested
from fsdp_peft.procedures.procedure import PlannedRows, Procedure, Setup
from fsdp_peft.procedures.trainer import first_rows, trl_trainer
from fsdp_peft.settings.config import RecipeArguments
from fsdp_peft.settings.fsdp_settings import RuleContext
from fsdp_peft.settings.keys import unknown_choice
from fsdp_peft.tools.generation import GenerationSettings, generate_completions
from fsdp_peft.tools.plan import TRL_TOKEN_TILE, TRL_VOCAB_TILE
from fsdp_peft.tools.runs import PREFERENCE_DATA_DIR
from fsdp_peft.tools.validation import trl_loss_types


def is_unpaired(recipe: RecipeArguments) -> bool:
    """KTO's losses train on rated completions, not pairs."""
    return recipe.loss_type in trl_loss_types("KTOConfig")


def preference_arguments(recipe: RecipeArguments) -> tuple[type, dict]:
    """TRL's config class (``DPOConfig``, or ``KTOConfig`` for KTO) and the fields the recipe keys set."""
    from trl import (  # lazy: TRL only where a DPO/KTO run starts (trainer.trl_trainer)
        DPOConfig,
        KTOConfig,
    )

    shared = {
        "beta": recipe.beta,
        "precompute_ref_log_probs": recipe.precompute_ref_log_probs,
        "max_length": recipe.max_seq_length,
    }
    if is_unpaired(recipe):
        # KTO's KL estimate pairs each completion with its batch neighbours: TRL needs the data in order
        sampling = "sequential" if recipe.loss_type == "kto" else "random"
        return KTOConfig, {**shared, "loss_type": recipe.loss_type, "train_sampling_strategy": sampling}
    truncation = "keep_end" if recipe.truncation == "left" else "keep_start"
    return DPOConfig, {**shared, "loss_type": [recipe.loss_type], "truncation_mode": truncation}


@torch.no_grad()
def held_out_preference(trainer, dataset, batch_size: int, pairs_path: Path | None = None) -> dict | None:
    """Per held-out pair: policy and reference log-probs of chosen and rejected, and the implicit rewards.

    With ``pairs_path``, rank 0 writes them, one JSON line per pair (``[chosen, rejected]`` each).

    Returns means and accuracies: ``reward_accuracy`` (chosen reward above rejected; a tie, as when the
    policy still equals the reference, counts half), ``margin``, ``logp_chosen``/``logp_rejected`` (policy)
    and ``logp_accuracy`` (the policy gives chosen the higher log-prob). Every rank runs every batch
    (FSDP forwards are collective) and gets the same numbers.
    """
    if dataset is None or len(dataset) == 0:
        return None
    model = trainer.model_wrapped if trainer.model_wrapped is not None else trainer.model
    was_training = model.training
    model.eval()
    device = trainer.accelerator.device
    columns = [c for c in ("prompt_ids", "chosen_ids", "rejected_ids") if c in dataset.column_names]
    rows = dataset.select_columns(columns)
    policy, reference = [], []
    with trl_without_the_checkpointing_warning():  # TRL's reference forward reads a deprecated name (_compat)
        try:
            for start in range(0, len(rows), batch_size):
                batch = trainer.data_collator([rows[i] for i in range(start, min(start + batch_size, len(rows)))])
                batch = {key: value.to(device) for key, value in batch.items()}
                reference.append(torch.stack(trainer.compute_ref_log_probs(model, batch), dim=1).float().cpu())
                policy.append(torch.stack(policy_log_probs(trainer, model, batch), dim=1).float().cpu())
        finally:
            model.train(was_training)
    policy, reference = torch.cat(policy), torch.cat(reference)
    rewards = trainer.beta * (policy - reference)
    margin = rewards[:, 0] - rewards[:, 1]
    if pairs_path is not None and trainer.is_world_process_zero():
        rows = [{"policy": p, "reference": r} for p, r in zip(policy.tolist(), reference.tolist())]
        pairs_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {
        "pairs": len(rows),
        "reward_accuracy": ((margin > 0).float() + 0.5 * (margin == 0).float()).mean().item(),
        "margin": margin.mean().item(),
        "logp_chosen": policy[:, 0].mean().item(),
        "logp_rejected": policy[:, 1].mean().item(),
        "logp_accuracy": (policy[:, 0] > policy[:, 1]).float().mean().item(),
        "ref_logp_chosen": reference[:, 0].mean().item(),
        "ref_logp_rejected": reference[:, 1].mean().item(),
    }


def held_out_pairs(dataset, count: int):
    """The first ``count`` held-out pairs (``generate_samples``), the ones generation completes too."""
    if dataset is None or count == 0:
        return None
    return first_rows(dataset, count)


def policy_log_probs(trainer, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of the chosen and rejected completions under the policy (adapter on), as TRL sums them."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    inputs = {k: v for k, v in batch.items() if k not in ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")}
    with trainer.accelerator.autocast():
        per_token = model(**inputs, use_cache=False, labels=labels, fused_lm_head=True).log_probs
    per_token = per_token[:, -(batch["completion_mask"].size(1) - 1) :]
    return per_token.sum(dim=1).chunk(2, dim=0)


def generation_preference(
    model, tokenizer, examples: list[PreferenceExample], recipe: RecipeArguments, device, samples_path: Path | None
) -> dict | None:
    """Greedy completions of the held-out prompts, each compared with both answers (rank 0; ``None`` elsewhere).

    A completion prefers the answer it shares the longer beginning with (characters); ``chosen``,
    ``rejected`` and ``exact_chosen`` are fractions of the prompts.
    """
    if not examples:
        return None
    prompts = [render_pair(example, tokenizer, recipe)["prompt"] for example in examples]
    completions = generate_completions(model, tokenizer, prompts, GenerationSettings.from_recipe(recipe), device)
    if completions is None:
        return None
    chosen = rejected = exact = 0
    rows = []
    for example, completion in zip(examples, completions):
        text = completion.strip()
        to_chosen, to_rejected = _shared_start(text, example.chosen), _shared_start(text, example.rejected)
        chosen += to_chosen > to_rejected
        rejected += to_rejected > to_chosen
        exact += text == example.chosen.strip()
        rows.append(
            {"prompt": example.prompt, "chosen": example.chosen, "rejected": example.rejected, "generated": text}
        )
    if samples_path is not None:
        samples_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    count = len(examples)
    return {"prompts": count, "chosen": chosen / count, "rejected": rejected / count, "exact_chosen": exact / count}


def _shared_start(text: str, answer: str) -> int:
    answer = answer.strip()
    return next((i for i, (a, b) in enumerate(zip(text, answer)) if a != b), min(len(text), len(answer)))


def shared_on_disk(dataset, training, name: str):
    """``dataset`` saved by rank 0 under ``output_dir/.preference_data/<name>`` and read back by every rank.

    TRL caches precomputed reference log-probs beside the dataset's files and every rank reads rank 0's
    cache file; an in-memory dataset has none (each process would look in its own temporary directory).
    """
    if dataset is None:
        return None
    path = Path(training.output_dir) / PREFERENCE_DATA_DIR / name
    with training.main_process_first(local=False, desc=f"{name} preference data"):
        if training.process_index == 0:
            dataset.save_to_disk(str(path))
        return load_from_disk(str(path))


def _load(recipe: RecipeArguments, tokenizer, training) -> tuple:
    train_data, eval_data, held_out = load_preference_data(recipe, tokenizer, is_unpaired(recipe))
    if recipe.precompute_ref_log_probs:
        train_data, eval_data = (
            shared_on_disk(d, training, name) for d, name in ((train_data, "train"), (eval_data, "eval"))
        )
    return train_data, eval_data, held_out


def _trainer(setup: Setup, shared: dict):
    train_data, eval_data, _ = setup.data
    # KTO's losses through TRL's KTOTrainer, the others through its DPOTrainer
    trainer_class = trl_trainer("KTOTrainer" if is_unpaired(setup.recipe) else "DPOTrainer")
    return trainer_class(setup.model, train_dataset=train_data, eval_dataset=eval_data, **shared)


def _samples(setup: Setup) -> list[PreferenceExample]:
    """The held-out pairs scored and completed (none for KTO: held-out scoring compares pairs)."""
    return [] if is_unpaired(setup.recipe) else setup.data[2][: setup.recipe.generate_samples]


def _scores(trainer, setup: Setup, model, name: str, samples_path: Path | None = None) -> dict:
    """Held-out preference (rewards, log-probs; in ``held_out_<name>.jsonl``) and greedy generation."""
    samples, training = _samples(setup), setup.training
    pairs = held_out_pairs(trainer.eval_dataset, len(samples))
    pairs_path = Path(training.output_dir) / f"held_out_{name}.jsonl"
    metrics = held_out_preference(trainer, pairs, training.per_device_eval_batch_size, pairs_path)
    generation = generation_preference(model, setup.tokenizer, samples, setup.recipe, training.device, samples_path)
    return {"preference": metrics, "generation": generation}


def _before(trainer, setup: Setup, model) -> dict:
    return _scores(trainer, setup, model, "before")


def _after(trainer, setup: Setup, before: dict | None, output_dir: Path) -> dict:
    after = _scores(trainer, setup, trainer.model, "after", output_dir / SAMPLES_FILE)
    return {
        "loss_name": "KTO" if is_unpaired(setup.recipe) else "DPO",
        "preference_before": before and before["preference"],
        "preference_after": after["preference"],
        "generation_before": before and before["generation"],
        "generation_after": after["generation"],
    }


def summary_lines(results: dict, output_dir: Path) -> list[str]:
    """A preference run's own summary lines: held-out rewards and greedy generation, before and after."""
    lines = []
    before, after = results["preference_before"], results["preference_after"]
    if after is not None:
        lines.append(f"held-out pairs: {after['pairs']} (reward = beta x (policy - reference log-prob))")
        for key, label in (
            ("reward_accuracy", "reward accuracy (chosen reward higher; ties half)"),
            ("margin", "reward margin (chosen - rejected)"),
            ("logp_chosen", "log-prob of chosen"),
            ("logp_rejected", "log-prob of rejected"),
        ):
            shown = "n/a (resumed)" if before is None else f"{before[key]:.3f}"
            lines.append(f"  {label}: before {shown}, after {after[key]:.3f}")
    generation_before, generation_after = results["generation_before"], results["generation_after"]
    if generation_after is not None:
        shown = "n/a (resumed)" if generation_before is None else _closer_to(generation_before)
        lines.append(f"greedy generation on {generation_after['prompts']} held-out prompts, closer to chosen/rejected:")
        lines.append(f"  before {shown}; after {_closer_to(generation_after)}")
        lines.append(f"samples: {output_dir / SAMPLES_FILE}")
    return lines


def _closer_to(generation: dict) -> str:
    return (
        f"{generation['chosen']:.3f} / {generation['rejected']:.3f} (exactly chosen {generation['exact_chosen']:.3f})"
    )


def preference_loss_types() -> tuple[str, ...]:
    """DPO's losses, then KTO's (which train on rated completions, not pairs)."""
    return trl_loss_types("DPOConfig") + trl_loss_types("KTOConfig")


def _preference_loss_is_known(context: RuleContext) -> str | None:
    recipe = context.recipe
    if recipe.loss_type is not None and recipe.loss_type not in preference_loss_types():
        return unknown_choice("loss_type", recipe.loss_type, preference_loss_types())
    return None


def _preference_beta_is_positive(context: RuleContext) -> str | None:
    recipe = context.recipe
    if recipe.beta == 0:  # below 0: out of keys.RANGES, said there
        return f"beta: must be above 0 for DPO/KTO (the reference's pull), got {recipe.beta}"
    return None


def _precomputed_reference_sees_the_weights(context: RuleContext) -> str | None:
    recipe, training = context.recipe, context.training
    if recipe.precompute_ref_log_probs and low_memory_loading_requested(training):
        return (
            "precompute_ref_log_probs: true runs the reference before FSDP shards the model, but with "
            "cpu_ram_efficient_loading only rank 0 has weights then; set cpu_ram_efficient_loading: false or "
            "precompute_ref_log_probs: false"
        )
    return None


def _pairs(recipe, training: dict, model_config, compute_bytes: int, per_rank: int, tokens: int) -> PlannedRows:
    note = (
        "preference (DPO): each pair is 2 sequences (chosen + rejected), counted in the tokens per rank; "
        "the reference pass (same model, adapter disabled, no grad) runs before the policy's forward and "
        "keeps nothing for backward; no second copy of the base; log-probs come from TRL's fused head (tiles "
        f"of {TRL_TOKEN_TILE} tokens x {TRL_VOCAB_TILE} vocabulary columns, never the full logits), whatever "
        "loss_chunk_tokens says"
    )
    return PlannedRows(2 * tokens, note=note)


PREFERENCE_PROCEDURE = Procedure(
    name="preference",
    about="DPO/KTO",
    load_data=_load,
    trainer=_trainer,
    before=_before,
    after=_after,
    summary_lines=summary_lines,
    arguments=preference_arguments,
    keys=("beta", "loss_type", "precompute_ref_log_probs", "ref_model"),
    defaults={"beta": 0.1, "loss_type": "sigmoid"},  # TRL's DPOConfig's
    # a loose YAML with beta or loss_type but no GRPO key (the registry asks GRPO first) is a DPO/KTO config
    recognised_by=("beta", "loss_type", "precompute_ref_log_probs", "ref_model"),
    rules=(_preference_loss_is_known, _preference_beta_is_positive, _precomputed_reference_sees_the_weights),
    through_trl=True,
    planned_rows=_pairs,
)
