"""Data: every format and file type, which token positions carry loss, truncation, eval split, bad rows."""

from __future__ import annotations

import json

import pandas
import pytest
from transformers import AutoTokenizer

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.data.cache import load_data
from fsdp_peft.data.formats import Example, read_examples
from fsdp_peft.data.templates import render_example_prompt
from fsdp_peft.data.tokenize import IGNORE_INDEX, tokenize_example, tokenized_dataset
from fsdp_peft.settings.config import RecipeArguments

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "bye"},
    {"role": "assistant", "content": "ciao"},
]
CHAT_TEXT = (
    "<|begin_of_text|><|system|>be brief<|end|><|user|>hi<|end|><|assistant|>hello<|end|>"
    "<|user|>bye<|end|><|assistant|>ciao<|end|>"
)
# byte-level tokenizer: one token per character, one per special token
CHAT_TRAINED_POSITIONS = [*range(16, 22), *range(28, 33)]  # "hello<|end|>", "ciao<|end|>"
PAIRS = [{"prompt": f"reverse: {w}", "completion": w[::-1]} for w in ("abcde", "fghij", "klmno", "pqrst")]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(autouse=True)
def data_cache(tmp_path, monkeypatch):
    """Each test tokenizes into its own cache (the embedded model stays in the session cache)."""
    monkeypatch.setenv("FSDP_PEFT_CACHE", str(tmp_path / "cache"))


