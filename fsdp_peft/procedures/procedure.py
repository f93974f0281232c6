"""What a fine-tuning procedure is: the parts that differ between SFT, vision-language SFT, preference (DPO/KTO)
and GRPO.

The skeleton that runs every procedure is `fsdp_peft.recipe.run_recipe`; a procedure is a `Procedure` value
(`fsdp_peft.procedures.sft.SFT_PROCEDURE`, `fsdp_peft.procedures.vision_sft.VISION_SFT_PROCEDURE`,
`fsdp_peft.procedures.preference.PREFERENCE_PROCEDURE`, `fsdp_peft.procedures.rl.GRPO_PROCEDURE`), one module each,
none importing another. The skeleton calls the parts in this order:

``arguments`` (TRL's config class, when the procedure trains through TRL) → ``load_data`` (every row checked,
before any weights load) → the model → ``trainer`` → ``before`` (on the prepared, sharded model, at the first
step) → train → ``after`` (the results, after the adapter is saved) → ``summary_lines`` (the summary's lines of
those results, which ``fsdp-peft summary`` prints again from ``results.json``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from transformers import TrainerCallback, TrainingArguments

from fsdp_peft.settings.config import RecipeArguments


@dataclass
class Setup:
    """What the skeleton has built when the procedure makes its trainer, and later measures with."""

    recipe: RecipeArguments
    training: TrainingArguments
    tokenizer: Any
    data: Any  # what the procedure's ``load_data`` returned
    model: Any = None
    checkpoint: str | None = None  # the checkpoint training resumes from


def plain_arguments(recipe: RecipeArguments) -> tuple[type[TrainingArguments], dict]:
    """Transformers' own ``TrainingArguments``, no extra fields: for a procedure that does not train through TRL."""
    return TrainingArguments, {}


@dataclass(frozen=True)
class Procedure:
    """One procedure's parts (see the module docstring for the order the skeleton calls them in)."""

    name: str  # ``results["procedure"]`` and the procedure the rules guard (`fsdp_peft.settings.config.SFT` ...)
    load_data: Callable[[RecipeArguments, Any, TrainingArguments], Any]  # (recipe, tokenizer, training) -> data
    trainer: Callable[[Setup, dict], Any]  # (setup, the Trainer arguments every procedure passes) -> trainer
    before: Callable[[Any, Setup, Any], Any]  # (trainer, setup, prepared model) -> the score before training
    after: Callable[[Any, Setup, Any, Path], dict]  # (trainer, setup, before, output_dir) -> results.json keys
    summary_lines: Callable[[dict, Path], list[str]]  # (results, output_dir) -> the summary's own lines
    arguments: Callable[[RecipeArguments], tuple[type[TrainingArguments], dict]] = plain_arguments
    training_defaults: dict = field(default_factory=dict)  # TrainingArguments values where the config sets none


class ScoredBeforeTraining(TrainerCallback):
    """Runs the procedure's ``before`` when training starts: on the prepared (sharded) model, before the first step.

    Scoring there rather than before ``Trainer.train`` means generation always runs on the model as FSDP holds
    it, also when ranks other than 0 start without weights. A resumed run is not scored again (``result`` stays
    ``None``, which the summary shows as "n/a (resumed)").
    """

    def __init__(self, procedure: Procedure, setup: Setup):
        self.procedure, self.setup = procedure, setup
        self.trainer = None  # set by the skeleton once the trainer exists
        self.result = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            self.result = self.procedure.before(self.trainer, self.setup, model)
