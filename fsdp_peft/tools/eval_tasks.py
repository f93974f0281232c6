"""Which harness tasks run: the ones fsdp-peft ships and the data they read, and any named ones, loaded and
checked before a model loads (``fsdp-peft eval --tasks``, a recipe's ``eval_tasks``).

The shipped tasks are in `EVAL_TASKS_DIR` (``fsdp_peft/harness_tasks``), indexed before any ``--include-path``.
Their YAMLs read their rows through the functions here (``custom_dataset: !function
fsdp_peft.tools.eval_tasks.tiny_reverse``), not through ``data_files``, which the harness resolves against the working
directory: so they load from any directory, with no network. The same directory works with the harness's own
command: ``lm_eval --include_path $(python -c "import fsdp_peft.tools.eval_tasks as t; print(t.EVAL_TASKS_DIR)") ...``.

`load_tasks` finds and loads named tasks and refuses, in one line, what would otherwise fail after the weights
loaded (`fsdp_peft.tools.evaluation` runs them); it needs no model, so `fsdp_peft.tools.validation` checks a recipe's
``eval_tasks`` with it.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import lm_eval.tasks
import yaml
from datasets import Dataset, DatasetDict
from lm_eval.api.task import Task
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import logger
from fsdp_peft.core.unreachable_hub import out_of_reach_noted
from fsdp_peft.model.real_tasks import ISO_DATES_NAME, task_dir
from fsdp_peft.model.tiny import TINY_DATASET_DIR

EVAL_TASKS_DIR = Path(__file__).parents[1] / "harness_tasks"  # written by hand, beside the generated assets
SHIPPED_TASKS = (
    "tiny_reverse_em",
    "tiny_reverse_ll",
    "iso_dates_em",
)  # and the tag ``tiny_reverse`` over the first two
EVAL_TASKS_KEY = "eval_tasks"  # the recipe key: harness tasks at the end of training
GENERATION_KWARGS = {  # what HarnessLM follows: stop strings, length (under each of the harness's names), sampling
    "until",
    "max_gen_toks",
    "max_new_tokens",
    "max_tokens",
    "max_completion_tokens",
    "do_sample",
    "temperature",
    "top_p",
}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _splits(directory: Path) -> DatasetDict:
    return DatasetDict({split: Dataset.from_list(_rows(directory / f"{split}.jsonl")) for split in ("train", "eval")})


def tiny_reverse(**_) -> DatasetDict:
    """The embedded reversal data as the harness reads a dataset: ``train`` and ``eval`` (the recipes' held-out
    rows, in their order); keyword arguments (the harness passes its metadata) are not used."""
    return _splits(TINY_DATASET_DIR)


def iso_dates(**_) -> DatasetDict:
    """SmolLM2's real task (`fsdp_peft.model.real_tasks`), read as `tiny_reverse` reads its data."""
    return _splits(task_dir(ISO_DATES_NAME))


@dataclass
class HarnessTasks:
    """Tasks loaded with their data and checked (before any weights load): what `evaluate_tasks` runs."""

    manager: TaskManager
    items: list  # the Task and Group objects, as named on the command line or in eval_tasks
    tasks: dict[str, Task]  # every task to run, by name (a group's and a tag's expanded)


def load_tasks(
    specs: list[str], include_paths: list[Path], limit: int | None, world_size: int, key: str = "--tasks"
) -> HarnessTasks:
    """The named tasks (shipped, from ``include_paths``, YAML paths, else the harness's built-in ones) with their
    data, each checked: known, loadable, its first document renders, at least one document for every rank.
    ``key`` is where the names came from (``--tasks``, or the recipe's ``eval_tasks``), for the messages."""
    if not specs:
        raise ConfigError(f"{key}: no task named; e.g. tiny_reverse_em (the shipped tasks: tag tiny_reverse)")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit: must be 1 or more documents per task, got {limit}")
    include = [EVAL_TASKS_DIR, *(_include_dir(Path(path)) for path in include_paths)]
    quiet_harness_logging()
    manager = _task_manager(tuple(include), with_harness_tasks=False)
    for spec in specs:
        if not spec.strip():
            raise ConfigError(f"{key}: an empty task name; name a harness task, group or tag, or a task YAML file")
        if _is_yaml_path(spec) and not Path(spec).is_file():
            raise ConfigError(f"{key}: {spec}: file not found (a task YAML file)")
    if any(not _known(manager, spec) for spec in specs):  # the harness's own ~15k tasks: indexed only when needed
        manager, narrowed = _harness_task_manager(tuple(include), tuple(specs))
        try:
            return _loaded(manager, specs, include, limit, world_size, key)
        except ConfigError:
            if not narrowed:
                raise
            manager = _task_manager(tuple(include), with_harness_tasks=True)  # a group with members elsewhere
    return _loaded(manager, specs, include, limit, world_size, key)


