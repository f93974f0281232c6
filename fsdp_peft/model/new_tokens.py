"""New tokens (``new_special_tokens``, e.g. a chat template's ``<|tool_call|>``), trained without the whole embedding.

The tokens are added to the tokenizer (`add_new_tokens`); the input embedding, and an untied output head, grow to
the tokenizer's length before peft and FSDP wrap the model (`grow_vocabulary`), and exactly their rows are trained
as peft trainable tokens (`trained_token_indices`). A new row starts as the mean of the rows of the existing
vocabulary (`with_new_rows`): no random draw, so every rank, the low-memory loader and the export compute the same
row from the same weights. The grown tokenizer and a record of the growth (`NEW_TOKENS_FILE`) are written next to
the adapter and its checkpoints, and export grows the merged tensors and config the same way. This module imports
torch only at import time: the streaming export runs on it.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.model.model_record import NewTokens, record_of

NEW_TOKENS_FILE = "fsdp_peft_new_tokens.json"
TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "vocab*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
)


def add_new_tokens(tokenizer, tokens: list[str]) -> list[int]:
    """Add ``tokens`` as whole tokens (never split, matched on the raw text) and return their ids.

    They are not marked special: decoding with ``skip_special_tokens`` (generate, the exact-match samples) keeps
    them, as a tool call must be read back (Qwen2.5 adds its ``<tool_call>`` the same way)."""
    from tokenizers import AddedToken  # lazy: only runs with new tokens import the tokenizers bindings

    present = [token for token in tokens if token in tokenizer.get_vocab()]
    if present:
        raise ConfigError(
            f"new_special_tokens: {present[0]!r} is already in the tokenizer's vocabulary; drop it from "
            "new_special_tokens (train its existing row with trainable_token_indices)"
        )
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in tokens])
    return tokenizer.convert_tokens_to_ids(list(tokens))


def with_new_rows(weight: torch.Tensor, ids: list[int], rows: int) -> torch.Tensor:
    """``weight`` with ``rows`` rows (new rows appended), each row of ``ids`` set to the mean (in fp32, rounded
    once to the weight's dtype) of the rows below the first new id: the existing vocabulary."""
    grown = torch.zeros((rows, *weight.shape[1:]), dtype=weight.dtype, device=weight.device)
    grown[: weight.shape[0]] = weight[:rows]
    mean = weight[: min(ids)].mean(dim=0, dtype=torch.float32).to(weight.dtype)
    grown[torch.tensor(ids, device=weight.device)] = mean
    return grown


def _module_name(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)


def grow_vocabulary(model, tokenizer, recipe):
    """Grow ``model``'s input embedding (and untied head) to the tokenizer that `add_new_tokens` extended, on
    every rank the same way, before peft wraps it; the new rows are the mean row (`with_new_rows`). On a
    low-memory skeleton (meta weights) only the shapes grow: the loader fills the rows (`grown_checkpoint_tensor`).
    Returns ``model``."""
    tokens = list(recipe.new_special_tokens)
    if not tokens:
        return model
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    modules = [embedding] if head is None or tied else [embedding, head]
    names = [_module_name(model, module) for module in modules]
    originals = [module.weight.detach() for module in modules]
    base_rows = originals[0].shape[0]
    rows = max(base_rows, len(tokenizer))
    ids = tokenizer.convert_tokens_to_ids(tokens)
    if rows != base_rows:
        with torch.random.fork_rng(devices=[]):  # the new rows' random init is overwritten: keep the LoRA draws
            model.resize_token_embeddings(rows, mean_resizing=False)
    grown = [model.get_input_embeddings()] + ([model.get_output_embeddings()] if len(modules) == 2 else [])
    with torch.no_grad():
        for module, original in zip(grown, originals):
            if not original.is_meta:
                module.weight.copy_(with_new_rows(original, ids, rows))
    record = NewTokens(
        tokens=tokens,
        ids=ids,
        base_rows=base_rows,
        rows=rows,
        embedding=names[0].rsplit(".", 1)[-1],
        head=names[1].rsplit(".", 1)[-1] if len(names) == 2 else None,
        grown=[f"{name}.weight" for name in names],
        tokenizer=tokenizer,
    )
    record_of(model).new_tokens = record
    return model


def new_tokens_of(model) -> NewTokens | None:
    """The growth `grow_vocabulary` recorded on ``model`` (a peft model or its base), if any."""
    return record_of(model).new_tokens


def trained_token_indices(model, indices: list[int]):
    """peft's ``trainable_token_indices``: the user's rows of the embedding plus the new tokens' rows, and for an
    untied head also its new rows (``{module name: ids}``); the user's list alone without new tokens."""
    new = new_tokens_of(model)
    if new is None:
        return list(indices) or None
    trained = {new.embedding: list(dict.fromkeys([*indices, *new.ids]))}
    if new.head is not None:
        trained[new.head] = list(new.ids)
    return trained


def config_before_growth(model):
    """The base model's config as the base checkpoint states it (vocabulary size before growth): what an adapter
    records of its base, so that export and generate find the base it was trained on."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    new = new_tokens_of(model)
    if new is None:
        return base.config
    config = copy.deepcopy(base.config)
    config.get_text_config().vocab_size = new.base_rows
    return config


def write_new_tokens(model, directory: Path) -> None:
    """The growth record and the grown tokenizer, next to an adapter (final or checkpoint), for peft users, export
    and generate."""
    new = new_tokens_of(model)
    if new is None:
        return
    (Path(directory) / NEW_TOKENS_FILE).write_text(new.to_json())
    new.tokenizer.save_pretrained(directory)


def read_new_tokens(directory: Path) -> NewTokens | None:
    """The growth record next to an adapter, if it has one."""
    path = Path(directory) / NEW_TOKENS_FILE
    return NewTokens(**json.loads(path.read_text())) if path.is_file() else None


def grown_checkpoint_tensor(model, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """A base checkpoint tensor as the grown model holds it (low-memory loading reads the base checkpoint)."""
    new = new_tokens_of(model)
    if new is None or key not in new.grown:
        return tensor
    return with_new_rows(tensor, new.ids, new.rows)


def grown_layout(layout: list[tuple[str, list[int], torch.dtype]], new: NewTokens | None) -> list:
    """The export's output layout with the grown tensors' rows."""
    if new is None:
        return layout
    return [(key, [new.rows, *shape[1:]] if key in new.grown else shape, dtype) for key, shape, dtype in layout]


def write_grown_model_files(new: NewTokens | None, adapter_dir: Path, staging: Path) -> None:
    """The export's config.json with the grown vocabulary size, and the adapter's grown tokenizer files in place of
    the base's (copied as files: the export imports no transformers)."""
    if new is None:
        return
    path = staging / "config.json"
    config = json.loads(path.read_text())
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    text["vocab_size"] = new.rows
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for pattern in TOKENIZER_FILES:
        for source in Path(adapter_dir).glob(pattern):
            if source.is_file():
                shutil.copyfile(source, staging / source.name)


def tokenizer_directory(adapter_dir: Path, base_dir: Path) -> Path:
    """Where the tokenizer of a run lives: next to its adapter when it grew the vocabulary, else the base's."""
    return Path(adapter_dir) if read_new_tokens(adapter_dir) is not None else Path(base_dir)
