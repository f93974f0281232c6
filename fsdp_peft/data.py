"""Training data: local files or hub datasets in four formats, tokenized once, only answers trained.

Sources: the embedded ``tiny-reverse``; a local ``.jsonl``/``.json``/``.parquet``/``.csv`` file or a
directory of them; a hub dataset (``datasets.load_dataset(name)``). Formats, detected from the columns
or declared with ``data_format``:

- ``prompt_completion``: ``{"prompt": str, "completion": str}``
- ``instruction``: ``{"instruction": str, "input": str (optional), "output": str}`` (Alpaca)
- ``messages``: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
- ``sharegpt``: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}``

Every row becomes text segments that are trained or not (the prompt, or the non-assistant turns of a
chat rendered with the tokenizer's chat template), each tokenized on its own and concatenated, so a
prompt tokenizes exactly as it does for generation. A bad row is a `ConfigError` naming file, row,
rule and fix, unless ``skip_invalid_rows`` is set: then it is dropped and counted.

Tokenization runs once per node (local rank 0) and is saved under ``$FSDP_PEFT_CACHE/data/<key>``,
keyed by the files' bytes, the tokenizer and every setting that changes the result; the other ranks,
and later runs, load it from there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from datasets import Dataset, Features, List, Value, load_from_disk

from fsdp_peft.config import RecipeArguments
from fsdp_peft.errors import ConfigError
from fsdp_peft.files import publish_directory
from fsdp_peft.launch import ranks
from fsdp_peft.log import logger
from fsdp_peft.tiny import TINY_DATASET_DIR, TINY_DATASET_NAME, cache_dir

IGNORE_INDEX = -100
PREPROCESSING_VERSION = 1  # bump when the tokenized output of the same inputs changes
DATA_FORMATS = ("auto", "prompt_completion", "instruction", "messages", "sharegpt")
TRUNCATIONS = ("right", "left", "drop")
DATA_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
FORMAT_COLUMNS = {  # a column that marks each format, in detection order
    "messages": "messages",
    "sharegpt": "conversations",
    "instruction": "instruction",
    "prompt_completion": "prompt",
}
EVAL_NAMES = ("eval", "validation")
DEFAULT_SEED = 42  # TrainingArguments' default seed


@dataclass
class Example:
    """A held-out example: ``prompt`` (the last user turn for chats) and the expected ``completion``.

    For chat formats ``messages`` is the conversation before the last assistant turn, rendered with
    the chat template for generation; ``completion`` is that turn's content.
    """

    prompt: str
    completion: str
    messages: list[dict] | None = None


class BadRow(Exception):
    """A row that cannot be trained on: ``reason`` counts it, ``problem`` and ``fix`` explain it."""

    def __init__(self, reason: str, problem: str, fix: str = "fix the row"):
        super().__init__(problem)
        self.reason, self.problem, self.fix = reason, problem, fix

    def message(self, where: str, row: int) -> str:
        return f"{where}: row {row}: {self.problem}; {self.fix} or set skip_invalid_rows: true"


# ---------------------------------------------------------------- sources


@dataclass(frozen=True)
class Source:
    """Where one split's rows come from: local data files, or one split of a hub dataset."""

    files: tuple[Path, ...] = ()
    hub: tuple[str, str | None, str] | None = None  # name, config, split

    def __str__(self) -> str:
        if self.hub:
            name, config, split = self.hub
            return f"{name}{'/' + config if config else ''}[{split}]"
        return ", ".join(map(str, self.files))


def is_local_path(value: str) -> bool:
    """Whether ``dataset`` names a local path (else a hub dataset id)."""
    path = Path(value).expanduser()
    return path.exists() or value.startswith(("/", "./", "../", "~")) or path.suffix in DATA_EXTENSIONS


