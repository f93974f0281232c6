"""How every procedure ends (SFT, preference: DPO and KTO, GRPO): one function, the same steps in the same order.

save the adapter (collective) → trainer state → the procedure's held-out measurements (collective: FSDP
forwards run on every rank) → the recipe's ``eval_tasks`` (collective: the harness on every rank's shard) →
merged export (rank 0) → barrier → rank 0 writes ``results.json``, draws the loss curve and prints the summary.
A procedure supplies only its measurements and its own summary lines (`fsdp_peft.procedures.procedure.Procedure`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from fsdp_peft.core.log import counted, logger
from fsdp_peft.core.run_file_names import HARNESS_DIR, HARNESS_LOG_PREFIX, LOSS_CURVE_FILE, RESULTS_FILE
from fsdp_peft.model.compiled import compile_report
from fsdp_peft.model.paths import resolve_model_path
from fsdp_peft.settings.checkpointing import CheckpointingChoice, choice_line
from fsdp_peft.tools.export import export_merged

PREFIX = "[fsdp-peft] "


def end_run(
    trainer,
    recipe,
    name: str,
    procedure,
    started: float,
    train_output,
    measure: Callable[[Path], dict],
    harness_during=None,
    checkpointing: CheckpointingChoice | None = None,
    compiled_layers: int = 0,
) -> dict | None:
    """Finish a trained run (every rank calls it); returns the results dict on rank 0 (``None`` elsewhere).

    ``measure(output_dir)`` runs on every rank after the adapter is saved and returns the procedure's results
    (rank 0's go into ``results.json``); ``procedure`` (`fsdp_peft.procedures.procedure.Procedure`) names them and
    prints its own summary lines of them. ``harness_during``: the run's
    `fsdp_peft.tools.evaluation.HarnessDuringTraining`, when ``eval_tasks_steps`` made one. ``checkpointing``: what the
    run checkpointed and why (`fsdp_peft.recipe`); ``compiled_layers``: the layers ``compile: true`` compiled
    (`fsdp_peft.model.compiled`)."""
    output_dir = Path(trainer.args.output_dir)
    adapter_dir = trainer.save_adapter(output_dir / "adapter")
    trainer.save_state()
    measured = measure(output_dir)
    harness = harness_at_the_end(trainer, harness_during, adapter_dir, output_dir) if recipe.eval_tasks else None
    merged_dir = output_dir / "merged"
    if recipe.export_merged and trainer.is_world_process_zero():
        base = resolve_model_path(recipe.model_name_or_path)
        export_merged(adapter_dir, merged_dir, base=base, dtype=recipe.export_dtype, overwrite=True, progress=False)
    trainer.accelerator.wait_for_everyone()
    if not trainer.is_world_process_zero():
        return None
    log_history = trainer.state.log_history
    results = {
        "recipe": name,
        "procedure": procedure.name,
        "train_loss": train_output.training_loss,
        **measured,
        "adapter_dir": str(adapter_dir),
        "fsdp": trainer.is_fsdp_enabled,
        "activation_checkpointing": checkpointing.to_json() if checkpointing else None,
        "compiled": compile_report(compiled_layers) if compiled_layers else None,
        "merged_dir": str(merged_dir) if recipe.export_merged else None,
        "steps": trainer.state.global_step,
        "train_seconds": train_output.metrics["train_runtime"],
        "total_seconds": time.monotonic() - started,
        "last_train_loss": last_logged(log_history, "loss"),
        "loss_curve": plot_loss_curve(log_history, output_dir / LOSS_CURVE_FILE),
        "eval_tasks": harness["tasks"] if harness else None,
        "eval_tasks_results": harness["results_file"] if harness else None,
        "eval_tasks_during": harness_history(log_history),
    }
    (output_dir / RESULTS_FILE).write_text(json.dumps(results, indent=1))
    for line in summary(results, output_dir, procedure.summary_lines).splitlines():
        logger.info(line.removeprefix(PREFIX))
    return results


def summary(results: dict, output_dir: Path, procedure_lines: Callable[[dict, Path], list[str]]) -> str:
    """The lines a user reads at the end of a run: steps and time, loss, the procedure's own lines
    (``procedure_lines(results, output_dir)``: `fsdp_peft.procedures.procedure.Procedure.summary_lines`), then where the
    files are."""
    tokens = ""  # SFT counts the tokens trained on; the preference trainers do not
    if "tokens" in results:
        tokens = f"{results['tokens']:,} tokens, " if results["tokens"] else "n/a tokens, "
    last = "" if results["last_train_loss"] is None else f", last logged {results['last_train_loss']:.4f}"
    lines = [
        f"{results['recipe']}: {counted(results['steps'], 'step')}, {tokens}{results['train_seconds']:.1f} s training "
        f"({results['total_seconds']:.1f} s in all)",
        f"{results.get('loss_name', 'train')} loss {results['train_loss']:.4f} (mean over the run){last}",
    ]
    lines += procedure_lines(results, output_dir)
    if results.get("activation_checkpointing"):
        lines.append(choice_line(results["activation_checkpointing"]))
    if results.get("compiled"):
        c = results["compiled"]
        lines.append(f"compiled: {c['layers']} layers, {c['graphs']} graphs, {c['compile_seconds']:.1f} s compiling")
    lines += harness_lines(results)
    lines.append(f"adapter: {results['adapter_dir']}")
    if results["merged_dir"]:
        lines.append(f"merged full weights: {results['merged_dir']}")
    lines.append(f"loss curve: {results['loss_curve'] or 'not drawn (no loss was logged: lower logging_steps)'}")
    lines.append(f"results: {output_dir / RESULTS_FILE}")
    return "\n".join(PREFIX + line for line in lines)


def harness_at_the_end(trainer, during, adapter_dir: Path, output_dir: Path) -> dict | None:
    """The run's ``eval_tasks`` on the trained model (collective: every rank scores its share on its shard), or the
    evaluation ``eval_tasks_steps`` made of these same weights at the last step; rank 0's ``eval.json`` content."""
    if during is not None and during.latest is not None and during.latest[0] == trainer.state.global_step:
        logger.info(f"harness tasks on the trained model: as evaluated at step {during.latest[0]} (the same weights)")
        return during.latest[1]
    from fsdp_peft.tools.evaluation import evaluate_trained_model  # lazy: the harness only for a run that names tasks

    return evaluate_trained_model(
        trainer.model,
        trainer.processing_class,
        trainer.recipe_config,
        output_dir / HARNESS_DIR,
        str(adapter_dir),
        trainer.args.device,
    )


def harness_history(log_history: list[dict]) -> list[dict]:
    """The figures ``eval_tasks_steps`` logged during training, by step: ``[{"step": N, "<task>": {metric:
    value}}, ...]`` (a resumed run's earlier ones included: they are in the trainer state it resumed)."""
    history = []
    for entry in log_history:
        figures: dict[str, dict] = {}
        for key, value in entry.items():
            if key.startswith(HARNESS_LOG_PREFIX):
                task, metric = key.removeprefix(HARNESS_LOG_PREFIX).split("/", 1)
                figures.setdefault(task, {})[metric] = value
        if figures:
            history.append({"step": entry["step"], **figures})
    return history


def harness_lines(results: dict) -> list[str]:
    """The lines of the harness tasks a run named in ``eval_tasks``: each task's figures, then the files."""
    if not results.get("eval_tasks"):
        return []
    lines = []
    for entry in results.get("eval_tasks_during") or []:
        shown = "; ".join(f"{task} {_figures(figures)}" for task, figures in entry.items() if task != "step")
        lines.append(f"harness at step {entry['step']}: {shown}")
    for name, figures in results["eval_tasks"].items():
        lines.append(f"harness {name} on {counted(figures['samples'], 'document')}: {_figures(figures)}")
    lines.append(f"harness results: {results['eval_tasks_results']}")
    return lines


def _figures(figures: dict) -> str:
    return ", ".join(f"{metric} {value:.4g}" for metric, value in figures.items() if metric != "samples")


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
