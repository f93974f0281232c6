"""Image-and-text rows for vision-language models: read, checked one by one, rendered with the processor.

The format is the chat format with image parts that TRL and the hub's VLM datasets use: ``messages`` (each
content a string or a list of ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` parts) and ``images``
(one per image part, in order): paths (relative to the data file's directory, or absolute), or a datasets
``Image`` value (``{"bytes": ..., "path": ...}``). The last message is the assistant's answer: the loss is on its
tokens only, never on the prompt or the image tokens.

Every row is checked before any weights load, and a bad one stops the run in one line naming its file and row:
an image that is missing or unreadable, a remote URL (nothing is downloaded), image parts and images that differ
in number, images for a text-only model, a row whose image tokens push it past ``max_seq_length``.

The processor runs once per row here (to count its tokens and its prompt's), and again in `VisionCollator` on each
batch (pixel values are not kept: they are large).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_peft.core.errors import ConfigError

IGNORE_INDEX = -100
REMOTE = ("http://", "https://", "s3://", "gs://", "hf://")


@dataclass(frozen=True)
class VisionRow:
    """One checked row: the rendered chat text, the prompt before the answer, its images and token counts."""

    text: str
    prompt: str  # the conversation before the last (assistant) message, with the generation prompt
    answer: str
    images: tuple  # resolved paths (str) or in-memory image bytes
    tokens: int
    prompt_tokens: int
    where: str  # file and row, for messages


def read_rows(path: Path) -> list[dict]:
    """The rows of a ``.jsonl`` (one JSON object a line), ``.json`` (a list of them) or ``.parquet`` file (as
    ``datasets`` writes one: an ``Image`` column holds ``{"bytes": ..., "path": ...}`` values)."""
    from fsdp_peft.data.sources import Source, read_source  # lazy: datasets and pandas; generate needs neither

    return [row for where, table in read_source(Source((path,))) for row in rows_of(table, where)]


def rows_of(table, where: str) -> list[dict]:
    """The rows of a table `fsdp_peft.data.sources.read_source` read (a file's, or a hub split's): JSON rows parsed,
    and an ``Image`` column's values as stored (``{"bytes": ..., "path": ...}``), never decoded here."""
    if "__json__" in table.column_names:
        rows = []
        for number, text in zip(table["__row__"], table["__json__"]):
            try:
                rows.append(json.loads(text))
            except json.JSONDecodeError as error:
                raise ConfigError(f"{where} row {number}: not valid JSON ({error.msg}); fix the row") from None
        return rows
    stored = table.with_format("arrow")[: len(table)].to_pylist()  # arrow: images as stored (bytes, path)
    return [{key: value for key, value in row.items() if key != "__row__"} for row in stored]


def image_parts(messages: list[dict]) -> int:
    """How many ``{"type": "image"}`` parts a conversation has."""
    return sum(
        1
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    )


def _image_reference(value, base: Path, where: str):
    """A path (str) or bytes for one ``images`` entry; refuses remote URLs and missing files."""
    if isinstance(value, dict):  # a datasets Image value
        if value.get("bytes"):
            return bytes(value["bytes"])
        value = value.get("path")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: an images entry is {value!r}; give a file path or a datasets Image value")
    if value.startswith(REMOTE):
        raise ConfigError(
            f"{where}: image {value} is remote and nothing is downloaded here; download the images and give "
            "their paths (relative to the data file)"
        )
    path = Path(value).expanduser()
    path = path if path.is_absolute() else base / path
    if not path.is_file():
        raise ConfigError(f"{where}: image {path} does not exist; fix the path (relative to the data file)")
    return str(path)


def open_image(reference):
    """A PIL RGB image from a path or bytes."""
    from PIL import Image  # lazy: only vision runs read images

    with Image.open(io.BytesIO(reference) if isinstance(reference, bytes) else reference) as image:
        return image.convert("RGB")


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")


def check_rows(
    rows: list[dict], source, processor, max_seq_length: int, vision: bool, dropped: list[str] | None = None
) -> list[VisionRow]:
    """``rows`` of ``source`` (a data file's path, or a hub split's name) checked and rendered (see the module
    docstring); ``vision``: the model takes images. A bad row raises its one line, or with a ``dropped`` list
    (``skip_invalid_rows``) is left out and its line appended there."""
    base = source.parent if isinstance(source, Path) else Path.cwd()  # where relative image paths start
    out = []
    for number, row in enumerate(rows, start=1):
        try:
            out.append(_checked(row, f"{source} row {number}", base, processor, max_seq_length, vision))
        except ConfigError as problem:
            if dropped is None:
                raise
            dropped.append(str(problem))
    return out


