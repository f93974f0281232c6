"""The fine-tuning procedure every recipe runs, top to bottom.

parse config → tokenizer and model → adapters → data → trainer → accuracy before → train → save
adapter → evaluate → generate from the sharded model → report. Recipes differ only in their default
config (``configs/<recipe>/tiny.yaml``), so they share this one function.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
from transformers import DataCollatorForSeq2Seq, set_seed

from fsdp_peft.config import parse_recipe_config
from fsdp_peft.data import IGNORE_INDEX, load_data
from fsdp_peft.errors import exits_cleanly_on_user_error
from fsdp_peft.generation import ExactMatchBeforeTraining, SamplesAtEvaluation, evaluate_exact_match
from fsdp_peft.export import export_merged
from fsdp_peft.modeling import attach_lora, load_base_model, load_tokenizer, resolve_model_path
from fsdp_peft.trainer import PeftFsdpTrainer, check_resumable


@exits_cleanly_on_user_error
def run_recipe(name: str, default_config: Path, argv: list[str] | None = None) -> dict | None:
    """Run recipe ``name``; returns the results dict on rank 0 (``None`` on other ranks)."""
    recipe, training = parse_recipe_config(sys.argv[1:] if argv is None else argv, default_config, f"outputs/{name}")
    checkpoint = resume_point(training)
    if checkpoint is not None:
        check_resumable(Path(checkpoint), training)
        if training.process_index == 0:
            print(f"[fsdp-peft] resuming from {checkpoint}", flush=True)
    set_seed(training.seed)  # before the adapters exist: every rank must draw the same LoRA init
    tokenizer = load_tokenizer(recipe)
    model = attach_lora(load_base_model(recipe), recipe, training)
    train_data, eval_data, held_out = load_data(recipe, tokenizer)
    samples = held_out[: recipe.generate_samples]
    before = ExactMatchBeforeTraining(tokenizer, samples, recipe)
    trainer = PeftFsdpTrainer(
        model=model,
        args=training,
        train_dataset=train_data,
        eval_dataset=eval_data,
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX, padding=True),
        processing_class=tokenizer,
        fsdp_reduce_dtype=getattr(torch, recipe.fsdp_reduce_dtype),
        callbacks=[before, SamplesAtEvaluation(tokenizer, held_out[: recipe.generate_eval_samples], recipe)],
        recipe_config=dataclasses.asdict(recipe),
    )

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
        export_merged(adapter_dir, merged_dir, base=resolve_model_path(recipe.model_name_or_path),
                      dtype=recipe.export_dtype, overwrite=True, progress=False)  # fmt: skip
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
        "merged_dir": str(merged_dir) if recipe.export_merged else None,
    }
    (output_dir / "results.json").write_text(json.dumps(results, indent=1))
    print(summary(results, output_dir))
    return results


def resume_point(training) -> str | None:
    """``resume_from_checkpoint``: a checkpoint path, or ``auto``/``true`` for the latest complete one.

    Checkpoints appear under their ``checkpoint-N`` name only once complete, so the latest such
    directory is always whole. With ``auto`` and no checkpoint yet, training starts from scratch.
    """
    from transformers.trainer_utils import get_last_checkpoint

    value = training.resume_from_checkpoint
    if str(value).lower() not in ("auto", "true"):
        return value
    if not Path(training.output_dir).is_dir():
        return None
    return get_last_checkpoint(training.output_dir)


def summary(results: dict, output_dir: Path) -> str:
    """The lines a user reads at the end of a run."""
    lines = [f"[fsdp-peft] {results['recipe']}: train loss {results['train_loss']:.4f}"]
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
    return "\n".join(lines)
