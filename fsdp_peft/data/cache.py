"""Tokenized once per node (local rank 0), saved under ``$FSDP_PEFT_CACHE/data/<key>``, loaded by all.

The key hashes the files' bytes (or the hub split's fingerprint), the tokenizer and every setting that
changes the result; the other ranks, and later runs, load the saved data from there. `load_data` is the
entry point: train rows, eval rows (given, or split off with ``eval_split``) and held-out examples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import random
from collections import Counter
from pathlib import Path
from typing import Callable

import datasets
from datasets import Dataset, load_from_disk

from fsdp_peft.core.atomic_publish import publish_directory
from fsdp_peft.core.distributed import gathered_from_every_rank, ranks
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import logger
from fsdp_peft.data.formats import Example, held_out_example
from fsdp_peft.data.packing import pack
from fsdp_peft.data.sources import Source, data_sources, load_hub_split
from fsdp_peft.data.tokenize import describe_dropped, encode_source
from fsdp_peft.model.paths import cache_dir
from fsdp_peft.settings.config import RecipeArguments

PREPROCESSING_VERSION = 1  # bump when the tokenized output of the same inputs changes
DEFAULT_SEED = 42  # TrainingArguments' default seed


def _hash_tokenizer(tokenizer, digest) -> None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    digest.update(vocabulary.encode())
    digest.update(
        json.dumps(
            [type(tokenizer).__name__, tokenizer.chat_template, tokenizer.special_tokens_map],
            sort_keys=True,
            default=str,
        ).encode()
    )


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
    "data_format",
    "max_seq_length",
    "truncation",
    "completion_only_loss",
    "use_chat_template",
    "packing",
    "eval_split",
    "skip_invalid_rows",
)


def _examples(rows: Dataset) -> list[Example]:
    return [
        held_out_example(Example(p, c, json.loads(m) if m else None))
        for p, c, m in zip(rows["prompt"], rows["completion"], rows["messages"])
    ]


def build(
    recipe: RecipeArguments,
    tokenizer,
    train: Source,
    held_out: Source | None,
    seed: int,
    target: Path,
    hub_splits: dict[Source, Dataset] | None = None,
) -> None:
    """Tokenize, split, pack and save the data to ``target`` (with a report of dropped rows)."""
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
            report["eval"] = {
                "source": f"{train} (eval_split {recipe.eval_split}, seed {seed})",
                "rows": count,
                "dropped": {},
            }
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


def downloaded_hub_splits(sources: list[Source | None]) -> dict[Source, Dataset]:
    """The hub splits among ``sources``, loaded; downloaded once per node (its first rank first, then the others
    read the local copy); a failure to load one stops every rank with its one line."""
    local_main = ranks().is_local_main
    hub_splits: dict[Source, Dataset] = {}
    if hub := [source for source in sources if source and source.hub]:

        def download() -> None:
            hub_splits.update({source: load_hub_split(*source.hub) for source in hub})

        _on_this_node_first(download, local_main)
        if not local_main:
            download()
    return hub_splits


def _print_report(report: dict, reused: Path | None) -> None:
    lines = []
    for split, part in report.items():
        line = f"data: {split} {part['rows']} rows from {part['source']}"
        if part.get("packed_rows") is not None:
            line += f", packed into {part['packed_rows']} rows"
        if part["dropped"]:
            line += f"; dropped {sum(part['dropped'].values())}: {describe_dropped(Counter(part['dropped']))}"
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
    hub_splits = downloaded_hub_splits([train, held_out])
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
