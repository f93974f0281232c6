"""Tokenized data: the prompt is masked out of the loss, bad rows are errors naming file and line."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from fsdp_peft.config import RecipeArguments
from fsdp_peft.data import IGNORE_INDEX, Example, read_examples, tokenize_example, tokenized_dataset
from fsdp_peft.errors import ConfigError


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_only_completion_and_end_token_carry_labels(tokenizer):
    row = tokenize_example(Example("reverse: abcde", "edcba"), tokenizer, RecipeArguments())
    trained = [label for label in row["labels"] if label != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "edcba<|end|>"
    assert tokenizer.decode(row["input_ids"]) == "<|begin_of_text|><|user|>reverse: abcde<|end|><|assistant|>edcba<|end|>"
    assert row["labels"][: len(row["labels"]) - len(trained)] == [IGNORE_INDEX] * (len(row["labels"]) - len(trained))


def test_without_chat_template_the_raw_prompt_is_used(tokenizer):
    row = tokenize_example(Example("Q: 1+1=", "2"), tokenizer, RecipeArguments(use_chat_template=False))
    assert tokenizer.decode(row["input_ids"]) == "Q: 1+1=2<|end|>"


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "a"}', "bad.jsonl:2: a row needs string fields 'prompt' and 'completion'"),
        ("{not json", "bad.jsonl:2: not valid JSON"),
        ('{"prompt": "a", "completion": ""}', "bad.jsonl:2: empty 'completion' leaves nothing to train on"),
    ],
)
def test_bad_rows_are_errors_with_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "completion": "fine"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=message):
        read_examples(path)


def test_an_example_truncated_to_no_completion_is_an_error(tokenizer, tmp_path):
    recipe = RecipeArguments(max_seq_length=8)
    with pytest.raises(ConfigError, match="row 1 has no completion tokens left after truncation to max_seq_length=8"):
        tokenized_dataset([Example("a long prompt indeed", "x")], tokenizer, recipe, tmp_path / "t.jsonl")
