"""GRPO's reward functions: the built-in ones, the user's own named in the YAML, and the check before any weights load.

A recipe YAML names them in ``reward_funcs`` (with ``reward_weights``, one each, default 1.0):

- a built-in name: ``exact_answer`` (the completion equals the row's ``answer``; the embedded reversal task),
  ``math_answer`` (the final number of the completion equals the answer's: GSM8K's ``#### 72``, ``\\boxed{72}``,
  else the last number), ``math_format`` (the completion states its final answer as ``#### <number>``);
- or the user's own function as ``module:function`` (a module importable from the launch directory or the
  Python path, for example ``my_rewards:brevity``).

TRL calls each one as ``f(prompts=..., completions=..., completion_ids=..., **columns)``, where ``columns`` are the
dataset's other columns (``answer`` among them) as lists aligned with the rows, plus ``trainer_state``,
``log_extra`` and ``log_metric``; it returns one float per row (``None``: not applicable to that row). A
completion is a string, or for chat prompts a one-message list ``[{"role": "assistant", "content": ...}]``.

`resolve_reward_funcs` imports them and `check_reward_funcs` calls each one on the first training rows, with
their answers as completions, before any weights load: a function that cannot be imported, is not callable,
does not take those arguments, raises, or returns the wrong number of values stops the run with one line.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
import sys
from pathlib import Path
from typing import Callable, Sequence

from fsdp_peft.core.errors import ConfigError

TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
CHECK_ROWS = 2  # training rows each reward function is tried on before any weights load
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"


def completion_text(completion) -> str:
    """The text of one completion as TRL hands it over: a string, or a one-message chat list."""
    if isinstance(completion, list):
        return "".join(str(message.get("content", "")) for message in completion if isinstance(message, dict))
    return str(completion)


def exact_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion, stripped, equals the row's ``answer``; else 0.0."""
    return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def final_number(text: str) -> str | None:
    """The final answer of a math solution: after ``####``, else in the last ``\\boxed{}``, else the last number;
    commas dropped and a trailing ``.0`` removed, so ``1,000.0`` and ``1000`` compare equal."""
    for pattern in (rf"####\s*\$?({_NUMBER})", rf"\\boxed\{{\s*\$?({_NUMBER})\s*\}}"):
        if found := re.findall(pattern, text):
            return _canonical(found[-1])
    numbers = re.findall(_NUMBER, text)
    return _canonical(numbers[-1]) if numbers else None


def _canonical(number: str) -> str:
    number = number.replace(",", "")
    return number[: -len(".0")] if number.endswith(".0") else number


def math_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion's final number equals the answer's (`final_number` of each); else 0.0."""
    rewards = []
    for completion, expected in zip(completions, answer):
        got, wanted = final_number(completion_text(completion)), final_number(str(expected))
        rewards.append(float(got is not None and got == wanted))
    return rewards


def math_format(completions, **kwargs) -> list[float]:
    """1.0 where the completion ends its reasoning with ``#### <number>``, the format the answer is read from."""
    return [float(re.search(rf"####\s*\$?{_NUMBER}\s*$", completion_text(c).strip()) is not None) for c in completions]


BUILT_IN: dict[str, Callable] = {"exact_answer": exact_answer, "math_answer": math_answer, "math_format": math_format}


def resolve_reward_funcs(names: Sequence[str], key: str = "reward_funcs") -> list[Callable]:
    """The functions ``names`` name: built-in names, or ``module:function`` imported as the launch would."""
    if not names:
        raise ConfigError(f"{key}: empty; name at least one reward function ({', '.join(BUILT_IN)} or module:function)")
    return [_resolve(str(name), key) for name in names]


