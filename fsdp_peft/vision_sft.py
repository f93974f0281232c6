"""Supervised fine-tuning of vision-language models: the procedure of the VLM recipes (`fsdp_peft.procedure`).

Its data: chat rows with image parts, every row checked before any weights load (`fsdp_peft.data.vision_rows`),
rendered by the model's processor in each batch, the loss on the answers only. Its trainer: `PeftFsdpTrainer`. Its
score: exact match of greedy answers on held-out rows (their images included), before and after training, with
the eval loss. A batch without images on some ranks trains as one with images everywhere: `fsdp_peft.vision`.
"""

from __future__ import annotations

from pathlib import Path

from fsdp_peft.config import SFT
from fsdp_peft.data.vision_rows import (
    RowsDataset,
    VisionCollator,
    VisionRow,
    check_rows,
    open_image,
    processor_inputs,
    read_rows,
)
from fsdp_peft.errors import ConfigError
from fsdp_peft.generation import GenerationSettings, exact_match_of, generate_completions
from fsdp_peft.paths import local_model_config, resolve_model_path, tiny_colors_path
from fsdp_peft.procedure import Procedure, Setup
from fsdp_peft.run_file_names import SAMPLES_FILE
from fsdp_peft.sft import summary_lines
from fsdp_peft.tiny_vision import TINY_COLORS_NAME, load_processor
from fsdp_peft.trainer import PeftFsdpTrainer
from fsdp_peft.vision import is_vision_config

SUFFIXES = (".jsonl", ".json", ".parquet")


def _split_files(recipe) -> tuple[Path, Path | None]:
    """The train and eval files: ``train_file``/``eval_file``, else ``dataset``'s ``train.jsonl``/``eval.jsonl``."""
    if recipe.train_file:
        return Path(recipe.train_file).expanduser(), recipe.eval_file and Path(recipe.eval_file).expanduser()
    directory = tiny_colors_path() if recipe.dataset == TINY_COLORS_NAME else Path(recipe.dataset).expanduser()
    if directory.is_file():
        return directory, None
    train = next((f for f in _named(directory, ("train",))), None)
    if train is None:
        raise ConfigError(
            f"dataset: {recipe.dataset} has no train.jsonl (or .json, .parquet); vision-language recipes read local "
            "chat rows with images (docs/vision.md)"
        )
    return train, next(_named(directory, ("eval", "validation")), None)


def _named(directory: Path, names: tuple[str, ...]):
    return (directory / f"{n}{s}" for n in names for s in SUFFIXES if (directory / f"{n}{s}").is_file())


def load_data(recipe, tokenizer, training=None) -> tuple:
    """(train rows, eval rows or ``None``, held-out rows to answer, the processor); every row checked first."""
    if training is not None:
        training.device  # sets up the distributed state, as the text data does
    path = resolve_model_path(recipe.model_name_or_path)
    processor = load_processor(path)
    processor.tokenizer.pad_token = processor.tokenizer.pad_token or tokenizer.pad_token
    vision = is_vision_config(local_model_config(recipe.model_name_or_path, recipe.trust_remote_code))
    train_file, eval_file = _split_files(recipe)
    train = check_rows(read_rows(train_file), train_file, processor, recipe.max_seq_length, vision)
    held_out = (
        check_rows(read_rows(eval_file), eval_file, processor, recipe.max_seq_length, vision) if eval_file else []
    )
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
    name=SFT,
    load_data=load_data,
    trainer=_trainer,
    before=_before,
    after=_after,
    summary_lines=summary_lines,
    training_defaults={"include_num_input_tokens_seen": "non_padding", "remove_unused_columns": False},
)
