"""The skeleton every recipe runs, top to bottom, whatever its procedure (`fsdp_peft.procedures.procedure.Procedure`).

parse config → claim output_dir → tokenizer → the procedure's data (every row checked, before any weights load)
→ model and adapters → the procedure's trainer → its score before training (on the sharded model) → train →
`fsdp_peft.procedures.ending.end_run`: save adapter → the procedure's results after training → evaluate → export →
report (summary, ``results.json``, loss curve). A start that fails before the first optimizer step leaves
``output_dir`` as it found it (`fsdp_peft.tools.runs`).
The procedures are siblings this skeleton calls: SFT (`fsdp_peft.procedures.sft`, the default), vision-language SFT
(`fsdp_peft.procedures.vision_sft`, the VLM recipes), preference (`fsdp_peft.procedures.preference`: DPO, KTO), GRPO
(`fsdp_peft.procedures.rl`). The SFT recipes differ only in their default config (``configs/<recipe>/tiny.yaml``);
model families differ only in their entry in `fsdp_peft.settings.families`.
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
import time
from pathlib import Path

import torch
from transformers import TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from fsdp_peft.core._compat.gate import check_upstream
from fsdp_peft.core.distributed import ranks, release_process_group
from fsdp_peft.core.errors import exits_cleanly_on_user_error
from fsdp_peft.core.log import configure_for_training, logger
from fsdp_peft.core.xla import start_xla_runtime
from fsdp_peft.model.compiled import compile_layers
from fsdp_peft.model.kernels import kernel_training_values
from fsdp_peft.model.modeling import build_model, load_tokenizer
from fsdp_peft.procedures.ending import end_run
from fsdp_peft.procedures.procedure import Procedure, ScoredBeforeTraining, Setup
from fsdp_peft.procedures.registry import check_config
from fsdp_peft.procedures.sft import SFT_PROCEDURE
from fsdp_peft.procedures.trainer import check_resumable
from fsdp_peft.settings.checkpointing import CheckpointingChoice, apply_checkpointing
from fsdp_peft.settings.config import (
    RecipeArguments,
    build_training_arguments,
    resolve_recipe_config,
    resolved_config_yaml,
    unset_training_values,
)
from fsdp_peft.settings.fsdp_settings import trainer_fsdp_arguments
from fsdp_peft.tools.plan import launch_plan, rollouts_as_planned, run_checkpointing
from fsdp_peft.tools.runs import die_with_the_launcher, release_output_dir, start_run


@exits_cleanly_on_user_error
def run_recipe(
    name: str, default_config: Path, argv: list[str] | None = None, procedure: Procedure = SFT_PROCEDURE
) -> dict | None:
    """Run recipe ``name`` (its ``procedure``: SFT unless given); returns the results dict on rank 0 (``None`` on
    other ranks)."""
    die_with_the_launcher()
    atexit.register(release_process_group)  # accelerate creates the group; it goes before the interpreter does
    check_upstream()
    try:
        return _run(name, default_config, sys.argv[1:] if argv is None else argv, procedure)
    finally:
        release_output_dir()
        release_process_group()


def _run(name: str, default_config: Path, argv: list[str], procedure: Procedure) -> dict | None:
    started = time.monotonic()
    recipe, training, checkpointing, rollouts = parse_run_config(argv, default_config, f"outputs/{name}", procedure)
    configure_for_training(training)
    logger.info(checkpointing.line())
    if rollouts:
        logger.info(rollouts)
    run, checkpoint, tokenizer = start_training(recipe, training)
    setup = Setup(recipe, training, tokenizer, procedure.load_data(recipe, tokenizer, training), checkpoint=checkpoint)
    setup.model = build_model(recipe, training, tokenizer)  # after the data: a bad row stops the run before weights
    apply_checkpointing(setup.model, checkpointing)  # auto: the plan's layers (a config's own: the Trainer's)
    compiled = compile_layers(setup.model) if recipe.compile else 0  # each layer's training forward, one graph
    before = ScoredBeforeTraining(procedure, setup)
    shared = {
        "args": training,
        "processing_class": tokenizer,
        "fsdp_reduce_dtype": getattr(torch, recipe.fsdp_reduce_dtype),
        "callbacks": [before],
        "recipe_config": dataclasses.asdict(recipe),
        "run": run,
    }
    trainer = before.trainer = procedure.trainer(setup, shared)
    during = None
    if recipe.eval_tasks_steps:
        from fsdp_peft.tools.evaluation import (
            HarnessDuringTraining,  # lazy: the harness only for a run that names tasks
        )

        during = HarnessDuringTraining(trainer)
        trainer.add_callback(during)
    train_output = trainer.train(resume_from_checkpoint=checkpoint)
    measure = lambda output_dir: procedure.after(trainer, setup, before.result, output_dir)  # noqa: E731
    return end_run(trainer, recipe, name, procedure, started, train_output, measure, during, checkpointing, compiled)


def parse_recipe_config(
    argv: list[str], default_config: Path, default_output_dir: str, procedure: Procedure = SFT_PROCEDURE
) -> tuple[RecipeArguments, TrainingArguments]:
    """`parse_run_config` without the activation checkpointing choice."""
    recipe_args, training_args, _, _ = parse_run_config(argv, default_config, default_output_dir, procedure)
    return recipe_args, training_args


def parse_run_config(
    argv: list[str], default_config: Path, default_output_dir: str, procedure: Procedure = SFT_PROCEDURE
) -> tuple[RecipeArguments, TrainingArguments, CheckpointingChoice, str | None]:
    """Resolve defaults, YAML and command-line overrides into the recipe and training arguments (the class
    ``procedure.arguments`` picks: TRL's configs for its trainers), checked by the rules of ``procedure`` (the other
    procedures' keys refused);
    ``activation_checkpointing: auto`` becomes the plan's choice (`fsdp_peft.tools.plan.run_checkpointing`), as does
    whether a QLoRA run's rollouts dequantize its 4-bit layers under ``generate_compiled: auto`` on a GPU
    (`fsdp_peft.tools.plan.rollouts_as_planned`: the line saying so is last, None where there was nothing to choose)."""
    recipe_args, training_values, options = resolve_recipe_config(argv, default_config, default_output_dir)
    recipe_args = procedure.with_defaults(recipe_args)
    check_config(recipe_args, training_values, procedure)
    start_xla_runtime(trainer_fsdp_arguments(training_values).get("fsdp_config"))
    plan = launch_plan(recipe_args, training_values, procedure, options.config)
    checkpointing, chosen = run_checkpointing(recipe_args, training_values, options.config, plan)
    recipe_args, rollouts = rollouts_as_planned(recipe_args, plan)
    training_values = {**training_values, **chosen, **kernel_training_values(recipe_args)}
    arguments_class, extra = procedure.arguments(recipe_args)
    unset = unset_training_values()  # the procedure's defaults where the config sets none; not in training_values,
    defaults = {k: v for k, v in procedure.training_defaults.items() if training_values.get(k) == unset[k]}
    training_args = build_training_arguments(  # which --print-config prints and the parser must read back
        training_values, options.config, arguments_class, **defaults, **extra
    )
    if options.print_config:
        if ranks().is_main:
            print(resolved_config_yaml(recipe_args, training_values, options.config), end="")
        sys.exit(0)
    return recipe_args, training_args, checkpointing, rollouts


def start_training(recipe: RecipeArguments, training: TrainingArguments):
    """Claim the output directory, find and check the checkpoint to resume, warn of remote code, load the
    tokenizer: the start every procedure shares, before its data. Returns ``(run, checkpoint, tokenizer)``."""
    run = start_run(dataclasses.asdict(recipe), training, training.resume_from_checkpoint)
    checkpoint = resume_point(training)
    if checkpoint is not None:
        check_resumable(Path(checkpoint), training, run.run_id, recipe.sequence_parallel_size)
        logger.info(f"resuming from {checkpoint}")
    if recipe.trust_remote_code:
        logger.warning(
            f"trust_remote_code: true: running Python code from the repository of "
            f"{recipe.model_name_or_path} on every rank; only do this for a model whose code you trust"
        )
    return run, checkpoint, load_tokenizer(recipe)


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