def _resolve(name: str, key: str) -> Callable:
    if name in BUILT_IN:
        return BUILT_IN[name]
    module_name, colon, attribute = name.partition(":")
    if not colon or not module_name or not attribute:
        raise ConfigError(
            f"{key}: {name!r} is neither a built-in reward ({', '.join(BUILT_IN)}) nor module:function "
            "(for example my_rewards:brevity)"
        )
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # a module beside the launch, as `python recipes/x.py` users expect
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # any failure of the user's module at import: one line, not a traceback
        raise ConfigError(
            f"{key}: {name}: cannot import {module_name} ({type(error).__name__}: {_first_line(error)}); "
            "put the module on the Python path or beside where you launch"
        ) from None
    function = getattr(module, attribute, None)
    if function is None:
        raise ConfigError(f"{key}: {name}: {module_name} has no {attribute!r}")
    if not callable(function):
        raise ConfigError(f"{key}: {name}: {type(function).__name__} is not callable; name a function")
    return function


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else ""


def reward_name(function: Callable) -> str:
    """How the logs and ``results.json`` name a reward function (TRL's name for it)."""
    return getattr(function, "__name__", type(function).__name__)


def reward_arguments(rows: list[dict], completions: list, completion_ids: list[list[int]]) -> dict:
    """The keyword arguments TRL calls a reward function with, for ``rows`` (``prompt`` and the dataset's other
    columns) and their completions; outside a trainer, ``trainer_state`` is ``None`` and the log hooks do nothing."""
    columns = {column: [row[column] for row in rows] for column in rows[0] if column not in ("prompt", "completion")}
    return {
        "prompts": [row["prompt"] for row in rows],
        "completions": completions,
        "completion_ids": completion_ids,
        "trainer_state": None,
        "log_extra": lambda *args, **kwargs: None,
        "log_metric": lambda *args, **kwargs: None,
        **columns,
    }


def check_reward_funcs(
    functions: Sequence[Callable], names: Sequence[str], rows: list[dict], completion_ids: list[list[int]]
) -> None:
    """Call each reward function as TRL will, on ``rows`` (the first training rows: ``prompt`` and the other
    columns) with their answers as completions; one `ConfigError` line for the first one that fails."""
    completions = [_as_completion(row["prompt"], row.get("answer", "")) for row in rows]
    arguments = reward_arguments(rows, completions, completion_ids)
    columns = [key for key in arguments if key not in TRL_KEYWORDS]
    for function, name in zip(functions, names):
        where = f"reward_funcs: {name}"
        try:
            inspect.signature(function).bind(**arguments)
        except TypeError as error:
            raise ConfigError(
                f"{where}: does not take TRL's arguments ({error}); define it as "
                f"def {reward_name(function)}(completions, **kwargs) and read {', '.join(sorted(columns))} from kwargs"
            ) from None
        except ValueError:
            pass  # no signature to read (a builtin or C function): the call below decides
        try:
            rewards = function(**arguments)
        except Exception as error:  # the user's function failing on real rows: one line, not a traceback
            raise ConfigError(
                f"{where}: raised {type(error).__name__} ({_first_line(error)}) on the first {len(rows)} training rows"
            ) from None
        _check_values(rewards, len(rows), where)


def _as_completion(prompt, answer):
    """The answer as TRL would hand it over as a completion: a one-message chat list for chat prompts."""
    return [{"role": "assistant", "content": str(answer)}] if isinstance(prompt, list) else str(answer)


def _check_values(rewards, count: int, where: str) -> None:
    if isinstance(rewards, (str, bytes)) or not isinstance(rewards, Sequence) and not hasattr(rewards, "tolist"):
        raise ConfigError(f"{where}: returned {type(rewards).__name__}; return one float per completion (a list)")
    values = rewards.tolist() if hasattr(rewards, "tolist") else list(rewards)
    if len(values) != count:
        raise ConfigError(f"{where}: returned {len(values)} values for {count} completions; return one per completion")
    for value in values:
        if value is not None and not isinstance(value, numbers.Real):
            raise ConfigError(f"{where}: returned {value!r}; each value must be a number (or None: not applicable)")
        if isinstance(value, float) and math.isnan(value):
            raise ConfigError(f"{where}: returned NaN; return None for a completion the reward does not apply to")