def _checked(row: dict, where: str, base: Path, processor, max_seq_length: int, vision: bool) -> VisionRow:
    if not isinstance(row, dict):  # a JSON line holding a list, a string, a number
        raise ConfigError(f"{where}: a row must be a JSON object, got {type(row).__name__}; fix the row")
    messages, images = row.get("messages"), row.get("images") or []
    chat = isinstance(messages, list) and messages and all(isinstance(message, dict) for message in messages)
    if not chat or messages[-1].get("role") != "assistant":
        raise ConfigError(f"{where}: needs messages ending with the assistant's answer (the chat format)")
    parts = image_parts(messages)
    if parts != len(images):
        raise ConfigError(
            f"{where}: {parts} image part(s) in messages but {len(images)} image(s); give one image per "
            '{"type": "image"} part'
        )
    if images and not vision:
        raise ConfigError(f"{where}: has images but the model takes text only; use a vision-language model")
    references = tuple(_image_reference(value, base, where) for value in images)
    try:
        opened = [open_image(reference) for reference in references]
    except OSError as error:
        raise ConfigError(f"{where}: an image cannot be read ({error}); replace or remove it") from None
    prompt = processor.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
    text = processor.apply_chat_template(messages, tokenize=False)
    if not text.startswith(prompt):
        raise ConfigError(f"{where}: the chat template renders the prompt differently inside the whole row")
    ids = _token_ids(processor, text, opened)
    tokens = len(ids)
    if tokens > max_seq_length:
        raise ConfigError(
            f"{where}: {tokens} tokens with its image tokens, over max_seq_length {max_seq_length}; raise "
            "max_seq_length, use smaller images, or set skip_invalid_rows: true to leave such rows out"
        )
    answer = _text_of(messages[-1]["content"])
    prompt_ids = _token_ids(processor, prompt, opened)
    if ids[: len(prompt_ids)] != prompt_ids:  # the labels start where the prompt's tokens end
        raise ConfigError(f"{where}: the tokenizer splits the prompt differently inside the whole row")
    return VisionRow(text, prompt, answer, references, tokens, len(prompt_ids), where)


def _token_ids(processor, text: str, images: list) -> list[int]:
    encoded = processor(text=[text], images=[images] if images else None, return_tensors="pt", add_special_tokens=False)
    return encoded["input_ids"][0].tolist()


def processor_inputs(processor, texts: list[str], images: list[list]) -> dict:
    """The processor's batch for ``texts`` with their ``images`` (a list per text, possibly empty). The texts come
    from the chat template, which writes the special tokens itself (Gemma's BOS): the tokenizer adds none."""
    common = {"return_tensors": "pt", "padding": True, "add_special_tokens": False}
    if not any(images):
        return dict(processor(text=texts, **common))
    nested = getattr(processor, "image_processor", None).__class__.__name__.startswith("Gemma3")
    flat = [image for row in images for image in row]
    return dict(processor(text=texts, images=images if nested else flat, **common))


class VisionCollator:
    """A training batch of `VisionRow` s: the processor's inputs (right padding) and labels on the answers only."""

    def __init__(self, processor):
        self.processor = processor

    def __call__(self, rows: list[VisionRow]) -> dict:
        self.processor.tokenizer.padding_side = "right"
        images = [[open_image(reference) for reference in row.images] for row in rows]
        batch = processor_inputs(self.processor, [row.text for row in rows], images)
        labels = batch["input_ids"].clone()
        for index, row in enumerate(rows):
            labels[index, : row.prompt_tokens] = IGNORE_INDEX
        labels[batch["attention_mask"] == 0] = IGNORE_INDEX
        batch["labels"] = labels
        return batch


class RowsDataset(torch.utils.data.Dataset):
    """A list of `VisionRow` as the Trainer's dataset."""

    def __init__(self, rows: list[VisionRow]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> VisionRow:
        return self.rows[index]
