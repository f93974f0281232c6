"""Preference tuning (DPO through TRL's `DPOTrainer`, KTO through its `KTOTrainer`), with the SFT trainer's FSDP
behaviour for PEFT.

parse config → claim output_dir → tokenizer → preference data (every row checked, before any weights load) →
model and adapters → trainer → held-out preference before → train → save adapter → held-out preference after →
greedy generation → report. The start (`fsdp_peft.recipe.start_training`), checkpoints, resume, adapter saving
and the CPU FSDP mode are shared with SFT.

The reference model is the policy itself with its adapter disabled: the same sharded base, no second
copy (TRL would add a frozen "ref" copy of an adapter it did not create; `PreferenceTrainer` removes
it). With ``precompute_ref_log_probs`` the reference log-probs are computed once, before training.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from datasets import load_from_disk
from transformers import TrainerCallback
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

from fsdp_peft._compat import fsdp2_accumulation_skips_ungathered_parameters, trl_without_the_checkpointing_warning
from fsdp_peft.config import PREFERENCE, RecipeArguments
from fsdp_peft.data.preference import PreferenceExample, load_preference_data, render_pair
from fsdp_peft.dtypes import trainable_dtypes_kept
from fsdp_peft.ending import end_run
from fsdp_peft.generation import GenerationSettings, generate_completions
from fsdp_peft.log import configure_for_training
from fsdp_peft.modeling import build_model
from fsdp_peft.recipe import (
    parse_recipe_config,
    start_training,
)
from fsdp_peft.run_files import SAMPLES_FILE
from fsdp_peft.runs import PREFERENCE_DATA_DIR
from fsdp_peft.trainer import PeftFsdpMixin
from fsdp_peft.validation import KTO_LOSS_TYPES


class ReferenceWithoutCopy:
    """For TRL's `DPOTrainer`, `KTOTrainer` and `GRPOTrainer`: the reference is the adapter-disabled policy,
    adapters as built.

    Two things their ``__init__`` does to a `PeftModel` built by `fsdp_peft.modeling` are undone: the
    frozen "ref" adapter it adds (a second adapter copy; with a fresh adapter the disabled adapter is the
    same reference), and the bf16 cast of a 4-bit base's adapter weights (they stay in the dtype
    `attach_lora` chose, fp32 master weights as in SFT). Their fused log-prob head leaves the output head's
    FSDP2 unit ungathered, which gradient accumulation under mixed precision needs patched
    (`fsdp_peft._compat.fsdp2_accumulation_skips_ungathered_parameters`).
    """

    head_read_directly = True  # FSDP1: the head stays in the root unit (fsdp_peft.fsdp_policies.fsdp1_wrap_policy)

    def __init__(self, model, *args, **kwargs):
        fsdp2_accumulation_skips_ungathered_parameters()  # TRL's fused head leaves the head's unit ungathered
        with trl_without_the_checkpointing_warning(), trainable_dtypes_kept(model):  # TRL casts adapters to bf16
            super().__init__(model, *args, **kwargs)  # (DPO may compute the reference log-probs here)
        if "ref" in self.model.peft_config:
            self.model.delete_adapter("ref")
        self.trainable_parameter_names = [n for n, p in self.model.named_parameters() if p.requires_grad]

    def compute_loss(self, *args, **kwargs):
        """TRL's loss, without the FutureWarning its reference forward raises (`fsdp_peft._compat`)."""
        with trl_without_the_checkpointing_warning():
            return super().compute_loss(*args, **kwargs)


class PreferenceTrainer(ReferenceWithoutCopy, PeftFsdpMixin, DPOTrainer):
    """TRL's `DPOTrainer` with the recipes' FSDP behaviour; the reference is the adapter-disabled policy."""


class UnpairedPreferenceTrainer(ReferenceWithoutCopy, PeftFsdpMixin, KTOTrainer):
    """TRL's `KTOTrainer` (``loss_type: kto``) with the recipes' FSDP behaviour, the same reference."""


def is_unpaired(recipe: RecipeArguments) -> bool:
    """KTO's losses train on rated completions, not pairs."""
    return recipe.loss_type in KTO_LOSS_TYPES


