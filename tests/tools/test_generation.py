"""Generation from the sharded model: FSDP2 units gathered once per call within a budget, same tokens."""

from __future__ import annotations

import pytest

from conftest import REPO, last_json_line, torchrun

CHECK = REPO / "tests" / "distributed" / "generation_check.py"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def report(tiny_model_dir):
    return last_json_line(torchrun(CHECK).stdout)


def test_every_budget_generates_the_unsharded_tokens(report):
    assert {"all", "none"} < set(report["budgets"]) and len(report["reference"]) > 0  # and one budget in bytes
    for budget, run in report["budgets"].items():
        assert run["completions"] == report["reference"], budget


def test_budget_all_gathers_each_unit_once_per_call_and_none_once_per_token(report):
    runs, units = report["budgets"], report["units"]
    assert units == 5  # 4 decoder layers and the root
    assert runs["all"]["all_gathers"] == units
    assert runs["none"]["all_gathers"] >= NEW_TOKENS * (units - 1)
    partial = next(run for budget, run in runs.items() if budget.endswith("B"))  # root + 2 layers fit
    assert runs["all"]["all_gathers"] < partial["all_gathers"] < runs["none"]["all_gathers"]


def test_training_after_generation_reshards_as_before(report):
    before, after = report["training_step_all_gathers"]
    assert after == before > 0


def test_ranks_agree_on_the_smallest_budget(report):
    assert report["agreed_budget"] == 12345  # rank 0 asked for all, rank 1 for 12345 bytes
