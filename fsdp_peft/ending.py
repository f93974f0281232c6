"""How every procedure ends (SFT, preference: DPO and KTO, GRPO): one function, the same steps in the same order.

save the adapter (collective) → trainer state → the procedure's held-out measurements (collective: FSDP
forwards run on every rank) → the recipe's ``eval_tasks`` (collective: the harness on every rank's shard) →
merged export (rank 0) → barrier → rank 0 writes ``results.json``, draws the loss curve and prints the summary.
A procedure supplies only its measurements; its summary lines are rendered here (`SUMMARY_DETAILS`), so one
`summary` prints any run's ``results.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from fsdp_peft.config import PREFERENCE, RL, SFT
from fsdp_peft.export import export_merged
from fsdp_peft.log import logger
from fsdp_peft.paths import resolve_model_path
from fsdp_peft.run_files import HARNESS_DIR, HARNESS_LOG_PREFIX, LOSS_CURVE_FILE, RESULTS_FILE, SAMPLES_FILE

PREFIX = "[fsdp-peft] "


def end_run(
    trainer,
    recipe,
    name: str,
    procedure: str,
    started: float,
    train_output,
    measure: Callable[[Path], dict],
) -> dict | None:
    """Finish a trained run (every rank calls it); returns the results dict on rank 0 (``None`` elsewhere).

    ``measure(output_dir)`` runs on every rank after the adapter is saved and returns the procedure's results
    (rank 0's go into ``results.json``); ``procedure`` (a key of `SUMMARY_DETAILS`) names the lines that print them.
    """
    output_dir = Path(trainer.args.output_dir)
    adapter_dir = trainer.save_adapter(output_dir / "adapter")
    trainer.save_state()
    measured = measure(output_dir)
    harness = harness_at_the_end(trainer, adapter_dir, output_dir) if recipe.eval_tasks else None
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
        "procedure": procedure,
        "train_loss": train_output.training_loss,
        **measured,
        "adapter_dir": str(adapter_dir),
        "fsdp": trainer.is_fsdp_enabled,
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
    for line in summary(results, output_dir).splitlines():
        logger.info(line.removeprefix(PREFIX))
    return results


def summary(results: dict, output_dir: Path) -> str:
    """The lines a user reads at the end of a run: steps and time, loss, the procedure's own lines
    (``results["procedure"]``, SFT when absent), then where the files are."""
    tokens = ""  # SFT counts the tokens trained on; the preference trainers do not
    if "tokens" in results:
        tokens = f"{results['tokens']:,} tokens, " if results["tokens"] else "n/a tokens, "
    last = "" if results["last_train_loss"] is None else f", last logged {results['last_train_loss']:.4f}"
    lines = [
        f"{results['recipe']}: {results['steps']} steps, {tokens}{results['train_seconds']:.1f} s training "
        f"({results['total_seconds']:.1f} s in all)",
        f"{results.get('loss_name', 'train')} loss {results['train_loss']:.4f} (mean over the run){last}",
    ]
    details = SUMMARY_DETAILS.get(results.get("procedure", SFT))
    lines += details(results, output_dir) if details else []
    lines += harness_lines(results)
    lines.append(f"adapter: {results['adapter_dir']}")
    if results["merged_dir"]:
        lines.append(f"merged full weights: {results['merged_dir']}")
    lines.append(f"loss curve: {results['loss_curve'] or 'not drawn (no loss was logged: lower logging_steps)'}")
    lines.append(f"results: {output_dir / RESULTS_FILE}")
    return "\n".join(PREFIX + line for line in lines)


def harness_at_the_end(trainer, adapter_dir: Path, output_dir: Path) -> dict | None:
    """The run's ``eval_tasks`` on the trained model (collective: every rank scores its share on its shard), or the
    evaluation ``eval_tasks_steps`` made of these same weights at the last step; rank 0's ``eval.json`` content."""
    during = trainer.harness_during_training
    if during is not None and during.latest is not None and during.latest[0] == trainer.state.global_step:
        logger.info(f"harness tasks on the trained model: as evaluated at step {during.latest[0]} (the same weights)")
        return during.latest[1]
    from fsdp_peft.evaluation import evaluate_trained_model  # lazy: the harness only for a run that names tasks

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
        lines.append(f"harness {name} on {figures['samples']} documents: {_figures(figures)}")
    lines.append(f"harness results: {results['eval_tasks_results']}")
    return lines


def _figures(figures: dict) -> str:
    return ", ".join(f"{metric} {value:.4g}" for metric, value in figures.items() if metric != "samples")


def sft_details(results: dict, output_dir: Path) -> list[str]:
    """An SFT run's own summary lines: eval loss, exact match before and after training, the samples' file."""
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


def preference_details(results: dict, output_dir: Path) -> list[str]:
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


def rl_details(results: dict, output_dir: Path) -> list[str]:
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


def _closer_to(generation: dict) -> str:
    return (
        f"{generation['chosen']:.3f} / {generation['rejected']:.3f} (exactly chosen {generation['exact_chosen']:.3f})"
    )


# ``results["procedure"]`` → the lines its summary prints between the loss line and the files
SUMMARY_DETAILS: dict[str, Callable[[dict, Path], list[str]]] = {
    SFT: sft_details,
    PREFERENCE: preference_details,
    RL: rl_details,
}


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