def data_files_in(path: Path) -> list[Path]:
    """The data files a path stands for: itself, or the data files directly inside the directory."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in DATA_EXTENSIONS)


def _split_in_directory(directory: Path, names: tuple[str, ...]) -> list[Path]:
    for name in names:
        files = sorted(p for p in directory.glob(f"{name}.*") if p.is_file() and p.suffix in DATA_EXTENSIONS)
        if files:
            return files
        if (directory / name).is_dir():
            return data_files_in(directory / name)
    return []


def data_sources(recipe: RecipeArguments) -> tuple[Source, Source | None]:
    """The train and (optional) eval source the config points at; ``train_file``/``eval_file`` win."""
    eval_source = Source(tuple(data_files_in(Path(recipe.eval_file).expanduser()))) if recipe.eval_file else None
    if recipe.train_file:
        return Source(tuple(data_files_in(Path(recipe.train_file).expanduser()))), eval_source
    dataset = recipe.dataset
    if dataset == TINY_DATASET_NAME or is_local_path(dataset):
        path = TINY_DATASET_DIR if dataset == TINY_DATASET_NAME else Path(dataset).expanduser()
        if path.is_file():
            return Source((path,)), eval_source
        train = _split_in_directory(path, ("train",))
        if not train:  # a directory of data files, all of them training rows
            return Source(tuple(data_files_in(path))), eval_source
        if eval_source is None and (held_out := _split_in_directory(path, EVAL_NAMES)):
            eval_source = Source(tuple(held_out))
        return Source(tuple(train)), eval_source
    train = Source(hub=(dataset, recipe.dataset_config, recipe.dataset_train_split))
    if eval_source is None and recipe.dataset_eval_split:
        eval_source = Source(hub=(dataset, recipe.dataset_config, recipe.dataset_eval_split))
    return train, eval_source


def data_files(recipe: RecipeArguments) -> tuple[Path, Path | None]:
    """The first train and eval file of a local config (the embedded data: its two JSONL files)."""
    train, held_out = data_sources(recipe)
    return train.files[0], held_out.files[0] if held_out else None


def _read_json_rows(path: Path) -> Dataset:
    """JSON rows kept as text, so that a malformed or oddly typed row is reported, not a pyarrow error."""
    if path.suffix == ".jsonl":
        with open(path) as handle:
            numbered = [(n, line) for n, line in enumerate(handle, start=1) if line.strip()]
    else:
        try:
            document = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: not valid JSON ({error.msg} at line {error.lineno}); fix the file") from None
        if isinstance(document, dict) and isinstance(document.get("data"), list):
            document = document["data"]
        if not isinstance(document, list):
            raise ConfigError(f"{path}: a .json file must hold a list of rows (or {{\"data\": [...]}}); use JSONL")
        numbered = [(n, json.dumps(row)) for n, row in enumerate(document, start=1)]
    return Dataset.from_dict({"__row__": [n for n, _ in numbered], "__json__": [text for _, text in numbered]})


def _read_table(path: Path) -> Dataset:
    if path.suffix == ".parquet":
        import pyarrow.parquet

        table = Dataset(pyarrow.parquet.read_table(path))
    else:
        import pandas

        table = Dataset.from_pandas(pandas.read_csv(path, dtype=str, keep_default_na=False), preserve_index=False)
    return table.add_column("__row__", list(range(1, len(table) + 1)))


def _load_hub(name: str, config: str | None, split: str) -> Dataset:
    import datasets

    try:
        loaded = datasets.load_dataset(name, config, split=split)
    except Exception as error:  # the hub's failures come in many types; all mean "cannot use this source"
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConfigError(
            f"dataset: cannot load '{name}'{f' (config {config})' if config else ''} split '{split}' from the "
            f"Hugging Face hub: {reason}; "
            "check the name, config and split and that the hub is reachable, or point dataset at a local file "
            "or directory"
        ) from None
    return loaded.add_column("__row__", list(range(1, len(loaded) + 1)))


def read_source(source: Source, hub_splits: dict[Source, Dataset] | None = None) -> list[tuple[str, Dataset]]:
    """Raw rows of each file (or the hub split, from ``hub_splits`` when loaded already), each named."""
    if source.hub:
        loaded = hub_splits.get(source) if hub_splits else None
        return [(str(source), loaded if loaded is not None else _load_hub(*source.hub))]
    if not source.files:
        raise ConfigError("data: no .jsonl, .json, .parquet or .csv files found; point dataset or train_file at some")
    parts = []
    for path in source.files:
        if path.suffix not in DATA_EXTENSIONS:
            raise ConfigError(f"{path}: unknown data file type; use .jsonl, .json, .parquet or .csv")
        table = _read_json_rows(path) if DATA_EXTENSIONS[path.suffix] == "json" else _read_table(path)
        parts.append((str(path), table))
    return parts


# ---------------------------------------------------------------- formats


def detect_format(columns: set[str], where: str) -> str:
    """The format whose marking column is present; none or several is an error asking for ``data_format``."""
    found = [name for name, column in FORMAT_COLUMNS.items() if column in columns]
    if "completion" in columns and "prompt_completion" not in found:
        found.append("prompt_completion")
    if "output" in columns and "instruction" not in found:
        found.append("instruction")
    if len(found) == 1:
        return found[0]
    if not found:
        raise ConfigError(
            f"{where}: no known data format in columns {sorted(columns)}; rows need prompt/completion, "
            "instruction/input/output, messages or conversations; rename the columns or set data_format"
        )
    raise ConfigError(f"{where}: columns fit several formats ({', '.join(found)}); set data_format to one of them")


def _columns(where: str, table: Dataset) -> set[str]:
    if "__json__" not in table.column_names:
        return set(table.column_names) - {"__row__"}
    keys: set[str] = set()
    for text in table["__json__"][:100]:
        try:
            row = json.loads(text)
        except json.JSONDecodeError:
            continue
        keys |= set(row) if isinstance(row, dict) else set()
    return keys


def _string(row: dict, key: str, required: bool = True) -> str:
    value = row.get(key)
    if value is None and not required:
        return ""
    if value is None:
        raise BadRow("missing field", f"missing field '{key}'")
    if not isinstance(value, str):
        raise BadRow("wrong type", f"'{key}' must be a string, got {type(value).__name__}")
    return value


def _turns(row: dict, key: str, role_key: str, content_key: str, roles: dict[str, str], known: str) -> list[dict]:
    """A chat as ``[{"role", "content"}]``, every turn checked: known role, non-empty string content."""
    turns = row.get(key)
    if isinstance(turns, str):  # CSV cells hold chats as JSON text
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError:
            raise BadRow("wrong type", f"'{key}' must be a list of turns, got text that is not JSON") from None
    if turns is None:
        raise BadRow("missing field", f"missing field '{key}'")
    if not isinstance(turns, list) or not turns:
        raise BadRow("wrong type", f"'{key}' must be a non-empty list of turns")
    messages = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise BadRow("missing field", f"'{key}'[{index}] needs '{role_key}' and '{content_key}'")
        role, content = turn[role_key], turn[content_key]
        if role not in roles:
            raise BadRow("unknown role", f"'{key}'[{index}] has unknown role {role!r} (known: {known})")
        if not isinstance(content, str):
            raise BadRow("wrong type", f"'{key}'[{index}] content must be a string, got {type(content).__name__}")
        if not content.strip():
            raise BadRow("empty content", f"'{key}'[{index}] ({role}) has empty content")
        messages.append({"role": roles[role], "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no assistant turn", f"'{key}' has no assistant turn to train on")
    return messages


def parse_row(row: dict, data_format: str) -> Example:
    """The row as an `Example` (chats keep every turn in ``messages``); raises `BadRow`."""
    if data_format in ("messages", "sharegpt"):
        if data_format == "messages":
            messages = _turns(row, "messages", "role", "content", {r: r for r in ROLES}, "system, user, assistant")
        else:
            messages = _turns(row, "conversations", "from", "value", SHAREGPT_ROLES, "system, human, gpt")
        last_user = [m["content"] for m in messages if m["role"] == "user"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        return Example(last_user[-1] if last_user else "", messages[last]["content"], messages)
    if data_format == "instruction":
        instruction, extra, answer = _string(row, "instruction"), _string(row, "input", False), _string(row, "output")
        prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        completion_key = "output"
    else:
        prompt, answer, completion_key = _string(row, "prompt"), _string(row, "completion"), "completion"
    if not answer:
        raise BadRow("empty content", f"empty '{completion_key}' leaves nothing to train on")
    return Example(prompt, answer)


def held_out_example(example: Example) -> Example:
    """For generation: a chat ends before its last assistant turn, whose content is the expected answer."""
    if example.messages is None:
        return example
    last = max(i for i, m in enumerate(example.messages) if m["role"] == "assistant")
    return Example(example.prompt, example.completion, example.messages[:last])


# ---------------------------------------------------------------- rendering and tokenization


def _chat_template(tokenizer) -> None:
    if not tokenizer.chat_template:
        raise ConfigError("use_chat_template: the tokenizer has no chat template; set use_chat_template: false")


def render_prompt(tokenizer, prompt: str, use_chat_template: bool) -> str:
    """The text the model sees before its answer: the chat template's user turn, or the raw prompt."""
    if not use_chat_template:
        return prompt
    _chat_template(tokenizer)
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)


