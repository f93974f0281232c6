"""Where a split's rows come from: the embedded ``tiny-reverse``, local data files, or a hub dataset split.

A local source is a ``.jsonl``/``.json``/``.parquet``/``.csv`` file or a directory of them, split by
``train.*`` and ``eval.*``/``validation.*`` files or directories when it has them; a hub source is one
split of ``datasets.load_dataset(name, config)``. `read_source` reads the raw rows, numbered (``__row__``)
for error messages; JSON rows stay text (``__json__``) so that a bad row is reported as a row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import datasets
import pandas
import pyarrow.parquet
from datasets import Dataset

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.model.real_tasks import ISO_DATES_NAME, SUMS_NAME, task_dir
from fsdp_peft.model.tiny import TINY_DATASET_DIR, TINY_PREFERENCE_DIR
from fsdp_peft.settings.choices import TINY_DATASET_NAME, TINY_PREFERENCE_NAME
from fsdp_peft.settings.config import RecipeArguments

DATA_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
EVAL_NAMES = ("eval", "validation")
EMBEDDED_DATASETS = {
    TINY_DATASET_NAME: TINY_DATASET_DIR,
    TINY_PREFERENCE_NAME: TINY_PREFERENCE_DIR,
    ISO_DATES_NAME: task_dir(ISO_DATES_NAME),
    SUMS_NAME: task_dir(SUMS_NAME),
}


@dataclass(frozen=True)
class Source:
    """Where one split's rows come from: local data files, or one split of a hub dataset."""

    files: tuple[Path, ...] = ()
    hub: tuple[str, str | None, str] | None = None  # name, config, split
    renames: tuple[tuple[str, str], ...] = ()  # dataset_columns: (column in the data, the name the formats read)

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
    """The train and (optional) eval source the config points at; ``train_file``/``eval_file`` win; each with the
    column renames of ``dataset_columns``."""
    train, eval_source = _unrenamed_sources(recipe)
    renames = tuple((str(old), str(new)) for old, new in (recipe.dataset_columns or {}).items())
    if not renames:
        return train, eval_source
    return replace(train, renames=renames), eval_source and replace(eval_source, renames=renames)


def _unrenamed_sources(recipe: RecipeArguments) -> tuple[Source, Source | None]:
    eval_source = Source(tuple(data_files_in(Path(recipe.eval_file).expanduser()))) if recipe.eval_file else None
    if recipe.train_file:
        return Source(tuple(data_files_in(Path(recipe.train_file).expanduser()))), eval_source
    dataset = recipe.dataset
    if dataset in EMBEDDED_DATASETS or is_local_path(dataset):
        path = EMBEDDED_DATASETS[dataset] if dataset in EMBEDDED_DATASETS else Path(dataset).expanduser()
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
            raise ConfigError(f'{path}: a .json file must hold a list of rows (or {{"data": [...]}}); use JSONL')
        numbered = [(n, json.dumps(row)) for n, row in enumerate(document, start=1)]
    return Dataset.from_dict({"__row__": [n for n, _ in numbered], "__json__": [text for _, text in numbered]})


def _read_table(path: Path) -> Dataset:
    if path.suffix == ".parquet":
        table = Dataset(pyarrow.parquet.read_table(path))
    else:
        table = Dataset.from_pandas(pandas.read_csv(path, dtype=str, keep_default_na=False), preserve_index=False)
    return table.add_column("__row__", list(range(1, len(table) + 1)))


def load_hub_split(name: str, config: str | None, split: str) -> Dataset:
    """One split of a hub dataset, rows numbered; a failure to load it is a `ConfigError`."""
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
        parts = [(str(source), loaded if loaded is not None else load_hub_split(*source.hub))]
    elif not source.files:
        raise ConfigError("data: no .jsonl, .json, .parquet or .csv files found; point dataset or train_file at some")
    else:
        parts = []
        for path in source.files:
            if path.suffix not in DATA_EXTENSIONS:
                raise ConfigError(f"{path}: unknown data file type; use .jsonl, .json, .parquet or .csv")
            table = _read_json_rows(path) if DATA_EXTENSIONS[path.suffix] == "json" else _read_table(path)
            if len(table) == 0:
                raise ConfigError(f"{path}: the file is empty (no rows); put rows in it or point dataset elsewhere")
            parts.append((str(path), table))
    return [(where, renamed(table, source.renames, where)) for where, table in parts]


def renamed(table: Dataset, renames: tuple[tuple[str, str], ...], where: str) -> Dataset:
    """``table`` with the columns of ``dataset_columns`` renamed (JSON rows: the keys of each row that has them).
    A column the data lacks, or a new name the data already uses for another column, is one error line."""
    if not renames:
        return table
    mapping = dict(renames)
    if "__json__" not in table.column_names:
        columns = set(table.column_names) - {"__row__"}
    else:
        rows = [_json_object(text) for text in table["__json__"]]
        columns = set().union(*(row.keys() for row in rows if row is not None))
    for old, new in renames:
        if old not in columns:
            raise ConfigError(
                f"dataset_columns: {where} has no column '{old}' (its columns: {', '.join(sorted(columns))}); "
                "map the columns it has"
            )
        if new in columns and new not in mapping:
            raise ConfigError(
                f"dataset_columns: {old} -> {new}, but {where} already has a column '{new}'; map that one too "
                "or pick another name"
            )
    if "__json__" not in table.column_names:
        return table.rename_columns(mapping)
    texts = [
        text if row is None else json.dumps({mapping.get(key, key): value for key, value in row.items()})
        for text, row in zip(table["__json__"], rows)
    ]
    return table.remove_columns("__json__").add_column("__json__", texts)


def _json_object(text: str) -> dict | None:
    """A JSON row as a dict, or ``None`` for a row the formats will report (not JSON, not an object)."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None