def preference_arguments(recipe: RecipeArguments) -> tuple[type, dict]:
    """TRL's config class (``DPOConfig``, or ``KTOConfig`` for KTO) and the fields the recipe keys set."""
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


def parse_preference_config(argv: list[str], default_config: Path, default_output_dir: str):
    """Recipe arguments and TRL's ``DPOConfig`` (or ``KTOConfig``): the training keys plus the preference keys,
    checked by the rules that guard the preference procedure (`fsdp_peft.validation.RULES`)."""
    return parse_recipe_config(argv, default_config, default_output_dir, preference_arguments, PREFERENCE)


@torch.no_grad()
def held_out_preference(trainer: DPOTrainer, dataset, batch_size: int, pairs_path: Path | None = None) -> dict | None:
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
    return dataset.select(range(min(count, len(dataset))))


def policy_log_probs(trainer: DPOTrainer, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
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


class PreferenceBeforeTraining(TrainerCallback):
    """Held-out preference and greedy generation on the prepared (sharded) model, before the first step."""

    def __init__(self, tokenizer, examples: list[PreferenceExample], recipe: RecipeArguments):
        self.tokenizer, self.examples, self.recipe = tokenizer, examples, recipe
        self.trainer: PreferenceTrainer | None = None
        self.metrics: dict | None = None
        self.generation: dict | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.trainer is None or state.global_step != 0:
            return  # a resumed run is not scored again
        pairs = held_out_pairs(self.trainer.eval_dataset, len(self.examples))
        path = Path(args.output_dir) / "held_out_before.jsonl"
        self.metrics = held_out_preference(self.trainer, pairs, args.per_device_eval_batch_size, path)
        self.generation = generation_preference(model, self.tokenizer, self.examples, self.recipe, args.device, None)


def run_preference(name: str, default_config: Path, argv: list[str] | None) -> dict | None:
    """The DPO procedure of `fsdp_peft.recipe.run_recipe`; returns the results dict on rank 0."""
    started = time.monotonic()
    recipe, training = parse_preference_config(
        sys.argv[1:] if argv is None else argv, default_config, f"outputs/{name}"
    )
    configure_for_training(training)
    run, checkpoint, tokenizer = start_training(recipe, training)
    unpaired = is_unpaired(recipe)
    train_data, eval_data, held_out = load_preference_data(recipe, tokenizer, unpaired)
    model = build_model(recipe, training, tokenizer)  # after the data: a bad row stops the run before weights load
    if recipe.precompute_ref_log_probs:
        train_data, eval_data = (
            shared_on_disk(d, training, name) for d, name in ((train_data, "train"), (eval_data, "eval"))
        )
    samples = [] if unpaired else held_out[: recipe.generate_samples]  # held-out scoring compares pairs
    before = PreferenceBeforeTraining(tokenizer, samples, recipe)
    trainer = (UnpairedPreferenceTrainer if unpaired else PreferenceTrainer)(
        model,
        args=training,
        train_dataset=train_data,
        eval_dataset=eval_data,
        processing_class=tokenizer,
        fsdp_reduce_dtype=getattr(torch, recipe.fsdp_reduce_dtype),
        callbacks=[before],
        recipe_config=dataclasses.asdict(recipe),
        run=run,
    )
    before.trainer = trainer

    train_output = trainer.train(resume_from_checkpoint=checkpoint)

    def measure(output_dir: Path) -> dict:
        pairs = held_out_pairs(trainer.eval_dataset, len(samples))
        batch_size = training.per_device_eval_batch_size
        after = held_out_preference(trainer, pairs, batch_size, output_dir / "held_out_after.jsonl")
        samples_path = output_dir / SAMPLES_FILE
        generation = generation_preference(trainer.model, tokenizer, samples, recipe, trainer.args.device, samples_path)
        return {
            "loss_name": "KTO" if unpaired else "DPO",
            "preference_before": before.metrics,
            "preference_after": after,
            "generation_before": before.generation,
            "generation_after": generation,
        }

    return end_run(trainer, recipe, name, PREFERENCE, started, train_output, measure)