def render_example_prompt(tokenizer, example: Example, use_chat_template: bool) -> str:
    """The generation prompt of a held-out example: its conversation so far, or its prompt."""
    if example.messages is None:
        return render_prompt(tokenizer, example.prompt, use_chat_template)
    _chat_template(tokenizer)
    return tokenizer.apply_chat_template(example.messages, tokenize=False, add_generation_prompt=True)


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as error:  # jinja's raise_exception and template bugs
        raise BadRow("chat template error", f"the chat template refused the conversation ({error})") from None


def chat_segments(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered chat cut into (text, is_assistant_turn) pieces.

    An assistant turn is what rendering the conversation through it adds to rendering the conversation
    before it with the generation prompt (for most templates: the content and the end-of-turn token).
    A template that rewrites earlier turns as later ones are added is refused: its answer positions
    cannot be found.
    """
    full = _render(tokenizer, messages)
    segments, done = [], ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:index], add_generation_prompt=True)
        through = _render(tokenizer, messages[: index + 1])
        if not (before.startswith(done) and through.startswith(before) and full.startswith(through)):
            raise ConfigError(
                "data: the tokenizer's chat template renders earlier turns differently once later turns are added, "
                "so the assistant tokens cannot be located; use a template whose renderings are prefixes of each "
                "other, or convert the data to prompt/completion rows"
            )
        segments += [(before[len(done) :], False), (through[len(before) :], True)]
        done = through
    segments.append((full[len(done) :], False))
    return [(text, trained) for text, trained in segments if text]


def example_segments(example: Example, tokenizer, recipe: RecipeArguments) -> list[tuple[str, bool]]:
    """The example's text as (piece, trained) pieces: prompt then answer and end token, or a chat."""
    if example.messages is not None:
        if not recipe.use_chat_template:
            raise ConfigError(
                "use_chat_template: false, but chat rows (messages/conversations) are rendered with the tokenizer's "
                "chat template; set use_chat_template: true"
            )
        _chat_template(tokenizer)
        return chat_segments(tokenizer, example.messages)
    prompt = render_prompt(tokenizer, example.prompt, recipe.use_chat_template)
    return [(prompt, False), (example.completion + tokenizer.eos_token, True)]


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
                "longer than max_seq_length", f"{len(input_ids)} tokens exceed max_seq_length={limit}",
                "raise max_seq_length or set truncation: right/left",
            )  # fmt: skip
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
            empty = {"input_ids": [], "attention_mask": [], "labels": [], "prompt": "", "completion": "", "messages": ""}
            return empty | {"reason": bad.reason, "error": bad.message(where, raw["__row__"])}
        chat = json.dumps(example.messages) if example.messages is not None else ""
        kept = {"prompt": example.prompt, "completion": example.completion, "messages": chat, "reason": "", "error": ""}
        return tokens | kept

    return encode


