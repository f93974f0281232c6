"""Packing: examples concatenated into rows of ``max_seq_length`` tokens, kept apart by their positions.

`pack` builds the rows, `data_collator` pads them (or unpacked rows), or for the variable-length kernels
concatenates a micro-batch's rows into one with no padding at all, and
`check_packing_keeps_examples_apart` runs the model once to refuse an attention that would let a
packed example see the one before it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from datasets import Dataset
from transformers import DataCollatorForSeq2Seq

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.xla import on_xla
from fsdp_peft.data.tokenize import IGNORE_INDEX
from fsdp_peft.model.attention import chosen_attention, model_class_named
from fsdp_peft.settings.config import RecipeArguments
from fsdp_peft.settings.fsdp_settings import RuleContext


def pack(rows: Dataset, max_seq_length: int, seed: int) -> Dataset:
    """Examples concatenated into rows of at most ``max_seq_length`` tokens, in a seeded random order.

    Each packed row carries ``position_ids`` that restart at 0 for every example: transformers' attention
    masks (eager, sdpa, flex) then keep every token inside its own example, and flash attention runs one
    variable-length sequence per example. The first label of each example is -100, so no example is
    trained to follow the one before it. Next-fit: an example that does not fit starts a new row.
    """
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    packed: list[dict] = []
    current = {"input_ids": [], "labels": [], "position_ids": []}
    for index in order:
        row = rows[index]
        if current["input_ids"] and len(current["input_ids"]) + len(row["input_ids"]) > max_seq_length:
            packed.append(current)
            current = {"input_ids": [], "labels": [], "position_ids": []}
        current["input_ids"] += row["input_ids"]
        current["labels"] += [IGNORE_INDEX] + row["labels"][1:]
        current["position_ids"] += list(range(len(row["input_ids"])))
    if current["input_ids"]:
        packed.append(current)
    return Dataset.from_list(packed)


@dataclass
class PackedCollator:
    """Pads packed rows: ``position_ids`` restart on the padding, and no ``attention_mask`` is passed.

    transformers builds the per-example (block-diagonal causal) mask from ``position_ids`` only when no
    attention mask and no KV cache are given, hence also ``use_cache=False``. Padding sits at the end of
    a row, where causal attention keeps it out of every real token's view, and carries no labels.
    """

    pad_token_id: int

    def __call__(self, features: list[dict]) -> dict:
        width = max(len(f["input_ids"]) for f in features)
        batch = {"input_ids": [], "labels": [], "position_ids": []}
        for feature in features:
            pad = width - len(feature["input_ids"])
            batch["input_ids"].append(list(feature["input_ids"]) + [self.pad_token_id] * pad)
            batch["labels"].append(list(feature["labels"]) + [IGNORE_INDEX] * pad)
            batch["position_ids"].append(list(feature["position_ids"]) + list(range(pad)))
        return {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()} | {"use_cache": False}


VARLEN_KERNELS = ("flash_attention_2", "flash_attention_3")  # one variable-length sequence per example


@dataclass
class FlattenedCollator:
    """A micro-batch's packed rows concatenated into one row: no padding at all.

    For the variable-length kernels (`VARLEN_KERNELS`), which split a row into its examples at every
    ``position_ids`` restart, padding would be computed for nothing. SDPA, eager and flex attention instead
    build a block mask over the whole row, whose size grows with the square of its length: they keep
    `PackedCollator`'s padded rows. Every example's first label is already -100 (`pack`), so no example is
    trained to follow the one before it, within a row or across the rows joined here.
    """

    def __call__(self, features: list[dict]) -> dict:
        row = {key: [[value for f in features for value in f[key]]] for key in ("input_ids", "labels", "position_ids")}
        return {key: torch.tensor(value, dtype=torch.long) for key, value in row.items()} | {"use_cache": False}


def data_collator(recipe: RecipeArguments, tokenizer):
    """The collator for `load_data`'s rows: padding with labels -100, or packed rows padded, or flattened into
    one row where the attention kernel runs variable-length sequences."""
    if recipe.packing:
        model_class = model_class_named(recipe.model_name_or_path, recipe.trust_remote_code)
        if chosen_attention(recipe.attn_implementation, model_class) in VARLEN_KERNELS:
            return FlattenedCollator()
        return PackedCollator(tokenizer.pad_token_id)
    if on_xla():  # one shape, one compiled graph: XLA compiles again for every new batch shape
        return DataCollatorForSeq2Seq(
            tokenizer, label_pad_token_id=IGNORE_INDEX, padding="max_length", max_length=recipe.max_seq_length
        )
    return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX, padding=True)


def packed_rows_keep_their_order(context: RuleContext) -> str | None:
    """Packed rows are not grouped by length: they are all about ``max_seq_length`` long, and an evaluation that joins
    them for a variable-length kernel (`FlattenedCollator`) finds the rows of its last batch by their order in the set
    (`fsdp_peft.procedures.eval_loss`), which Trainer's length-grouped sampler would change."""
    strategy = context.training.get("train_sampling_strategy")
    if not context.recipe.packing or strategy != "group_by_length":
        return None
    return (
        "packing: true with train_sampling_strategy: group_by_length: packed rows are all about max_seq_length long, "
        "there is nothing to group, and the evaluation reads them in order; remove train_sampling_strategy"
    )


def check_packing_keeps_examples_apart(model) -> None:
    """Refuse ``packing`` when this model's attention lets a packed example see the one before it.

    Runs two short examples packed in one row and the second alone, and compares its logits.
    """
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        first, second = torch.arange(3, 9, device=device)[None], torch.arange(11, 16, device=device)[None]
        positions = torch.tensor([list(range(6)) + list(range(5))], device=device)
        with torch.no_grad():
            packed = model(input_ids=torch.cat([first, second], 1), position_ids=positions, use_cache=False).logits
            alone = model(input_ids=second, use_cache=False).logits
    finally:
        model.train(was_training)
    difference = (packed[0, 6:].float() - alone[0].float()).abs().max().item()
    scale = alone.float().abs().max().item()
    if difference > 1e-2 * max(scale, 1.0):
        attention = getattr(model.config, "_attn_implementation", "?")
        raise ConfigError(
            f"packing: with attn_implementation '{attention}' this model lets packed examples attend to each "
            f"other (logits differ by {difference:.3g}); set packing: false or use eager, sdpa or flash attention"
        )
