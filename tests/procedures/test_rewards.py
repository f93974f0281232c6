"""GRPO's reward functions: the built-in ones, and the check that refuses a bad one before any weights load."""

from __future__ import annotations

import pytest

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.procedures.rewards import (
    check_reward_funcs,
    exact_answer,
    final_number,
    math_answer,
    math_format,
    resolve_reward_funcs,
)

ROWS = [{"prompt": "reverse: abcde", "answer": "edcba"}, {"prompt": "reverse: fghij", "answer": "jihgf"}]
CHAT_ROWS = [{"prompt": [{"role": "user", "content": row["prompt"]}], "answer": row["answer"]} for row in ROWS]
IDS = [[1, 2, 3], [4, 5, 6]]


def test_exact_answer_reads_strings_and_chat_completions():
    assert exact_answer(["edcba ", "edcbb"], answer=["edcba", "edcba"]) == [1.0, 0.0]
    chat = [[{"role": "assistant", "content": "edcba"}], [{"role": "assistant", "content": "x"}]]
    assert exact_answer(chat, answer=["edcba", "edcba"]) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("She pays 3 * 4 = 12 dollars.\n#### 12", "12"),
        ("so the total is \\boxed{1,000}", "1000"),
        ("first 7, then 8, so 15.0", "15"),
        ("#### -3.5 and later 9", "-3.5"),
        ("no number here", None),
    ],
)
def test_the_final_number_of_a_solution(text, number):
    assert final_number(text) == number


def test_math_answer_and_format_rewards():
    completions = ["2 + 3 = 5\n#### 5", "the answer is 6", "#### 1,000"]
    answers = ["Add them. #### 5", "#### 5", "#### 1000"]
    assert math_answer(completions, answer=answers) == [1.0, 0.0, 1.0]
    assert math_format(completions) == [1.0, 0.0, 1.0]


def test_built_in_and_user_functions_resolve_and_pass_the_check(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(completions, **kwargs):\n    return [1.0 / (1 + len(str(c))) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ["exact_answer", "my_rewards:brevity"]
    functions = resolve_reward_funcs(names)
    assert functions[0] is exact_answer and functions[1].__name__ == "brevity"
    for rows in (ROWS, CHAT_ROWS):
        check_reward_funcs(functions, names, rows, IDS)


USER_MODULE = """
import numpy
def wrong_count(completions, **kwargs):
    return [1.0]
def raises(completions, answer, **kwargs):
    return [float(a) for a in answer]
def no_kwargs(completions):
    return [0.0] * len(completions)
def text(completions, **kwargs):
    return "good"
def nan(completions, **kwargs):
    return [float("nan")] * len(completions)
def arrays(completions, **kwargs):
    return numpy.zeros(len(completions))
NOT_A_FUNCTION = 3
"""


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module:f", "reward_funcs: no_such_module:f: cannot import no_such_module (ModuleNotFoundError: "),
        ("bad_rewards:missing", "reward_funcs: bad_rewards:missing: bad_rewards has no 'missing'"),
        ("bad_rewards:NOT_A_FUNCTION", "reward_funcs: bad_rewards:NOT_A_FUNCTION: int is not callable"),
        ("exact", "reward_funcs: 'exact' is neither a built-in reward (exact_answer, math_answer, math_format)"),
        ("bad_rewards:wrong_count", "reward_funcs: bad_rewards:wrong_count: returned 1 values for 2 completions"),
        ("bad_rewards:raises", "reward_funcs: bad_rewards:raises: raised ValueError (could not convert string"),
        ("bad_rewards:no_kwargs", "reward_funcs: bad_rewards:no_kwargs: does not take TRL's arguments"),
        ("bad_rewards:text", "reward_funcs: bad_rewards:text: returned str; return one float per completion"),
        ("bad_rewards:nan", "reward_funcs: bad_rewards:nan: returned NaN; return None for a completion"),
    ],
)
def test_a_bad_reward_function_is_refused_in_one_line(name, message, tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as error:
        check_reward_funcs(resolve_reward_funcs([name]), [name], ROWS, IDS)
    assert "\n" not in str(error.value) and str(error.value).startswith(message), str(error.value)


def test_numpy_rewards_and_an_empty_list(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    check_reward_funcs(resolve_reward_funcs(["bad_rewards:arrays"]), ["bad_rewards:arrays"], ROWS, IDS)
    with pytest.raises(ConfigError, match="reward_funcs: empty; name at least one reward function"):
        resolve_reward_funcs([])
