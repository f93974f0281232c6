"""The harness tasks fsdp-peft ships (``fsdp_peft/assets/eval_tasks``) and the data they read.

``fsdp-peft eval`` indexes `EVAL_TASKS_DIR` before any ``--include-path``. Its task YAMLs read their rows
through the functions here (``custom_dataset: !function fsdp_peft.eval_tasks.tiny_reverse``), not through
``data_files``, which the harness resolves against the working directory: so they load from any directory,
with no network. The same directory works with the harness's own command:
``lm_eval --include_path $(python -c "import fsdp_peft.eval_tasks as t; print(t.EVAL_TASKS_DIR)") ...``.
"""

from __future__ import annotations

import json
from pathlib import Path

from datasets import Dataset, DatasetDict

from fsdp_peft.tiny import ASSETS, TINY_DATASET_DIR

EVAL_TASKS_DIR = ASSETS / "eval_tasks"
SHIPPED_TASKS = ("tiny_reverse_em", "tiny_reverse_ll")  # and the tag over both, ``tiny_reverse``


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tiny_reverse(**_) -> DatasetDict:
    """The embedded reversal data as the harness reads a dataset: ``train`` and ``eval`` (the recipes' held-out
    rows, in their order); keyword arguments (the harness passes its metadata) are not used."""
    return DatasetDict(
        {split: Dataset.from_list(_rows(TINY_DATASET_DIR / f"{split}.jsonl")) for split in ("train", "eval")}
    )
