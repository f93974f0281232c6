"""Preference data: pairs (DPO, ORPO) and unpaired rated completions (KTO), checked like the SFT data.

Row formats, detected from the columns:

- pairs as strings: ``{"prompt": str, "chosen": str, "rejected": str}``
- pairs as chats: ``{"chosen": [turns], "rejected": [turns]}``, each ending with the assistant's answer
  and sharing every turn before it (or, TRL's explicit form, those turns in ``"prompt": [turns]``)
- unpaired (KTO): an SFT row (``prompt``/``completion`` or ``messages``) plus ``"label": true|false``

Sources are the SFT data's (`fsdp_peft.data.sources`: the embedded ``tiny-preference``, local files,
hub datasets). A bad row is the same `ConfigError` naming file, row, rule and fix as in SFT data, or,
with ``skip_invalid_rows``, dropped and counted. Rows reach TRL rendered as text: the prompt as the
model sees it before its answer (the chat template's generation prompt), the answers as what follows.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from datasets import Dataset

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import logger
from fsdp_peft.data.formats import ROLES, BadRow, _string, _turns, parse_row
from fsdp_peft.data.sources import Source, data_sources, read_source
from fsdp_peft.data.templates import chat_segments, render_prompt
from fsdp_peft.data.tokenize import describe_dropped
from fsdp_peft.settings.config import RecipeArguments

PREFERENCE_FORMATS = ("pairs", "unpaired")


@dataclass
class PreferenceExample:
    """One row: the ``prompt`` (the last user turn of a chat), answers, and for chats the turns before them."""

    prompt: str
    chosen: str = ""
    rejected: str = ""
    messages: list[dict] | None = None  # chat rows: the conversation before the answer(s)
    completion: str = ""  # unpaired rows
    label: bool | None = None  # unpaired rows: whether the completion is desirable


def detect_preference_format(columns: set[str], where: str) -> str:
    """``pairs`` (chosen and rejected), ``unpaired`` (label); else an error naming the columns needed."""
    if "chosen" in columns or "rejected" in columns:
        return "pairs"
    if "label" in columns:
        return "unpaired"
    raise ConfigError(
        f"{where}: no preference data in columns {sorted(columns)}; rows need prompt/chosen/rejected "
        "(or chosen/rejected chats), or KTO's completion/label; rename the columns"
    )


def _conversation_order(messages: list[dict], key: str) -> None:
    """An optional system turn, then user and assistant alternating, ending with the assistant's answer."""
    roles = [m["role"] for m in messages]
    body = roles[1:] if roles and roles[0] == "system" else roles
    expected = ["user" if i % 2 == 0 else "assistant" for i in range(len(body))]
    if body != expected or not body or body[-1] != "assistant":
        raise BadRow(
            "roles out of order",
            f"'{key}' has roles {roles} out of order; after an optional system turn, user and assistant alternate "
            "and the assistant's answer comes last",
        )


def _chat_pair(row: dict) -> tuple[list[dict], str, str]:
    """The shared turns before the answers, and the chosen and rejected answers, of a chat pair."""
    known = "system, user, assistant"
    roles = {r: r for r in ROLES}
    prompt = row.get("prompt") if isinstance(row.get("prompt"), list) else []
    if prompt:
        prompt = _turns(
            {"prompt": prompt + [{"role": "assistant", "content": "-"}]}, "prompt", "role", "content", roles, known
        )[:-1]
    answers = {}
    for key in ("chosen", "rejected"):
        if row.get(key) is None:
            raise BadRow("missing field", f"missing field '{key}'")
        turns = _turns(
            {key: prompt + row[key]} if isinstance(row[key], list) else row, key, "role", "content", roles, known
        )
        _conversation_order(turns, key)
        answers[key] = turns
    if answers["chosen"][:-1] != answers["rejected"][:-1]:
        raise BadRow(
            "different prompts",
            "'chosen' and 'rejected' differ before their last assistant turn; a pair answers one conversation",
        )
    return answers["chosen"][:-1], answers["chosen"][-1]["content"], answers["rejected"][-1]["content"]


def parse_preference_row(row: dict, data_format: str) -> PreferenceExample:
    """The row as a `PreferenceExample`; raises `BadRow` naming the problem and the fix."""
    if data_format == "unpaired":
        label = row.get("label")
        if label is None:
            raise BadRow("missing field", "missing field 'label'")
        if not isinstance(label, bool):
            raise BadRow("wrong type", f"'label' must be true or false, got {type(label).__name__}")
        example = parse_row(row, "messages" if "messages" in row else "prompt_completion")
        context = None
        if example.messages is not None:
            _conversation_order(example.messages, "messages")
            context = example.messages[:-1]
        return PreferenceExample(example.prompt, messages=context, completion=example.completion, label=label)
    if isinstance(row.get("chosen"), list) or isinstance(row.get("rejected"), list):
        context, chosen, rejected = _chat_pair(row)
        users = [m["content"] for m in context if m["role"] == "user"]
        example = PreferenceExample(users[-1] if users else "", chosen, rejected, context)
    else:
        example = PreferenceExample(_string(row, "prompt"), _string(row, "chosen"), _string(row, "rejected"))
        for key in ("prompt", "chosen", "rejected"):
            if not getattr(example, key).strip():
                raise BadRow("empty content", f"empty '{key}' leaves nothing to compare")
    if example.chosen.strip() == example.rejected.strip():
        raise BadRow(
            "identical answers", "'chosen' and 'rejected' are identical, so there is nothing to prefer", "fix the row"
        )
    return example