def write_rows(path, rows: list[dict]):
    """``rows`` as a .jsonl, .json, .parquet or .csv file (chats as JSON text in CSV cells)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        pandas.DataFrame(rows).to_parquet(path)
    else:
        cells = [{k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()} for row in rows]
        pandas.DataFrame(cells).to_csv(path, index=False)
    return path


def trained_positions(row: dict) -> list[int]:
    return [i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX]


def recipe(**values) -> RecipeArguments:
    return RecipeArguments(**({"max_seq_length": 128} | values))


# ---------------------------------------------------------------- formats and masking


def test_only_completion_and_end_token_carry_labels(tokenizer):
    row = tokenize_example(Example("reverse: abcde", "edcba"), tokenizer, RecipeArguments())
    assert (
        tokenizer.decode(row["input_ids"]) == "<|begin_of_text|><|user|>reverse: abcde<|end|><|assistant|>edcba<|end|>"
    )
    assert trained_positions(row) == list(range(18, 24))  # "edcba" and <|end|>, the last 6 of 24 tokens
    assert row["labels"][18:] == row["input_ids"][18:]


def test_without_chat_template_the_raw_prompt_is_used(tokenizer):
    row = tokenize_example(Example("Q: 1+1=", "2"), tokenizer, RecipeArguments(use_chat_template=False))
    assert tokenizer.decode(row["input_ids"]) == "Q: 1+1=2<|end|>"
    assert trained_positions(row) == [7, 8]


@pytest.mark.parametrize("name", ["train.jsonl", "train.json", "train.parquet", "train.csv", "shards/"])
def test_every_file_type_and_a_directory_give_the_same_tokens(tokenizer, tmp_path, name):
    if name.endswith("/"):
        write_rows(tmp_path / "shards" / "a.parquet", PAIRS[:2])
        write_rows(tmp_path / "shards" / "b.jsonl", PAIRS[2:])
    else:
        write_rows(tmp_path / name, PAIRS)
    train, held_out, examples = load_data(recipe(train_file=str(tmp_path / name)), tokenizer)
    expected = [tokenize_example(Example(**pair), tokenizer, recipe()) for pair in PAIRS]
    assert train.to_list() == expected
    assert held_out is None and examples == []


def test_a_dataset_directory_with_train_and_eval_files(tokenizer, tmp_path):
    write_rows(tmp_path / "train.csv", PAIRS[:3])
    write_rows(tmp_path / "validation.parquet", PAIRS[3:])
    train, held_out, examples = load_data(recipe(dataset=str(tmp_path)), tokenizer)
    assert len(train) == 3 and len(held_out) == 1
    assert examples == [Example(**PAIRS[3])]


def test_instruction_rows_join_instruction_and_input(tokenizer, tmp_path):
    rows = [
        {"instruction": "reverse", "input": "abc", "output": "cba"},
        {"instruction": "say hi", "input": "", "output": "hi"},
    ]
    train, _, _ = load_data(recipe(train_file=str(write_rows(tmp_path / "i.jsonl", rows))), tokenizer)
    first, second = train.to_list()
    assert (
        tokenizer.decode(first["input_ids"]) == "<|begin_of_text|><|user|>reverse\n\nabc<|end|><|assistant|>cba<|end|>"
    )
    assert tokenizer.decode([first["labels"][i] for i in trained_positions(first)]) == "cba<|end|>"
    assert tokenizer.decode(second["input_ids"]) == "<|begin_of_text|><|user|>say hi<|end|><|assistant|>hi<|end|>"


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_messages_train_only_the_assistant_turns(tokenizer, tmp_path, suffix):
    path = write_rows(tmp_path / f"chat{suffix}", [{"messages": CHAT}])
    (row,) = load_data(recipe(train_file=str(path)), tokenizer)[0].to_list()
    assert tokenizer.decode(row["input_ids"]) == CHAT_TEXT
    assert trained_positions(row) == CHAT_TRAINED_POSITIONS
    assert tokenizer.decode([row["labels"][i] for i in CHAT_TRAINED_POSITIONS]) == "hello<|end|>ciao<|end|>"


def test_sharegpt_conversations_tokenize_like_messages(tokenizer, tmp_path):
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in CHAT]}]
    (row,) = load_data(recipe(train_file=str(write_rows(tmp_path / "s.json", sharegpt))), tokenizer)[0].to_list()
    assert tokenizer.decode(row["input_ids"]) == CHAT_TEXT
    assert trained_positions(row) == CHAT_TRAINED_POSITIONS


def test_completion_only_loss_false_trains_every_token(tokenizer, tmp_path):
    path = write_rows(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    (row,) = load_data(recipe(train_file=str(path), completion_only_loss=False), tokenizer)[0].to_list()
    assert row["labels"] == row["input_ids"]


def test_a_held_out_chat_is_prompted_up_to_its_last_assistant_turn(tokenizer, tmp_path):
    train = write_rows(tmp_path / "train.jsonl", [{"messages": CHAT}])
    held = write_rows(tmp_path / "eval.jsonl", [{"messages": CHAT}])
    _, held_out, examples = load_data(recipe(train_file=str(train), eval_file=str(held)), tokenizer)
    assert examples == [Example("bye", "ciao", CHAT[:-1])]
    prompt = render_example_prompt(tokenizer, examples[0], use_chat_template=True)
    assert prompt == CHAT_TEXT.removesuffix("ciao<|end|>")
    assert trained_positions(held_out[0]) == CHAT_TRAINED_POSITIONS


def test_a_declared_format_wins_and_unclear_columns_are_errors(tokenizer, tmp_path):
    both = write_rows(tmp_path / "both.jsonl", [{"prompt": "p", "completion": "c", "messages": CHAT}])
    with pytest.raises(
        ConfigError,
        match=r"both.jsonl: columns fit several formats \(messages, prompt_completion\); "
        "set data_format",
    ):
        load_data(recipe(train_file=str(both)), tokenizer)
    (row,) = load_data(recipe(train_file=str(both), data_format="prompt_completion"), tokenizer)[0].to_list()
    assert tokenizer.decode(row["input_ids"]).endswith("<|user|>p<|end|><|assistant|>c<|end|>")
    neither = write_rows(tmp_path / "neither.csv", [{"question": "q", "answer": "a"}])
    with pytest.raises(ConfigError, match=r"neither.csv: no known data format in columns \['answer', 'question'\]"):
        load_data(recipe(train_file=str(neither)), tokenizer)


def test_chat_rows_need_the_chat_template(tokenizer, tmp_path):
    path = write_rows(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    with pytest.raises(ConfigError, match="use_chat_template: false, but chat rows"):
        load_data(recipe(train_file=str(path), use_chat_template=False), tokenizer)


# ---------------------------------------------------------------- truncation


def test_truncation_right_cuts_the_answer_end_and_left_the_prompt_start(tokenizer):
    example = Example("reverse: abcde", "edcba")  # 18 prompt tokens + 6 answer tokens
    right = tokenize_example(example, tokenizer, recipe(max_seq_length=20, truncation="right"))
    assert tokenizer.decode(right["input_ids"]).endswith("<|assistant|>ed") and trained_positions(right) == [18, 19]
    left = tokenize_example(example, tokenizer, recipe(max_seq_length=10, truncation="left"))
    assert tokenizer.decode(left["input_ids"]) == "de<|end|><|assistant|>edcba<|end|>"
    assert trained_positions(left) == list(range(4, 10))


def test_truncation_drop_removes_long_rows_and_counts_them(tokenizer, tmp_path, capsys):
    rows = [PAIRS[0], {"prompt": "reverse: " + "x" * 40, "completion": "y"}, PAIRS[1]]
    path = write_rows(tmp_path / "t.jsonl", rows)
    train, _, _ = load_data(recipe(train_file=str(path), max_seq_length=40, truncation="drop"), tokenizer)
    assert [tokenizer.decode(r["input_ids"]).split("reverse: ")[1][:5] for r in train] == ["abcde", "fghij"]
    assert f"data: train 2 rows from {path}; dropped 1: 1 longer than max_seq_length" in capsys.readouterr().out


# ---------------------------------------------------------------- bad rows

BAD_ROWS = {
    "missing field": ('{"prompt": "a"}', "row 2: missing field 'completion'; fix the row"),
    "wrong type": ('{"prompt": "a", "completion": 5}', "row 2: 'completion' must be a string, got int"),
    "invalid JSON": ("{not json", "row 2: not valid JSON"),
    "not an object": ("[1, 2]", "row 2: a row must be a JSON object, got list"),
    "empty completion": ('{"prompt": "a", "completion": ""}', "row 2: empty 'completion' leaves nothing to train on"),
    "unknown role": (
        json.dumps({"messages": [*CHAT[:2], {"role": "bot", "content": "x"}]}),
        "row 2: 'messages'[2] has unknown role 'bot' (known: system, user, assistant); fix the row or set "
        "skip_invalid_rows: true",
    ),
    "unknown sharegpt role": (
        json.dumps({"conversations": [{"from": "bot", "value": "x"}]}),
        "row 2: 'conversations'[0] has unknown role 'bot' (known: system, human, gpt)",
    ),
    "empty content": (
        json.dumps({"messages": [{"role": "user", "content": " "}, CHAT[2]]}),
        "row 2: 'messages'[0] (user) has empty content",
    ),
    "missing content": (
        json.dumps({"messages": [{"role": "user"}]}),
        "row 2: 'messages'[0] needs 'role' and 'content'",
    ),
    "no assistant turn": (json.dumps({"messages": CHAT[:2]}), "row 2: 'messages' has no assistant turn to train on"),
    "no trainable tokens": (
        json.dumps({"prompt": "x" * 200, "completion": "y"}),
        "row 2: no completion tokens left after right truncation to max_seq_length=128; raise max_seq_length, "
        "shorten the prompt or set truncation: left or set skip_invalid_rows: true",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_a_bad_row_is_an_error_naming_file_row_rule_and_fix(tokenizer, tmp_path, case):
    line, message = BAD_ROWS[case]
    good = {"messages": CHAT, "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    good = json.dumps({key: good[key] for key in good if f'"{key}"' in line} or PAIRS[0])
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(ConfigError) as error:
        load_data(recipe(train_file=str(path)), tokenizer)
    assert str(error.value).startswith(f"{path}: {message}")


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_rows_of_tables_are_counted_from_one(tokenizer, tmp_path, suffix):
    path = write_rows(tmp_path / f"bad{suffix}", [PAIRS[0], PAIRS[1], {"prompt": "a", "completion": ""}])
    with pytest.raises(ConfigError, match=f"^{path}: row 3: empty 'completion'"):
        load_data(recipe(train_file=str(path)), tokenizer)


def test_skip_invalid_rows_drops_bad_rows_and_reports_counts_per_reason(tokenizer, tmp_path, capsys):
    lines = [
        json.dumps({"messages": CHAT}),
        *(BAD_ROWS[c][0] for c in ("unknown role", "empty content", "invalid JSON")),
        json.dumps({"messages": [*CHAT[:2], {"role": "bot", "content": "x"}]}),
        json.dumps({"messages": CHAT[1:3]}),
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    train, _, _ = load_data(recipe(train_file=str(path), skip_invalid_rows=True), tokenizer)
    assert [tokenizer.decode(row["input_ids"]) for row in train] == [
        CHAT_TEXT,
        "<|begin_of_text|><|user|>hi<|end|><|assistant|>hello<|end|>",
    ]
    out = capsys.readouterr().out
    assert (
        f"[fsdp-peft] data: train 2 rows from {path}; dropped 4: 1 empty content, 1 invalid JSON, 2 unknown role" in out
    )


def test_skipping_every_row_is_an_error(tokenizer, tmp_path):
    path = tmp_path / "all_bad.jsonl"
    path.write_text('{"prompt": "a"}\n')
    with pytest.raises(ConfigError, match="no row left to train on \\(1 missing field dropped\\)"):
        load_data(recipe(train_file=str(path), skip_invalid_rows=True), tokenizer)


def test_read_examples_and_tokenized_dataset_name_the_bad_row(tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + '\n\n{"prompt": "a"}\n')
    with pytest.raises(ConfigError, match=f"^{path}: row 3: missing field 'completion'"):  # JSONL rows are lines
        read_examples(path)
    with pytest.raises(ConfigError, match="t.jsonl: row 1: no completion tokens left after right truncation"):
        tokenized_dataset(
            [Example("a long prompt indeed", "x")], tokenizer, recipe(max_seq_length=8), tmp_path / "t.jsonl"
        )


# ---------------------------------------------------------------- eval split and hub


def test_eval_split_holds_out_a_seeded_fraction(tokenizer, tmp_path):
    from transformers import TrainingArguments

    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(20)]
    path = write_rows(tmp_path / "rows.jsonl", rows)

    def split(seed):
        args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, seed=seed, report_to="none")
        train, held_out, examples = load_data(recipe(train_file=str(path), eval_split=0.25), tokenizer, args)
        return [e.completion for e in examples], len(train), len(held_out)

    first, again, other = split(1), split(1), split(2)
    assert first == again and first[1:] == (15, 5)
    assert first[0] != other[0]
    assert set(first[0]) <= {r["completion"] for r in rows} and len(set(first[0])) == 5


def test_eval_split_with_eval_data_is_an_error(tokenizer):
    with pytest.raises(ConfigError, match="eval_split: 0.1 splits eval rows off the training data, but eval data is"):
        load_data(recipe(eval_split=0.1), tokenizer)


def test_a_hub_dataset_is_loaded_by_name_config_and_split(tokenizer, monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, config, split):
        calls.append((name, config, split))
        return datasets.Dataset.from_list([{"messages": CHAT}] if split == "train" else [{"messages": CHAT[:3]}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    config = recipe(dataset="org/chats", dataset_config="en", dataset_eval_split="test")
    train, held_out, examples = load_data(config, tokenizer)
    assert calls == [("org/chats", "en", "train"), ("org/chats", "en", "test")]
    assert trained_positions(train[0]) == CHAT_TRAINED_POSITIONS and examples == [Example("hi", "hello", CHAT[:2])]


def test_an_unreachable_hub_dataset_is_a_clear_error(tokenizer, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ConfigError,
        match="dataset: cannot load 'someone/no-such-data' split 'train' from the Hugging "
        "Face hub: .*; check the name, config and split and that the hub is reachable",
    ):
        load_data(recipe(dataset="someone/no-such-data"), tokenizer)


def source_rows(config: RecipeArguments) -> list[Example]:
    from fsdp_peft.data.formats import source_examples
    from fsdp_peft.data.sources import data_sources

    return source_examples(data_sources(config)[0])[0]


GSM8K_LIKE = [{"question": f"reverse: {w}", "answer": w[::-1]} for w in ("abcde", "fghij", "klmno", "pqrst")]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_dataset_columns_renames_columns_before_the_format_is_read(tokenizer, tmp_path, suffix):
    """GSM8K's question/answer rows read as prompt/completion, from every file type."""
    renamed = write_rows(tmp_path / "renamed" / f"train{suffix}", GSM8K_LIKE)
    plain = write_rows(tmp_path / "plain" / f"train{suffix}", PAIRS)
    mapping = {"question": "prompt", "answer": "completion"}
    got = source_rows(recipe(train_file=str(renamed), dataset_columns=mapping))
    assert got == source_rows(recipe(train_file=str(plain))) and len(got) == 4


def test_dataset_columns_on_a_hub_dataset(tokenizer, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda name, config, split: datasets.Dataset.from_list(GSM8K_LIKE))
    mapping = {"question": "prompt", "answer": "completion"}
    config = recipe(dataset="openai/gsm8k", dataset_config="main", dataset_columns=mapping)
    train, _, _ = load_data(config, tokenizer)
    assert len(train) == 4


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"query": "prompt"}, "dataset_columns: {path} has no column 'query' (its columns: answer, question); map"),
        (
            {"question": "answer"},
            "dataset_columns: question -> answer, but {path} already has a column 'answer'; map that one too",
        ),
    ],
)
def test_dataset_columns_naming_a_missing_or_taken_column_is_one_line(tokenizer, tmp_path, mapping, message):
    path = write_rows(tmp_path / "train.jsonl", GSM8K_LIKE)
    with pytest.raises(ConfigError) as error:
        source_rows(recipe(train_file=str(path), dataset_columns=mapping))
    assert str(error.value).startswith(message.format(path=path))
