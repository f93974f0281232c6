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
from fsdp_peft.procedures.procedure import Procedure, Setup, exact_match_lines
from fsdp_peft.procedures.trainer import PeftFsdpTrainer
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


SFT_PROCEDURE = Procedure(
    name="sft",
    about="SFT",
    load_data=load_data,
    trainer=_trainer,
    before=_before,
    after=_after,
    summary_lines=exact_match_lines,
    training_defaults={"include_num_input_tokens_seen": "non_padding"},  # the summary reports the tokens trained on
)
