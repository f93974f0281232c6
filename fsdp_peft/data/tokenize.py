"""Examples as token ids and labels: each piece tokenized on its own, labels -100 off the trained pieces.

Each piece of an example (`fsdp_peft.data.templates`) is tokenized on its own and the pieces
concatenated, so a prompt tokenizes exactly as it does for generation; truncation cuts or drops what
exceeds ``max_seq_length``. `encode_source` tokenizes every row of a source (``Dataset.map``), dropping
and counting bad rows when ``skip_invalid_rows`` is set.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Callable

from datasets import Dataset, Features, List, Value, concatenate_datasets

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.data.formats import BadRow, Example, columns_of, detect_format, parse_row
from fsdp_peft.data.sources import Source, read_source
from fsdp_peft.data.templates import example_segments
from fsdp_peft.settings.config import RecipeArguments

IGNORE_INDEX = -100
TRUNCATIONS = ("right", "left", "drop")


def tokenize_example(example: Example, tokenizer, recipe: RecipeArguments) -> dict:
    """Token ids and labels of one example, truncated per ``truncation``; labels are -100 off the answers.

    Raises `BadRow` when ``truncation: drop`` drops it or when no trained token is left.
    """
    input_ids, labels = [], []
    for text, trained in example_segments(example, tokenizer, recipe):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        input_ids += ids
        labels += ids if trained or not recipe.completion_only_loss else [IGNORE_INDEX] * len(ids)
    limit = recipe.max_seq_length
    if len(input_ids) > limit:
        if recipe.truncation == "drop":
            raise BadRow(
                "longer than max_seq_length",
                f"{len(input_ids)} tokens exceed max_seq_length={limit}",
                "raise max_seq_length or set truncation: right/left",
            )
        keep = slice(-limit, None) if recipe.truncation == "left" else slice(None, limit)
        input_ids, labels = input_ids[keep], labels[keep]
    if all(label == IGNORE_INDEX for label in labels):
        raise BadRow(
            "no trainable tokens after truncation",
            f"no completion tokens left after {recipe.truncation} truncation to max_seq_length={limit}",
            "raise max_seq_length, shorten the prompt or set truncation: left",
        )
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


ENCODED = Features(
    {
        "input_ids": List(Value("int64")),
        "attention_mask": List(Value("int64")),
        "labels": List(Value("int64")),
        "prompt": Value("string"),
        "completion": Value("string"),
        "messages": Value("string"),  # JSON of the chat, "" for prompt/completion rows
        "reason": Value("string"),  # why the row was rejected, "" when it is kept
        "error": Value("string"),
    }
)


def _row_encoder(where: str, data_format: str, tokenizer, recipe: RecipeArguments) -> Callable[[dict], dict]:
    """The ``Dataset.map`` function: raw row → tokens, or (skipping) the rejection reason."""

    def encode(raw: dict) -> dict:
        try:
            if "__json__" in raw:
                try:
                    row = json.loads(raw["__json__"])
                except json.JSONDecodeError as error:
                    raise BadRow("invalid JSON", f"not valid JSON ({error.msg})") from None
                if not isinstance(row, dict):
                    raise BadRow("wrong type", f"a row must be a JSON object, got {type(row).__name__}")
            else:
                row = raw
            example = parse_row(row, data_format)
            tokens = tokenize_example(example, tokenizer, recipe)
        except BadRow as bad:
            if not recipe.skip_invalid_rows and bad.reason != "longer than max_seq_length":
                raise ConfigError(bad.message(where, raw["__row__"])) from None
            empty = {
                "input_ids": [],
                "attention_mask": [],
                "labels": [],
                "prompt": "",
                "completion": "",
                "messages": "",
            }
            return empty | {"reason": bad.reason, "error": bad.message(where, raw["__row__"])}
        chat = json.dumps(example.messages) if example.messages is not None else ""
        kept = {"prompt": example.prompt, "completion": example.completion, "messages": chat, "reason": "", "error": ""}
        return tokens | kept

    return encode


def encode_source(
    source: Source, tokenizer, recipe: RecipeArguments, hub_splits: dict[Source, Dataset] | None = None
) -> tuple[Dataset, Counter]:
    """Every row of ``source`` tokenized (``Dataset.map``), and the count of rows dropped per reason."""
    parts, dropped = [], Counter()
    for where, table in read_source(source, hub_splits):
        data_format = recipe.data_format
        if data_format == "auto":
            data_format = detect_format(columns_of(where, table), where)
        encoded = table.map(
            _row_encoder(where, data_format, tokenizer, recipe), remove_columns=table.column_names, features=ENCODED
        )
        reasons = encoded["reason"]
        if any(reasons):
            dropped.update(f"{reason}" for reason in reasons if reason)
            encoded = encoded.select([i for i, reason in enumerate(reasons) if not reason])
        parts.append(encoded)
    encoded = concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if len(encoded) == 0:
        raise ConfigError(nothing_left_to_train_on(source, dropped))
    return encoded.remove_columns(["reason", "error"]), dropped


def nothing_left_to_train_on(source: Source, dropped: Counter) -> str:
    """The problem of a source whose every row was dropped as bad."""
    return f"{source}: no row left to train on ({describe_dropped(dropped)} dropped); fix the data"


def describe_dropped(dropped: Counter) -> str:
    """``"2 missing field, 1 wrong type"``: dropped rows counted per reason."""
    return ", ".join(f"{count} {reason}" for reason, count in sorted(dropped.items()))


def tokenized_dataset(examples: list[Example], tokenizer, recipe: RecipeArguments, path: Path) -> Dataset:
    """Tokenized examples (unpacked); an example left with no trained token is an error naming its row."""
    rows = []
    for number, example in enumerate(examples, start=1):
        try:
            rows.append(tokenize_example(example, tokenizer, recipe))
        except BadRow as bad:
            raise ConfigError(bad.message(str(path), number)) from None
    return Dataset.from_list(rows)