def encode_source(
    source: Source, tokenizer, recipe: RecipeArguments, hub_splits: dict[Source, Dataset] | None = None
) -> tuple[Dataset, Counter]:
    """Every row of ``source`` tokenized (``Dataset.map``), and the count of rows dropped per reason."""
    from datasets import concatenate_datasets

    parts, dropped = [], Counter()
    for where, table in read_source(source, hub_splits):
        data_format = recipe.data_format
        if data_format == "auto":
            data_format = detect_format(_columns(where, table), where)
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
        raise ConfigError(f"{source}: no row left to train on ({_describe(dropped)} dropped); fix the data")
    return encoded.remove_columns(["reason", "error"]), dropped


def _describe(dropped: Counter) -> str:
    return ", ".join(f"{count} {reason}" for reason, count in sorted(dropped.items()))


# ---------------------------------------------------------------- packing


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
        import torch

        width = max(len(f["input_ids"]) for f in features)
        batch = {"input_ids": [], "labels": [], "position_ids": []}
        for feature in features:
            pad = width - len(feature["input_ids"])
            batch["input_ids"].append(list(feature["input_ids"]) + [self.pad_token_id] * pad)
            batch["labels"].append(list(feature["labels"]) + [IGNORE_INDEX] * pad)
            batch["position_ids"].append(list(feature["position_ids"]) + list(range(pad)))
        return {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()} | {"use_cache": False}


def data_collator(recipe: RecipeArguments, tokenizer):
    """The collator for `load_data`'s rows: padding with labels -100, or padding packed rows."""
    if recipe.packing:
        return PackedCollator(tokenizer.pad_token_id)
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX, padding=True)


def check_packing_keeps_examples_apart(model) -> None:
    """Refuse ``packing`` when this model's attention lets a packed example see the one before it.

    Runs two short examples packed in one row and the second alone, and compares its logits.
    """
    import torch

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


# ---------------------------------------------------------------- once per node, cached