def render_pair(example: PreferenceExample, tokenizer, recipe: RecipeArguments) -> dict[str, str]:
    """The texts TRL tokenizes: prompt as rendered for generation, then each answer as rendered after it."""
    answers = {"chosen": example.chosen, "rejected": example.rejected, "completion": example.completion}
    if example.messages is None:
        prompt = render_prompt(tokenizer, example.prompt, recipe.use_chat_template)
        texts = {key: text + tokenizer.eos_token for key, text in answers.items() if text}
        return {"prompt": prompt, **texts}
    if not recipe.use_chat_template:
        raise ConfigError("use_chat_template: false, but chat rows are rendered with the chat template; set it true")
    rendered = {}
    for key, text in answers.items():
        if not text:
            continue
        pieces = chat_segments(tokenizer, [*example.messages, {"role": "assistant", "content": text}])
        last = max(i for i, (_, trained) in enumerate(pieces) if trained)
        rendered["prompt"] = "".join(piece for piece, _ in pieces[:last])
        rendered[key] = "".join(piece for piece, _ in pieces[last:])
    return rendered


def read_preference_source(
    source: Source, tokenizer, recipe: RecipeArguments, unpaired: bool = False
) -> tuple[Dataset, list[PreferenceExample], Counter]:
    """Every row of ``source`` checked and rendered for TRL, the parsed examples, and rows dropped per reason."""
    rows, examples, dropped = [], [], Counter()
    for where, table in read_source(source):
        columns = set(table.column_names) - {"__row__", "__json__"}
        if "__json__" in table.column_names:
            columns = {key for text in table["__json__"][:100] for key in _keys(text)}
        data_format = detect_preference_format(columns, where)
        if data_format == "unpaired" and not unpaired:
            raise ConfigError(
                f"{where}: holds unpaired completion/label rows; loss_type {recipe.loss_type} needs "
                "prompt/chosen/rejected pairs; set loss_type: kto to train on these rows"
            )
        for raw in table:
            try:
                row = _row(raw)
                example = parse_preference_row(row, data_format)
                rendered = render_pair(example, tokenizer, recipe)
            except BadRow as bad:
                if not recipe.skip_invalid_rows:
                    raise ConfigError(bad.message(where, raw["__row__"])) from None
                dropped[bad.reason] += 1
                continue
            if data_format == "unpaired":
                rows.append({**rendered, "label": example.label})
            elif unpaired:  # KTO on pairs: chosen is a desirable completion, rejected an undesirable one
                rows += [
                    {"prompt": rendered["prompt"], "completion": rendered[key], "label": key == "chosen"}
                    for key in ("chosen", "rejected")
                ]
            else:
                rows.append(rendered)
            examples.append(example)
    if not rows:
        raise ConfigError(f"{source}: no row left to train on ({describe_dropped(dropped)} dropped); fix the data")
    return Dataset.from_list(rows), examples, dropped


def _keys(text: str) -> set[str]:
    try:
        row = json.loads(text)
    except json.JSONDecodeError:
        return set()
    return set(row) if isinstance(row, dict) else set()


def _row(raw: dict) -> dict:
    if "__json__" not in raw:
        return {key: value for key, value in raw.items() if key != "__row__"}
    try:
        row = json.loads(raw["__json__"])
    except json.JSONDecodeError as error:
        raise BadRow("invalid JSON", f"not valid JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise BadRow("wrong type", f"a row must be a JSON object, got {type(row).__name__}")
    for key in ("chosen", "rejected", "prompt", "messages"):
        if isinstance(row.get(key), str) and row[key].lstrip().startswith("["):  # CSV cells hold chats as JSON text
            try:
                row[key] = json.loads(row[key])
            except json.JSONDecodeError:
                pass
    return row


def load_preference_data(
    recipe: RecipeArguments, tokenizer, unpaired: bool = False
) -> tuple[Dataset, Dataset | None, list[PreferenceExample]]:
    """Train rows, eval rows (``None`` without eval data) and the held-out examples, rendered for TRL."""
    train_source, eval_source = data_sources(recipe)
    train, _, dropped = read_preference_source(train_source, tokenizer, recipe, unpaired)
    if dropped:
        logger.warning(f"{train_source}: skipped {describe_dropped(dropped)} rows (skip_invalid_rows: true)")
    if eval_source is None and recipe.eval_split > 0:
        split = train.train_test_split(test_size=recipe.eval_split, seed=0)
        train, held_out = split["train"], split["test"]
        return train, held_out, []
    if eval_source is None:
        return train, None, []
    held_out, examples, _ = read_preference_source(eval_source, tokenizer, recipe, unpaired)
    return train, held_out, examples
