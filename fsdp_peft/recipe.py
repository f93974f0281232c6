"""The fine-tuning procedure every recipe runs, top to bottom.

parse config → claim output_dir → tokenizer → data (every row checked, before any weights load) → model
and adapters → trainer → accuracy before → train → save adapter → evaluate → generate from the sharded
model → report (summary, ``results.json``, loss curve). A start that fails before the first optimizer step
leaves ``output_dir`` as it found it (`fsdp_peft.runs`).
Recipes differ only in their default config (``configs/<recipe>/tiny.yaml``), so they share this one
function; model families differ only in their entry in `fsdp_peft.families`.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

from fsdp_peft._compat import check_upstream
from fsdp_peft.config import RecipeArguments, build_training_arguments, resolve_recipe_config, resolved_config_yaml
from fsdp_peft.data import check_packing_keeps_examples_apart, data_collator, load_data
from fsdp_peft.errors import exits_cleanly_on_user_error
from fsdp_peft.eva import initialise_eva
from fsdp_peft.export import export_merged
from fsdp_peft.generation import ExactMatchBeforeTraining, SamplesAtEvaluation, evaluate_exact_match
from fsdp_peft.launch import ranks, release_process_group, trainer_fsdp_arguments
from fsdp_peft.log import configure_for_training, logger
from fsdp_peft.modeling import attach_lora, load_base_model, load_tokenizer
from fsdp_peft.new_tokens import grow_vocabulary
from fsdp_peft.paths import resolve_model_path
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
) -> tuple[RecipeArguments, TrainingArguments]:
    """Resolve defaults, YAML and command-line overrides into the recipe and training arguments
    (``TrainingArguments``, or the class and extra fields ``arguments_for`` picks for the recipe: TRL's configs)."""
    recipe_args, training_values, options = resolve_recipe_config(argv, default_config, default_output_dir)
    check_before_training(recipe_args, training_values)
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


def model_with_adapters(recipe: RecipeArguments, training: TrainingArguments, tokenizer):
    """The base model, grown to the tokenizer's new tokens, with its adapters: loaded after the data, so that a
    bad row stops the run before any weights load."""
    set_seed(training.seed)  # before the adapters exist: every rank must draw the same LoRA init
    return attach_lora(grow_vocabulary(load_base_model(recipe, training), tokenizer, recipe), recipe, training)


def _run_recipe(name: str, default_config: Path, argv: list[str] | None) -> dict | None:
    started = time.monotonic()
    recipe, training = parse_recipe_config(sys.argv[1:] if argv is None else argv, default_config, f"outputs/{name}")
    if training.include_num_input_tokens_seen == "no":
        training.include_num_input_tokens_seen = "non_padding"  # the summary reports the tokens trained on
    configure_for_training(training)
    run, checkpoint, tokenizer = start_training(recipe, training)
    train_data, eval_data, held_out = load_data(recipe, tokenizer, training)
    model = model_with_adapters(recipe, training, tokenizer)
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
    output_dir = Path(training.output_dir)
    adapter_dir = trainer.save_adapter(output_dir / "adapter")
    trainer.save_state()
    eval_metrics = trainer.evaluate() if eval_data is not None else {}

    samples_path = output_dir / "samples.jsonl"
    accuracy_after = (
        evaluate_exact_match(trainer.model, tokenizer, samples, recipe, trainer.args.device, samples_path)
        if samples
        else None
    )
    merged_dir = output_dir / "merged"
    if recipe.export_merged and trainer.is_world_process_zero():
        export_merged(
            adapter_dir,
            merged_dir,
            base=resolve_model_path(recipe.model_name_or_path),
            dtype=recipe.export_dtype,
            overwrite=True,
            progress=False,
        )
    trainer.accelerator.wait_for_everyone()
    if not trainer.is_world_process_zero():
        return None
    results = {
        "recipe": name,
        "train_loss": train_output.training_loss,
        "eval_loss": eval_metrics.get("eval_loss"),
        "exact_match_before": before.accuracy,
        "exact_match_after": accuracy_after,
        "generated_samples": len(samples),
        "adapter_dir": str(adapter_dir),
        "fsdp": trainer.is_fsdp_enabled,
        "attention": model.config._attn_implementation,  # the kernel that ran (``auto``: the architecture's)
        "merged_dir": str(merged_dir) if recipe.export_merged else None,
        "steps": trainer.state.global_step,
        "tokens": trainer.state.num_input_tokens_seen,
        "train_seconds": train_output.metrics["train_runtime"],
        "total_seconds": time.monotonic() - started,
        "last_train_loss": last_logged(trainer.state.log_history, "loss"),
        "loss_curve": plot_loss_curve(trainer.state.log_history, output_dir / LOSS_CURVE_FILE),
    }
    (output_dir / "results.json").write_text(json.dumps(results, indent=1))
    for line in summary(results, output_dir).splitlines():
        logger.info(line.removeprefix("[fsdp-peft] "))
    return results


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


LOSS_CURVE_FILE = "loss_curve.png"


def last_logged(log_history: list[dict], key: str) -> float | None:
    """The last value of ``key`` the Trainer logged."""
    return next((entry[key] for entry in reversed(log_history) if key in entry), None)


def plot_loss_curve(log_history: list[dict], path: Path) -> str | None:
    """Draw train and eval loss against the step into ``path``; ``None`` when no loss was logged."""
    train = [(entry["step"], entry["loss"]) for entry in log_history if "loss" in entry]
    evaluation = [(entry["step"], entry["eval_loss"]) for entry in log_history if "eval_loss" in entry]
    if not (train or evaluation):
        return None
    import matplotlib  # lazy: only the end of a run draws; keeps every import of the recipe module light

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # lazy: after matplotlib.use("Agg")

    figure, axes = plt.subplots(figsize=(7, 4))
    for points, label, style in ((train, "train", "-"), (evaluation, "eval", "o--")):
        if points:
            axes.plot(*zip(*points), style, label=label)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return str(path)


def summary(results: dict, output_dir: Path) -> str:
    """The lines a user reads at the end of a run."""
    tokens = "n/a" if not results["tokens"] else f"{results['tokens']:,}"
    last = "" if results["last_train_loss"] is None else f", last logged {results['last_train_loss']:.4f}"
    lines = [
        f"[fsdp-peft] {results['recipe']}: {results['steps']} steps, {tokens} tokens, "
        f"{results['train_seconds']:.1f} s training ({results['total_seconds']:.1f} s in all)",
        f"[fsdp-peft] train loss {results['train_loss']:.4f} (mean over the run){last}",
    ]
    if results["eval_loss"] is not None:
        lines.append(f"[fsdp-peft] eval loss {results['eval_loss']:.4f}")
    if results["exact_match_after"] is not None:
        before = results["exact_match_before"]
        before_text = "n/a (resumed)" if before is None else f"{before:.3f}"
        lines.append(
            f"[fsdp-peft] exact match on {results['generated_samples']} held-out prompts: "
            f"before training {before_text}, after {results['exact_match_after']:.3f}"
        )
        lines.append(f"[fsdp-peft] samples: {output_dir / 'samples.jsonl'}")
    lines.append(f"[fsdp-peft] adapter: {results['adapter_dir']}")
    if results["merged_dir"]:
        lines.append(f"[fsdp-peft] merged full weights: {results['merged_dir']}")
    if results["loss_curve"]:
        lines.append(f"[fsdp-peft] loss curve: {results['loss_curve']}")
    else:
        lines.append("[fsdp-peft] loss curve: not drawn (no loss was logged: lower logging_steps)")
    lines.append(f"[fsdp-peft] results: {output_dir / 'results.json'}")
    return "\n".join(lines)
