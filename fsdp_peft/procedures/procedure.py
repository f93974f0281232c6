"""What a fine-tuning procedure is: the parts that differ between SFT, vision-language SFT, preference (DPO/KTO)
and GRPO.

The skeleton that runs every procedure is `fsdp_peft.recipe.run_recipe`; a procedure is a `Procedure` value
(`fsdp_peft.procedures.sft.SFT_PROCEDURE`, `fsdp_peft.procedures.vision_sft.VISION_SFT_PROCEDURE`,
`fsdp_peft.procedures.preference.PREFERENCE_PROCEDURE`, `fsdp_peft.procedures.rl.GRPO_PROCEDURE`), one module each,
none importing another. The skeleton calls the parts in this order:

``arguments`` (TRL's config class, when the procedure trains through TRL) → ``load_data`` (every row checked,
before any weights load) → the model → ``trainer`` → ``before`` (on the prepared, sharded model, at the first
step) → train → ``after`` (the results, after the adapter is saved, into ``results.json``) → ``summary_lines``
(the summary's lines of those results).

A procedure also owns what the config checks and the plan need of it, before any of that runs: the keys it reads
that SFT does not (``keys``, with its own ``defaults`` of the ones it shares with another), the keys that make a
loose YAML its config
(``recognised_by``), its own ``rules`` (run after the ones every procedure shares, `fsdp_peft.tools.validation.RULES`,
whose guards ask the procedure's traits, never its name), whether it trains through TRL (``through_trl``), and what
one row puts through the model (``planned_rows``). Its name is spelled in its own module only;
`fsdp_peft.procedures.registry` lists every procedure and finds a recipe's, or a config's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from transformers import TrainerCallback, TrainingArguments

from fsdp_peft.core.run_file_names import SAMPLES_FILE
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
class PlannedRows:
    """What one micro-batch of a procedure puts through the model, for the plan (`fsdp_peft.tools.plan`)."""

    tokens: int  # tokens per rank in one forward
    cache_bytes: int = 0  # a KV cache held beside the activations (GRPO's rollouts)
    note: str | None = None  # how the tokens are counted, for the plan's notes


@dataclass(frozen=True)
class Procedure:
    """One procedure's parts (see the module docstring for the order the skeleton calls them in)."""

    name: str  # ``results["procedure"]``
    about: str  # what a message calls its recipes: "SFT", "DPO/KTO", "GRPO"
    load_data: Callable[[RecipeArguments, Any, TrainingArguments], Any]  # (recipe, tokenizer, training) -> data
    trainer: Callable[[Setup, dict], Any]  # (setup, the Trainer arguments every procedure passes) -> trainer
    before: Callable[[Any, Setup, Any], Any]  # (trainer, setup, prepared model) -> the score before training
    after: Callable[[Any, Setup, Any, Path], dict]  # (trainer, setup, before, output_dir) -> results.json keys
    summary_lines: Callable[[dict, Path], list[str]]  # (results, output_dir) -> the summary's own lines
    arguments: Callable[[RecipeArguments], tuple[type[TrainingArguments], dict]] = plain_arguments
    training_defaults: dict = field(default_factory=dict)  # TrainingArguments values where the config sets none
    # the recipe keys it reads that SFT does not; the recipe of a procedure that reads none of them refuses them
    keys: tuple[str, ...] = ()
    # its defaults of the keys it shares with another procedure (TRL's), where the config sets none
    defaults: dict = field(default_factory=dict)
    # a YAML whose recipe is unknown and that sets one of these is this procedure's config
    recognised_by: tuple[str, ...] = ()
    # its own rules (``rule(context) -> problem or None``), reported after the shared ones
    rules: tuple[Callable, ...] = ()
    # trains through TRL's trainers: their fused log-prob head; no XLA route, EVA or sequence split
    through_trl: bool = False
    # (recipe, training values, model config, compute bytes, rows per rank, tokens of one sequence a row per rank)
    # -> PlannedRows; None: a row is one sequence (SFT), and the plan may also find the longest one that fits
    planned_rows: Callable[[RecipeArguments, dict, Any, int, int, int], PlannedRows] | None = None
    # samples its training rows with generate (GRPO's rollouts): a QLoRA run's plan chooses their 4-bit copies
    samples_rollouts: bool = False

    def with_defaults(self, recipe: RecipeArguments) -> RecipeArguments:
        """``recipe`` with the shared keys it leaves unset (``beta``, ``loss_type``) at this procedure's defaults."""
        unset = {key: value for key, value in self.defaults.items() if getattr(recipe, key) is None}
        return dataclasses.replace(recipe, **unset) if unset else recipe


def exact_match_lines(results: dict, output_dir: Path) -> list[str]:
    """The summary lines of a procedure scored by held-out exact match (SFT, vision-language SFT): eval loss, exact
    match before and after training, the samples' file."""
    lines = []
    if results["eval_loss"] is not None:
        lines.append(f"eval loss {results['eval_loss']:.4f}")
    if results["exact_match_after"] is not None:
        before = results["exact_match_before"]
        before_text = "n/a (resumed)" if before is None else f"{before:.3f}"
        lines.append(
            f"exact match on {results['generated_samples']} held-out prompts: "
            f"before training {before_text}, after {results['exact_match_after']:.3f}"
        )
        lines.append(f"samples: {output_dir / SAMPLES_FILE}")
    return lines


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
