"""Instruction data: prompt/completion JSONL rows, tokenized with the prompt masked out of the loss."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset

from fsdp_peft.config import RecipeArguments
from fsdp_peft.errors import ConfigError
from fsdp_peft.tiny import TINY_DATASET_DIR, TINY_DATASET_NAME

IGNORE_INDEX = -100


@dataclass
class Example:
    prompt: str
    completion: str


def data_files(recipe: RecipeArguments) -> tuple[Path, Path | None]:
    """The train and (optional) held-out JSONL files the config points at."""
    directory = TINY_DATASET_DIR if recipe.dataset == TINY_DATASET_NAME else Path(recipe.dataset).expanduser()
    train = Path(recipe.train_file).expanduser() if recipe.train_file else directory / "train.jsonl"
    if recipe.eval_file:
        return train, Path(recipe.eval_file).expanduser()
    held_out = directory / "eval.jsonl"
    return train, held_out if held_out.is_file() else None


def read_examples(path: Path) -> list[Example]:
    """Rows of ``{"prompt": ..., "completion": ...}``; a bad row is an error naming file and line."""
    examples = []
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("prompt", "completion")):
                raise ConfigError(f"{path}:{number}: a row needs string fields 'prompt' and 'completion'")
            if not row["completion"]:
                raise ConfigError(f"{path}:{number}: empty 'completion' leaves nothing to train on")
            examples.append(Example(row["prompt"], row["completion"]))
    if not examples:
        raise ConfigError(f"{path}: no rows")
    return examples


def render_prompt(tokenizer, prompt: str, use_chat_template: bool) -> str:
    """The text the model sees before its answer: the chat template's user turn, or the raw prompt."""
    if not use_chat_template:
        return prompt
    if not tokenizer.chat_template:
        raise ConfigError("use_chat_template: the tokenizer has no chat template; set use_chat_template: false")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)


def tokenize_example(example: Example, tokenizer, recipe: RecipeArguments) -> dict:
    """Token ids and labels for one example; labels are ``-100`` over the prompt."""
    prompt_text = render_prompt(tokenizer, example.prompt, recipe.use_chat_template)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(example.completion + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    input_ids = (prompt_ids + answer_ids)[: recipe.max_seq_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + answer_ids)[: recipe.max_seq_length]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def tokenized_dataset(examples: list[Example], tokenizer, recipe: RecipeArguments, path: Path) -> Dataset:
    """A `datasets.Dataset` of tokenized examples; an example left with no trained token is an error."""
    rows = []
    for number, example in enumerate(examples, start=1):
        row = tokenize_example(example, tokenizer, recipe)
        if all(label == IGNORE_INDEX for label in row["labels"]):
            raise ConfigError(
                f"{path}: row {number} has no completion tokens left after truncation to "
                f"max_seq_length={recipe.max_seq_length}; raise max_seq_length or shorten the prompt"
            )
        rows.append(row)
    return Dataset.from_list(rows)


def load_data(recipe: RecipeArguments, tokenizer) -> tuple[Dataset, Dataset | None, list[Example]]:
    """Tokenized train and eval datasets, and the held-out examples used for generation."""
    train_path, eval_path = data_files(recipe)
    train = tokenized_dataset(read_examples(train_path), tokenizer, recipe, train_path)
    if eval_path is None:
        return train, None, []
    held_out = read_examples(eval_path)
    return train, tokenized_dataset(held_out, tokenizer, recipe, eval_path), held_out