def _hash_tokenizer(tokenizer, digest) -> None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    digest.update(vocabulary.encode())
    digest.update(json.dumps([type(tokenizer).__name__, tokenizer.chat_template, tokenizer.special_tokens_map],
                             sort_keys=True, default=str).encode())  # fmt: skip


def cache_key(
    recipe: RecipeArguments, tokenizer, sources: list[Source | None], seed: int, hub_splits: dict[Source, Dataset]
) -> str:
    """Hash of what decides the tokenized data: file bytes (or hub split and its fingerprint), tokenizer,
    settings, seed."""
    digest = hashlib.sha256(f"fsdp-peft data v{PREPROCESSING_VERSION}".encode())
    for source in sources:
        digest.update(repr(source.hub if source else None).encode())
        if source in hub_splits:
            digest.update(hub_splits[source]._fingerprint.encode())
        for path in source.files if source else ():
            digest.update(str(path.resolve()).encode())
            with open(path, "rb") as handle:
                while block := handle.read(1 << 24):
                    digest.update(block)
    _hash_tokenizer(tokenizer, digest)
    settings = {key: getattr(recipe, key) for key in DATA_SETTINGS}
    digest.update(json.dumps([settings, seed], sort_keys=True).encode())
    return digest.hexdigest()[:20]


DATA_SETTINGS = (
    "data_format", "max_seq_length", "truncation", "completion_only_loss", "use_chat_template", "packing",
    "eval_split", "skip_invalid_rows",
)  # fmt: skip


def _examples(rows: Dataset) -> list[Example]:
    return [
        held_out_example(Example(p, c, json.loads(m) if m else None))
        for p, c, m in zip(rows["prompt"], rows["completion"], rows["messages"])
    ]


def build(
    recipe: RecipeArguments, tokenizer, train: Source, held_out: Source | None, seed: int, target: Path,
    hub_splits: dict[Source, Dataset] | None = None,
) -> None:
    """Tokenize, split, pack and save the data to ``target`` (with a report of dropped rows)."""
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        train_rows, dropped = encode_source(train, tokenizer, recipe, hub_splits)
        report = {"train": {"source": str(train), "rows": len(train_rows), "dropped": dict(dropped)}}
        if held_out is not None:
            eval_rows, eval_dropped = encode_source(held_out, tokenizer, recipe, hub_splits)
            report["eval"] = {"source": str(held_out), "rows": len(eval_rows), "dropped": dict(eval_dropped)}
        elif recipe.eval_split > 0:
            if len(train_rows) < 2:
                raise ConfigError(f"eval_split: {train} has {len(train_rows)} row; nothing to split off")
            order = list(range(len(train_rows)))
            random.Random(seed).shuffle(order)
            count = min(max(1, round(len(order) * recipe.eval_split)), len(order) - 1)
            eval_rows = train_rows.select(sorted(order[:count]))
            train_rows = train_rows.select(sorted(order[count:]))
            report["train"]["rows"] = len(train_rows)
            report["eval"] = {"source": f"{train} (eval_split {recipe.eval_split}, seed {seed})", "rows": count,
                              "dropped": {}}  # fmt: skip
        else:
            eval_rows = None
        columns = ["prompt", "completion", "messages"]
        if eval_rows is not None:
            with open(target / "held_out.jsonl", "w") as handle:
                for example in _examples(eval_rows):
                    handle.write(json.dumps(dataclasses.asdict(example)) + "\n")
            eval_rows = eval_rows.remove_columns(columns)
        train_rows = train_rows.remove_columns(columns)
        if recipe.packing:
            report["train"]["packed_rows"] = len(train_rows := pack(train_rows, recipe.max_seq_length, seed))
            if eval_rows is not None:
                report["eval"]["packed_rows"] = len(eval_rows := pack(eval_rows, recipe.max_seq_length, seed))
        train_rows.save_to_disk(target / "train")
        if eval_rows is not None:
            eval_rows.save_to_disk(target / "eval")
        (target / "report.json").write_text(json.dumps(report, indent=1))
    finally:
        if bars:
            datasets.enable_progress_bars()


def _agree(error: str | None) -> None:
    """Wait for every rank; raise the first rank's error on all of them (so none waits forever)."""
    from fsdp_peft.fsdp import gathered_from_every_rank

    if first := next((e for e in gathered_from_every_rank(error) if e), None):
        raise ConfigError(first)


