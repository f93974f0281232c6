"""The fine-tuning procedure every recipe runs, top to bottom.

parse config → claim output_dir → tokenizer → data (every row checked, before any weights load) → model
and adapters → trainer → accuracy before → train → save adapter → evaluate → generate from the sharded
model → report (summary, ``results.json``, loss curve). A start that fails before the first optimizer step
leaves ``output_dir`` as it found it (`fsdp_peft.runs`).
The SFT recipes differ only in their default config (``configs/<recipe>/tiny.yaml``), so they share this one
function; model families differ only in their entry in `fsdp_peft.families`. The preference and GRPO recipes
run their own procedures (`fsdp_peft.preference`, `fsdp_peft.rl`), which start as this one does (`start_training`).
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from fsdp_peft._compat import check_upstream
from fsdp_peft.config import (
    SFT,
    RecipeArguments,
    build_training_arguments,
    resolve_recipe_config,
    resolved_config_yaml,
    with_procedure_defaults,
)
from fsdp_peft.data import check_packing_keeps_examples_apart, data_collator, load_data
from fsdp_peft.distributed import ranks, release_process_group
from fsdp_peft.ending import end_run
from fsdp_peft.errors import exits_cleanly_on_user_error
from fsdp_peft.eva import initialise_eva
from fsdp_peft.fsdp_settings import trainer_fsdp_arguments
from fsdp_peft.generation import ExactMatchBeforeTraining, SamplesAtEvaluation, evaluate_exact_match
from fsdp_peft.log import configure_for_training, logger
from fsdp_peft.modeling import build_model, load_tokenizer
from fsdp_peft.run_files import SAMPLES_FILE
from fsdp_peft.runs import die_with_the_launcher, release_output_dir, start_run
from fsdp_peft.trainer import PeftFsdpTrainer, check_resumable
from fsdp_peft.validation import check_before_training
from fsdp_peft.xla import start_xla_runtime


@exits_cleanly_on_user_error
def run_recipe(
    name: str, default_config: Path, argv: list[str] | None = None, procedure: Callable | None = None
) -> dict | None:
    """Run recipe ``name`` (SFT, or ``procedure``, e.g. `fsdp_peft.preference.run_preference`); returns the
    results dict on rank 0 (``None`` on other ranks)."""
    die_with_the_launcher()
    atexit.register(release_process_group)  # accelerate creates the group; it goes before the interpreter does
    check_upstream()
    try:
        return (procedure or _run_recipe)(name, default_config, argv)
    finally:
        release_output_dir()
        release_process_group()


def parse_recipe_config(
    argv: list[str],
    default_config: Path,
    default_output_dir: str,
    arguments_for: Callable[[RecipeArguments], tuple[type[TrainingArguments], dict]] | None = None,
    procedure: str = SFT,
) -> tuple[RecipeArguments, TrainingArguments]:
    """Resolve defaults, YAML and command-line overrides into the recipe and training arguments
    (``TrainingArguments``, or the class and extra fields ``arguments_for`` picks for the recipe: TRL's configs),
    checked by the rules that guard ``procedure``."""
    recipe_args, training_values, options = resolve_recipe_config(argv, default_config, default_output_dir)
    recipe_args = with_procedure_defaults(recipe_args, procedure)
    check_before_training(recipe_args, training_values, procedure=procedure)
    start_xla_runtime(trainer_fsdp_arguments(training_values).get("fsdp_config"))
    arguments_class, extra = arguments_for(recipe_args) if arguments_for else (TrainingArguments, {})
    training_args = build_training_arguments(training_values, options.config, arguments_class, **extra)
    if options.print_config:
        if ranks().is_main:
            print(resolved_config_yaml(recipe_args, training_values, options.config), end="")
        sys.exit(0)
    return recipe_args, training_args


def start_training(recipe: RecipeArguments, training: TrainingArguments):
    """Claim the output directory, find and check the checkpoint to resume, warn of remote code, load the
    tokenizer: the start every recipe shares, before its data. Returns ``(run, checkpoint, tokenizer)``."""
    run = start_run(dataclasses.asdict(recipe), training, training.resume_from_checkpoint)
    checkpoint = resume_point(training)
    if checkpoint is not None:
        check_resumable(Path(checkpoint), training, run.run_id)
        logger.info(f"resuming from {checkpoint}")
    if recipe.trust_remote_code:
        logger.warning(
            f"trust_remote_code: true: running Python code from the repository of "
            f"{recipe.model_name_or_path} on every rank; only do this for a model whose code you trust"
        )
    return run, checkpoint, load_tokenizer(recipe)


def _run_recipe(name: str, default_config: Path, argv: list[str] | None) -> dict | None:
    started = time.monotonic()
    recipe, training = parse_recipe_config(sys.argv[1:] if argv is None else argv, default_config, f"outputs/{name}")
    if training.include_num_input_tokens_seen == "no":
        training.include_num_input_tokens_seen = "non_padding"  # the summary reports the tokens trained on
    configure_for_training(training)
    run, checkpoint, tokenizer = start_training(recipe, training)
    train_data, eval_data, held_out = load_data(recipe, tokenizer, training)
    model = build_model(recipe, training, tokenizer)  # after the data: a bad row stops the run before weights load
    if recipe.packing:
        check_packing_keeps_examples_apart(model)  # packed examples must not attend to each other
    samples = held_out[: recipe.generate_samples]
    before = ExactMatchBeforeTraining(tokenizer, samples, recipe)
    trainer = PeftFsdpTrainer(
        model=model,
        args=training,
        train_dataset=train_data,
        eval_dataset=eval_data,
        data_collator=data_collator(recipe, tokenizer),
        processing_class=tokenizer,
        fsdp_reduce_dtype=getattr(torch, recipe.fsdp_reduce_dtype),
        loss_chunk_tokens=recipe.loss_chunk_tokens,
        callbacks=[before, SamplesAtEvaluation(tokenizer, held_out[: recipe.generate_eval_samples], recipe)],
        recipe_config=dataclasses.asdict(recipe),
        run=run,
    )
    if recipe.init_lora_weights == "eva":  # data-driven init: after the adapters exist, before FSDP wraps them
        initialise_eva(trainer, recipe, resumed=checkpoint is not None)

    train_output = trainer.train(resume_from_checkpoint=checkpoint)

    def measure(output_dir: Path) -> dict:
        after = None
        eval_loss = trainer.evaluate().get("eval_loss") if eval_data is not None else None
        if samples:
            path = output_dir / SAMPLES_FILE
            after = evaluate_exact_match(trainer.model, tokenizer, samples, recipe, trainer.args.device, path)
        return {
            "eval_loss": eval_loss,
            "exact_match_before": before.accuracy,
            "exact_match_after": after,
            "generated_samples": len(samples),
            "attention": model.config._attn_implementation,  # the kernel that ran (``auto``: the architecture's)
            "tokens": trainer.state.num_input_tokens_seen,
        }

    return end_run(trainer, recipe, name, SFT, started, train_output, measure)


def resume_point(training) -> str | None:
    """``resume_from_checkpoint``: a checkpoint path, or ``auto``/``true`` for the latest complete one.

    Checkpoints appear under their ``checkpoint-N`` name only once complete, so the latest such
    directory is always whole. With ``auto`` and no checkpoint yet, training starts from scratch.
    """
    value = training.resume_from_checkpoint
    if str(value).lower() not in ("auto", "true"):
        return value
    if not Path(training.output_dir).is_dir():
        return None
    return get_last_checkpoint(training.output_dir)
