"""The real tasks of SmolLM2-135M-Instruct (`fsdp_peft.model.real_tasks`): the splits share no question, the answers are
right by a check that does not use the program, and the harness task reads the recipes' held-out rows. (That the
shipped rows are the program's: tests/model/test_tiny.py, with every asset; the configs that train on them run in
tests/test_docs.py, as docs/real_model.md shows them.)
"""

from __future__ import annotations

import calendar
import datetime
import json
import re

import pytest

from fsdp_peft.model.real_tasks import ISO_DATES_NAME, SUMS_NAME, task_dir

MONTHS = {
    name.lower(): number
    for number in range(1, 13)
    for name in (calendar.month_name[number], calendar.month_abbr[number])
}


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _date_in_words(prompt: str) -> datetime.date:
    """The date a prompt writes in words, read by hand: a month name, a day and a four-digit year."""
    (month,) = {MONTHS[word.lower()] for word in re.findall(r"[A-Za-z]+", prompt) if word.lower() in MONTHS}
    numbers = re.findall(r"\d+", prompt.replace("ISO 8601", ""))
    (year,) = [int(n) for n in numbers if len(n) == 4]
    (day,) = [int(n) for n in numbers if len(n) <= 2]
    return datetime.date(year, month, day)


@pytest.mark.parametrize("name", [ISO_DATES_NAME, SUMS_NAME])
def test_answers_are_right_and_no_question_is_in_both_splits(name):
    train, held_out = (_rows(task_dir(name) / f"{split}.jsonl") for split in ("train", "eval"))
    assert (len(train), len(held_out)) == {ISO_DATES_NAME: (2000, 200), SUMS_NAME: (600, 200)}[name]  # as documented
    assert not {row["prompt"] for row in held_out} & {row["prompt"] for row in train}
    if name == SUMS_NAME:
        for row in train + held_out:
            a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", row["prompt"]).groups())
            assert row["completion"] == str(a + b) and 2 <= a <= 30 and 2 <= b <= 30
        return
    answers = {split: {row["completion"] for row in rows} for split, rows in (("train", train), ("eval", held_out))}
    assert not answers["train"] & answers["eval"]  # no date in both, however it is written
    for row in train + held_out:
        assert _date_in_words(row["prompt"]).isoformat() == row["completion"], row


def test_the_harness_task_reads_the_held_out_rows_in_order():
    from fsdp_peft.tools.eval_tasks import load_tasks

    held_out = _rows(task_dir(ISO_DATES_NAME) / "eval.jsonl")
    task = load_tasks(["iso_dates_em"], [], None, 1).tasks["iso_dates_em"]
    shown = [(task.doc_to_text(doc), task.doc_to_target(doc)) for doc in task.eval_docs]
    assert shown == [(row["prompt"], row["completion"]) for row in held_out]