def _loaded(manager: TaskManager, specs, include, limit, world_size, key) -> HarnessTasks:
    items, tasks = [], {}
    for spec in specs:
        if not _known(manager, spec):
            raise ConfigError(_unknown_task(manager, spec, include, key))
        loaded = _load_one(manager, spec, key)
        if loaded is None:  # its hub data out of reach here, under `hub_data_out_of_reach_noted`
            continue
        children = {child for names in loaded.get("group_map", {}).values() for child in names}
        items += [group for name, group in loaded.get("groups", {}).items() if name not in children]
        items += [task for name, task in loaded["tasks"].items() if name not in children]
        tasks.update(loaded["tasks"])
    for name, task in tasks.items():
        _check_task(name, task, limit, world_size, key)
    return HarnessTasks(manager, items, tasks)


def _task_manager(include: tuple[Path, ...], with_harness_tasks: bool) -> TaskManager:
    """The harness's index of the task YAMLs in ``include`` (and of its own ~15k tasks: about 9 s). The index of
    package directories alone (the shipped tasks, the harness's) is built once per process: a user's directories
    are read again at every call, as they may have changed."""
    if include == (EVAL_TASKS_DIR,):
        return _package_task_manager(with_harness_tasks)
    return TaskManager(include_path=[str(path) for path in include], include_defaults=with_harness_tasks)


def _harness_task_manager(include: tuple[Path, ...], specs: tuple[str, ...]) -> tuple[TaskManager, bool]:
    """The index with the harness's own tasks, and whether it is narrowed: first of only its task directories whose
    YAML files name one of ``specs`` (a text search, where its whole index of ~15k tasks takes seconds), the whole of
    it when that does not know every name."""
    root = Path(lm_eval.tasks.__file__).parent
    names = [re.compile(rf"(?<![\w-]){re.escape(spec)}(?![\w-])") for spec in specs if not _is_yaml_path(spec)]
    directories = {
        root / file.relative_to(root).parts[0]
        for file in root.rglob("*.yaml")
        if any(name.search(file.read_text(errors="ignore")) for name in names)
    }
    narrowed = TaskManager(include_path=[*map(str, sorted(directories)), *map(str, include)], include_defaults=False)
    if all(_known(narrowed, spec) for spec in specs):
        return narrowed, True
    return _task_manager(include, with_harness_tasks=True), False


@functools.cache
def _package_task_manager(with_harness_tasks: bool) -> TaskManager:
    return TaskManager(include_path=[str(EVAL_TASKS_DIR)], include_defaults=with_harness_tasks)


def _include_dir(path: Path) -> Path:
    """An ``--include-path`` directory, every YAML in it parsed: the harness's index would skip a broken one
    silently, and the task would then read as unknown."""
    if not path.is_dir():
        raise ConfigError(f"--include-path: {path} is not a directory (of harness task YAML files)")
    files = sorted(path.rglob("*.yaml"))
    if not files:
        raise ConfigError(f"--include-path: {path} holds no *.yaml task files")
    for file in files:
        try:
            load_yaml(file, resolve_func=False, recursive=False)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f"{file}:{mark.line + 1}" if mark else str(file)
            raise ConfigError(f"--include-path: {where}: not valid YAML ({getattr(error, 'problem', error)})") from None
    return path