def _on_this_node_first(build_here: Callable[[], None], local_main: bool) -> None:
    """Run ``build_here`` on each node's first rank while the others wait; errors reach every rank."""
    error, failure = None, None
    if local_main:
        try:
            build_here()
        except ConfigError as problem:
            error = str(problem)
        except Exception as crash:  # still meet the other ranks, then fail with the real traceback
            error, failure = f"data preparation failed on another rank: {type(crash).__name__}: {crash}", crash
    if failure is not None:
        with contextlib.suppress(ConfigError):
            _agree(error)
        raise failure
    _agree(error)


def _print_report(report: dict, reused: Path | None) -> None:
    lines = []
    for split, part in report.items():
        line = f"data: {split} {part['rows']} rows from {part['source']}"
        if part.get("packed_rows") is not None:
            line += f", packed into {part['packed_rows']} rows"
        if part["dropped"]:
            line += f"; dropped {sum(part['dropped'].values())}: {_describe(Counter(part['dropped']))}"
        lines.append(line)
    if reused:
        lines.append(f"data: tokenized once, reused from {reused}")
    for line in lines:
        logger.info(line)


def load_data(recipe: RecipeArguments, tokenizer, training=None) -> tuple[Dataset, Dataset | None, list[Example]]:
    """Tokenized train and eval datasets, and the held-out examples used for generation.

    ``training`` (the `TrainingArguments`) gives the seed (``data_seed``, else ``seed``) for eval
    splitting and packing, and sets up the process group so that one rank per node tokenizes.
    """
    seed = DEFAULT_SEED
    if training is not None:
        seed = training.data_seed if training.data_seed is not None else training.seed
        training.device  # sets up the distributed state (and process group) if not done yet
    train, held_out = data_sources(recipe)
    if recipe.eval_split > 0 and held_out is not None:
        raise ConfigError(
            f"eval_split: {recipe.eval_split} splits eval rows off the training data, but eval data is already "
            f"given ({held_out}); set eval_split: 0 or remove the eval file"
        )
    local_main = ranks().is_local_main
    hub_splits: dict[Source, Dataset] = {}
    if hub := [source for source in (train, held_out) if source and source.hub]:

        def download() -> None:
            hub_splits.update({source: _load_hub(*source.hub) for source in hub})

        _on_this_node_first(download, local_main)  # download once per node, then the others read the local copy
        if not local_main:
            download()
    target = cache_dir() / "data" / cache_key(recipe, tokenizer, [train, held_out], seed, hub_splits)
    reused = target if (target / "report.json").is_file() else None

    def build_here() -> None:
        if not (target / "report.json").is_file():
            with publish_directory(target) as staging:
                build(recipe, tokenizer, train, held_out, seed, staging, hub_splits)

    _on_this_node_first(build_here, local_main)
    if ranks().is_main:
        _print_report(json.loads((target / "report.json").read_text()), reused)
    train_rows = load_from_disk(str(target / "train"))
    if not (target / "eval").is_dir():
        return train_rows, None, []
    with open(target / "held_out.jsonl") as handle:
        examples = [Example(**json.loads(line)) for line in handle]
    return train_rows, load_from_disk(str(target / "eval")), examples


# ---------------------------------------------------------------- one file at a time


def read_examples(path: Path, data_format: str = "auto") -> list[Example]:
    """The rows of one data file as `Example`s; the first bad row is an error naming file and row."""
    (where, table), = read_source(Source((Path(path),)))
    data_format = data_format if data_format != "auto" else detect_format(_columns(where, table), where)
    examples = []
    for raw in table:
        try:
            row = json.loads(raw["__json__"]) if "__json__" in raw else raw
            if not isinstance(row, dict):
                raise BadRow("wrong type", f"a row must be a JSON object, got {type(row).__name__}")
            examples.append(parse_row(row, data_format))
        except json.JSONDecodeError as error:
            raise ConfigError(BadRow("invalid JSON", f"not valid JSON ({error.msg})").message(where, raw["__row__"]))
        except BadRow as bad:
            raise ConfigError(bad.message(where, raw["__row__"])) from None
    if not examples:
        raise ConfigError(f"{path}: no rows")
    return examples


def tokenized_dataset(examples: list[Example], tokenizer, recipe: RecipeArguments, path: Path) -> Dataset:
    """Tokenized examples (unpacked); an example left with no trained token is an error naming its row."""
    rows = []
    for number, example in enumerate(examples, start=1):
        try:
            rows.append(tokenize_example(example, tokenizer, recipe))
        except BadRow as bad:
            raise ConfigError(bad.message(str(path), number)) from None
    return Dataset.from_list(rows)
