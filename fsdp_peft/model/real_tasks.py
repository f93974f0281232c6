"""Tasks for a real model, generated from seeds: what SmolLM2-135M-Instruct (`fsdp_peft.model.smollm2`) gets wrong and a
few minutes of training on 2 CPU processes put right.

- ``iso-dates`` (SFT): write a date given in words in ISO 8601 form (``July 2, 1999`` -> ``1999-07-02``). The model
  knows months and years but answers in prose or invents the year: held-out exact match near 0. Prompts vary in how
  the date is written (``July 2, 1999``, ``2 July 1999``, ``Jul 2 1999``, ``the 2nd of July, 1999``) and in the
  wording of the request, so learning one phrasing by heart does not pass the held-out split.
- ``sums`` (GRPO, scored by ``math_answer``): the sum of two numbers from 2 to 30. The model can add, but rambles
  and is cut off, or restates the question last: a reward for the right final number teaches it to answer.

    python -m fsdp_peft.model.real_tasks --write-assets

writes ``fsdp_peft/assets/{iso_dates,sums}/{train,eval}.jsonl`` (prompt/completion rows, as any dataset directory);
reruns give identical files, and no question appears in both splits of a task.
"""

from __future__ import annotations

import argparse
import calendar
import datetime
import json
import random
from collections.abc import Callable
from pathlib import Path

ISO_DATES_NAME, SUMS_NAME = "iso-dates", "sums"  # the names a recipe's ``dataset`` gives them
ASSETS = Path(__file__).parents[1] / "assets"
FIRST_DAY, LAST_DAY = datetime.date(1900, 1, 1), datetime.date(2099, 12, 31)
SMALLEST, LARGEST = 2, 30  # the operands of ``sums``

DATE_REQUESTS = (
    "Write the date {date} in ISO 8601 form (YYYY-MM-DD).",
    "Convert {date} to YYYY-MM-DD.",
    "What is {date} in ISO 8601 format?",
    "Give {date} as an ISO date.",
)


def _ordinal(day: int) -> str:
    suffix = "th" if 11 <= day % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def date_spellings(date: datetime.date) -> tuple[str, ...]:
    """The ways a prompt writes ``date`` in words."""
    month, short = calendar.month_name[date.month], calendar.month_abbr[date.month]
    return (
        f"{month} {date.day}, {date.year}",
        f"{date.day} {month} {date.year}",
        f"{short} {date.day} {date.year}",
        f"the {_ordinal(date.day)} of {month}, {date.year}",
    )


def date_row(rng: random.Random) -> tuple[datetime.date, dict]:
    date = FIRST_DAY + datetime.timedelta(days=rng.randrange((LAST_DAY - FIRST_DAY).days + 1))
    prompt = rng.choice(DATE_REQUESTS).format(date=rng.choice(date_spellings(date)))
    return date, {"prompt": prompt, "completion": date.isoformat()}


def sum_row(rng: random.Random) -> tuple[tuple[int, int], dict]:
    a, b = rng.randint(SMALLEST, LARGEST), rng.randint(SMALLEST, LARGEST)
    return (a, b), {"prompt": f"What is {a} + {b}?", "completion": str(a + b)}


TASKS: dict[str, Callable[[random.Random], tuple[object, dict]]] = {ISO_DATES_NAME: date_row, SUMS_NAME: sum_row}
SEEDS = {ISO_DATES_NAME: 2026, SUMS_NAME: 2027}
ROWS = {ISO_DATES_NAME: (2000, 200), SUMS_NAME: (600, 200)}  # train, eval: sums has 29 x 29 questions


def task_dir(name: str) -> Path:
    """Where task ``name``'s rows ship."""
    return ASSETS / name.replace("-", "_")


def make_rows(name: str, rng: random.Random, count: int, exclude: set) -> list[dict]:
    """``count`` rows of task ``name`` whose question is not in ``exclude`` (each is added to it)."""
    rows = []
    while len(rows) < count:
        key, row = TASKS[name](rng)
        if key not in exclude:
            exclude.add(key)
            rows.append(row)
    return rows


def write_splits(directory: Path, splits: dict[str, list[dict]]) -> None:
    """``<directory>/<split>.jsonl`` for each split: one JSON row a line, as a dataset directory holds them."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        with open(directory / f"{split}.jsonl", "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)


def write_assets(assets: Path = ASSETS) -> None:
    """Write both splits of every task from its seed.

    Also part of ``python -m fsdp_peft.model.tiny --write-assets``."""
    for name in TASKS:
        rng, seen = random.Random(SEEDS[name]), set()
        counts = dict(zip(("train", "eval"), ROWS[name]))
        write_splits(
            assets / task_dir(name).name, {split: make_rows(name, rng, n, seen) for split, n in counts.items()}
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-assets", action="store_true", required=True, help=f"rewrite the tasks in {ASSETS}")
    parser.parse_args()
    write_assets()
    print(f"wrote {', '.join(str(task_dir(name)) for name in TASKS)}")


if __name__ == "__main__":
    main()