def _is_yaml_path(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml"))


def _known(manager: TaskManager, spec: str) -> bool:
    return spec in manager.all_tasks or (_is_yaml_path(spec) and Path(spec).is_file())


def _unknown_task(manager: TaskManager, spec: str, include: list[Path], key: str) -> str:
    close = difflib.get_close_matches(spec, manager.all_tasks, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    if key == "--tasks":
        where = f"--include-path directories: {', '.join(str(path) for path in include[1:]) or 'none'}"
    else:
        where = "name your own tasks by their YAML file path"
    return (
        f"{key}: {spec}: no harness task, group or tag of that name{hint}; fsdp-peft ships "
        f"{', '.join(SHIPPED_TASKS)} (tag tiny_reverse); {where}"
    )


def _load_one(manager: TaskManager, spec: str, key: str) -> dict | None:
    """``manager.load([spec])``; a task whose data does not load (no network, a missing file) is a `ConfigError`,
    except data on the hub out of reach under `hub_data_out_of_reach_noted` (a warning, and ``None``)."""
    try:
        with _from_the_cache_only() if out_of_reach_noted() else contextlib.nullcontext():
            return manager.load([spec])
    except ConfigError:
        raise
    except Exception as error:  # the harness raises whatever the dataset library or the YAML raised
        entry = manager.task_index.get(spec)
        dataset = (entry.cfg or {}).get("dataset_path") if entry else None
        what = f"its dataset {dataset}" if dataset else "its data"
        if out_of_reach_noted() and _out_of_reach(error):
            logger.warning(
                f"{key}: {spec}: {what} is out of reach from here ({type(error).__name__}: {_first_line(error)}); "
                "not checked: a launch loads it before any weights, and stops there if it cannot"
            )
            return None
        raise ConfigError(
            f"{key}: {spec}: {what} could not be loaded ({type(error).__name__}: {_first_line(error)}); "
            "without network, give the task local data (custom_dataset, or dataset_kwargs.data_files with an "
            "absolute path) or fill the Hugging Face cache first (HF_DATASETS_OFFLINE=1 then reads it)"
        ) from None


@contextlib.contextmanager
def _from_the_cache_only():
    """The hub in offline mode: ``fsdp-peft validate`` reads a task's data from the cache and notes what is not there
    at once, where a machine without network would spend half a minute on the hub client's retries."""
    import datasets.config  # lazy: ls/cp must not import the hub libraries
    import huggingface_hub.constants  # lazy: ls/cp must not import the hub libraries

    saved = huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    huggingface_hub.constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def _out_of_reach(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) is a failed connection or offline mode: ``ConnectionError``,
    which the datasets library raises for both and huggingface_hub's ``OfflineModeIsEnabled`` subclasses."""
    while error is not None:
        if isinstance(error, ConnectionError):
            return True
        error = error.__cause__ or error.__context__
    return False


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or repr(error)
    return text.splitlines()[0]


def _check_task(name: str, task: Task, limit: int | None, world_size: int, key: str) -> None:
    """What would otherwise fail mid-evaluation, after the weights loaded: no documents for a rank (the harness
    raises on the empty rank), a document that does not render, generation settings `HarnessLM` cannot follow, and
    a task with images or audio (`HarnessLM` reads text)."""
    if getattr(task, "MULTIMODAL", False):
        raise ConfigError(
            f"{key}: {name} is a multimodal task (its documents carry images or audio); fsdp-peft eval runs text "
            "tasks only, on vision-language models too: score images with the recipe's held-out answers "
            "(docs/vision.md)"
        )
    try:
        docs = task.eval_docs
        count = len(docs)
        if count:
            task.doc_to_text(docs[0])
            task.doc_to_target(docs[0])
    except Exception as error:  # jinja's UndefinedError for a missing column, the harness's own errors
        raise ConfigError(
            f"{key}: {name}: its first document does not render ({type(error).__name__}: {_first_line(error)}); "
            "check the task's doc_to_text/doc_to_target against its dataset's columns"
        ) from None
    used = count if limit is None else min(limit, count)
    if used < world_size:
        raise ConfigError(
            f"{key}: {name}: {used} document{'s' if used != 1 else ''}"
            f"{f' (--limit {limit})' if limit is not None else ''} for {world_size} ranks; the harness deals the "
            f"documents out to the ranks in turn and fails on a rank that gets none: evaluate at least {world_size} "
            "documents, or launch fewer processes"
        )
    if task.get_config("output_type") == "generate_until":
        unknown = sorted(set(task.get_config("generation_kwargs") or {}) - GENERATION_KWARGS)
        if unknown:
            raise ConfigError(
                f"{key}: {name}: generation_kwargs {unknown} are not supported by fsdp-peft eval (it follows "
                f"{', '.join(sorted(GENERATION_KWARGS))}); remove them from the task's YAML"
            )


def eval_tasks_problem(specs: list[str], world_size: int) -> str | None:
    """A recipe's ``eval_tasks`` checked as `load_tasks` checks ``--tasks`` (their data loaded): the problem, or
    ``None``. Run before training, so that a task that cannot run never costs a training run."""
    try:
        load_tasks(list(specs), [], None, world_size, key=EVAL_TASKS_KEY)
    except ConfigError as error:
        return str(error)
    return None


def quiet_harness_logging() -> None:
    """Keep the harness's per-task notice about custom datasets' keyword arguments (every shipped task has a
    custom dataset, and takes none) off the output."""
    task_logger = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _CustomDatasetNotice) for f in task_logger.filters):
        task_logger.addFilter(_CustomDatasetNotice())


class _CustomDatasetNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()
