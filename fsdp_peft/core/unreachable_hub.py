"""How a check runs where the config may not: ``fsdp-peft validate`` on a login node or a laptop.

Kept free of heavy imports: the ``validate`` command enters the mode before it knows whether a config needs the
modules that read it (`fsdp_peft.tools.eval_tasks` imports the harness).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_OUT_OF_REACH_NOTED: contextvars.ContextVar[bool] = contextvars.ContextVar("out_of_reach_noted", default=False)


@contextlib.contextmanager
def hub_data_out_of_reach_noted() -> Iterator[None]:
    """For ``fsdp-peft validate``: inside, a harness task whose data is on the hub and cannot be reached from here
    is noted in a warning, not refused, as the model's own download is not tried there either. A launch refuses
    it, before any weights load."""
    token = _OUT_OF_REACH_NOTED.set(True)
    try:
        yield
    finally:
        _OUT_OF_REACH_NOTED.reset(token)


def out_of_reach_noted() -> bool:
    """Whether `hub_data_out_of_reach_noted` is in force."""
    return _OUT_OF_REACH_NOTED.get()
