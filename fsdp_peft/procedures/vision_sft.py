"""Supervised fine-tuning of vision-language models: the procedure of the VLM recipes
(`fsdp_peft.procedures.procedure`).

Its data: chat rows with image parts, every row checked before any weights load (`fsdp_peft.data.vision_rows`),
rendered by the model's processor in each batch, the loss on the answers only. Its trainer: `PeftFsdpTrainer`. Its
score: exact match of greedy answers on held-out rows (their images included), before and after training, with
the eval loss. A batch without images on some ranks trains as one with images everywhere: `fsdp_peft.model.vision`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import logger
from fsdp_peft.core.run_file_names import SAMPLES_FILE
from fsdp_peft.data.cache import downloaded_hub_splits
from fsdp_peft.data.sources import Source, data_sources, read_source
from fsdp_peft.data.vision_rows import (
    RowsDataset,
    VisionCollator,
    VisionRow,
    check_rows,
    open_image,
    processor_inputs,
    rows_of,
)
from fsdp_peft.model.paths import local_model_config, resolve_model_path, tiny_colors_path
from fsdp_peft.model.tiny_vision import load_processor
from fsdp_peft.model.vision import is_vision_config
from fsdp_peft.procedures.procedure import Procedure, Setup, exact_match_lines
from fsdp_peft.procedures.trainer import PeftFsdpTrainer
from fsdp_peft.settings.choices import TINY_COLORS_NAME
from fsdp_peft.tools.generation import GenerationSettings, exact_match_of, generate_completions


def _rows(source: Source | None, processor, recipe, vision: bool, hub_splits: dict | None = None) -> list[VisionRow]:
    """Every row of ``source`` (data files, or a hub split: from ``hub_splits`` when loaded already), checked
    (`check_rows`; with ``skip_invalid_rows`` bad rows are left out and counted); none without a source."""
    if source is None:
        return []
    rows, dropped = [], [] if recipe.skip_invalid_rows else None
    for where, table in read_source(source, hub_splits):
        checked_from = Path(where) if source.files else where
        rows += check_rows(rows_of(table, where), checked_from, processor, recipe.max_seq_length, vision, dropped)
    if dropped:
        logger.warning(f"{source}: skipped {len(dropped)} rows (skip_invalid_rows: true); the first: {dropped[0]}")
    if not rows:
        raise ConfigError(f"{source}: no rows left to train on ({len(dropped or [])} skipped as invalid)")
    return rows


def load_data(recipe, tokenizer, training=None) -> tuple:
    """(train rows, eval rows or ``None``, held-out rows to answer, the processor); every row checked first."""
    if training is not None:
        training.device  # sets up the distributed state, as the text data does
    path = resolve_model_path(recipe.model_name_or_path)
    processor = load_processor(path)
    processor.tokenizer.pad_token = processor.tokenizer.pad_token or tokenizer.pad_token
    vision = is_vision_config(local_model_config(recipe.model_name_or_path, recipe.trust_remote_code))
    if recipe.dataset == TINY_COLORS_NAME:
        recipe = replace(recipe, dataset=str(tiny_colors_path()))
    train_source, eval_source = data_sources(recipe)
    hub_splits = downloaded_hub_splits([train_source, eval_source])
    train = _rows(train_source, processor, recipe, vision, hub_splits)
    held_out = _rows(eval_source, processor, recipe, vision, hub_splits)
    return RowsDataset(train), RowsDataset(held_out) if held_out else None, held_out, processor


def _trainer(setup: Setup, shared: dict) -> PeftFsdpTrainer:
    train, evaluation, _, processor = setup.data
    return PeftFsdpTrainer(
        model=setup.model,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=VisionCollator(processor),
        loss_chunk_tokens=setup.recipe.loss_chunk_tokens,
        **shared,
    )


def _answers(model, setup: Setup, device) -> list[str] | None:
    rows: list[VisionRow] = setup.data[2][: setup.recipe.generate_samples]
    processor = setup.data[3]

    def encode(batch: list[VisionRow]) -> dict:
        images = [[open_image(reference) for reference in row.images] for row in batch]
        return processor_inputs(processor, [row.prompt for row in batch], images)

    settings = GenerationSettings.from_recipe(setup.recipe)
    return generate_completions(model, processor.tokenizer, rows, settings, device, encode=encode)


def exact_match(model, setup: Setup, device, samples_path: Path | None = None) -> float | None:
    """Exact-match accuracy of greedy answers on the held-out rows (rank 0; ``None`` elsewhere or without rows)."""
    rows = setup.data[2][: setup.recipe.generate_samples]
    if not rows:
        return None
    answers = _answers(model, setup, device)
    if answers is None:
        return None
    records = [{"row": row.where, "expected": row.answer, "generated": a} for row, a in zip(rows, answers)]
    return exact_match_of(records, samples_path)


def _before(trainer, setup: Setup, model) -> float | None:
    return exact_match(model, setup, trainer.args.device)


def _after(trainer, setup: Setup, before: float | None, output_dir: Path) -> dict:
    eval_loss = trainer.evaluate().get("eval_loss") if setup.data[1] is not None else None
    samples = setup.data[2][: setup.recipe.generate_samples]
    after = exact_match(trainer.model, setup, trainer.args.device, output_dir / SAMPLES_FILE) if samples else None
    return {
        "eval_loss": eval_loss,
        "exact_match_before": before,
        "exact_match_after": after,
        "generated_samples": len(samples),
        "attention": setup.model.config._attn_implementation,
        "tokens": trainer.state.num_input_tokens_seen,
    }


VISION_SFT_PROCEDURE = Procedure(
    name="vision_sft",
    about="vision-language SFT",
    load_data=load_data,
    trainer=_trainer,
    before=_before,
    after=_after,
    summary_lines=exact_match_lines,
    training_defaults={"include_num_input_tokens_seen": "non_padding", "remove_unused_columns": False},
)
