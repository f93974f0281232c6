"""Supervised fine-tuning: the procedure of every SFT recipe (`fsdp_peft.procedures.procedure.Procedure`).

Its data: prompt/completion rows, tokenized and checked (packed when asked). Its trainer: `PeftFsdpTrainer`, EVA
initialisation when asked. Its score: exact match of greedy completions on held-out prompts, before and after
training, with the eval loss; the tokens trained on.
"""

from __future__ import annotations

from pathlib import Path

from fsdp_peft.core.run_file_names import SAMPLES_FILE
from fsdp_peft.data.cache import load_data
from fsdp_peft.data.packing import check_packing_keeps_examples_apart, data_collator
from fsdp_peft.procedures.eva import initialise_eva
from fsdp_peft.procedures.procedure import Procedure, Setup
from fsdp_peft.procedures.trainer import PeftFsdpTrainer
from fsdp_peft.settings.config import SFT
from fsdp_peft.tools.generation import SamplesAtEvaluation, evaluate_exact_match


def _trainer(setup: Setup, shared: dict) -> PeftFsdpTrainer:
    recipe, tokenizer = setup.recipe, setup.tokenizer
    train_data, eval_data, held_out = setup.data
    if recipe.packing:
        check_packing_keeps_examples_apart(setup.model)  # packed examples must not attend to each other
    at_evaluation = SamplesAtEvaluation(tokenizer, held_out[: recipe.generate_eval_samples], recipe)
    trainer = PeftFsdpTrainer(
        model=setup.model,
        train_dataset=train_data,
        eval_dataset=eval_data,
        data_collator=data_collator(recipe, tokenizer),
        loss_chunk_tokens=recipe.loss_chunk_tokens,
        sequence_parallel_size=recipe.sequence_parallel_size,
        **{**shared, "callbacks": [*shared["callbacks"], at_evaluation]},
    )
    if recipe.init_lora_weights == "eva":  # data-driven init: after the adapters exist, before FSDP wraps them
        initialise_eva(trainer, recipe, resumed=setup.checkpoint is not None)
    return trainer


def _samples(setup: Setup) -> list:
    return setup.data[2][: setup.recipe.generate_samples]


def _before(trainer, setup: Setup, model) -> float | None:
    samples = _samples(setup)
    return evaluate_exact_match(model, setup.tokenizer, samples, setup.recipe, trainer.args.device) if samples else None


def _after(trainer, setup: Setup, before: float | None, output_dir: Path) -> dict:
    samples, recipe = _samples(setup), setup.recipe
    eval_loss = trainer.evaluate().get("eval_loss") if setup.data[1] is not None else None
    after = None
    if samples:
        path = output_dir / SAMPLES_FILE
        after = evaluate_exact_match(trainer.model, setup.tokenizer, samples, recipe, trainer.args.device, path)
    return {
        "eval_loss": eval_loss,
        "exact_match_before": before,
        "exact_match_after": after,
        "generated_samples": len(samples),
        "attention": setup.model.config._attn_implementation,  # the kernel that ran (``auto``: the architecture's)
        "tokens": trainer.state.num_input_tokens_seen,
    }


def summary_lines(results: dict, output_dir: Path) -> list[str]:
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


SFT_PROCEDURE = Procedure(
    name=SFT,
    load_data=load_data,
    trainer=_trainer,
    before=_before,
    after=_after,
    summary_lines=summary_lines,
    training_defaults={"include_num_input_tokens_seen": "non_padding"},  # the summary reports the tokens trained on
)
