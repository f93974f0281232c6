"""The four row formats, detected from the columns or declared with ``data_format``, each row checked.

- ``prompt_completion``: ``{"prompt": str, "completion": str}``
- ``instruction``: ``{"instruction": str, "input": str (optional), "output": str}`` (Alpaca)
- ``messages``: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
- ``sharegpt``: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}``

`parse_row` turns a row into an `Example` or raises `BadRow`, which names the problem and the fix.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.data.sources import Source, read_source

DATA_FORMATS = ("auto", "prompt_completion", "instruction", "messages", "sharegpt")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
FORMAT_COLUMNS = {  # a column that marks each format, in detection order
    "messages": "messages",
    "sharegpt": "conversations",
    "instruction": "instruction",
    "prompt_completion": "prompt",
}


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


def columns_of(where: str, table: Dataset) -> set[str]:
    """The columns of ``table``; for JSON rows, the keys of its first 100 rows."""
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


def read_examples(path: Path, data_format: str = "auto") -> list[Example]:
    """The rows of one data file as `Example`s; the first bad row is an error naming file and row."""
    examples, _ = source_examples(Source((Path(path),)), data_format)
    if not examples:
        raise ConfigError(f"{path}: no rows")
    return examples


def source_examples(source: Source, data_format: str = "auto", skip_invalid: bool = False):
    """Every row of ``source`` as an `Example`, and the rows dropped per reason (``skip_invalid``; else the first bad
    row is an error naming file and row)."""
    examples, dropped = [], Counter()
    for where, table in read_source(source):
        row_format = data_format if data_format != "auto" else detect_format(columns_of(where, table), where)
        for raw in table:
            try:
                try:
                    row = json.loads(raw["__json__"]) if "__json__" in raw else raw
                except json.JSONDecodeError as error:
                    raise BadRow("invalid JSON", f"not valid JSON ({error.msg})") from None
                if not isinstance(row, dict):
                    raise BadRow("wrong type", f"a row must be a JSON object, got {type(row).__name__}")
                examples.append(parse_row(row, row_format))
            except BadRow as bad:
                if not skip_invalid:
                    raise ConfigError(bad.message(where, raw["__row__"])) from None
                dropped[bad.reason] += 1
    return examples, dropped
