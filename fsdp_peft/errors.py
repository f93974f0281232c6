"""User errors: reported as one line on stderr with a non-zero exit, never as a traceback."""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, TypeVar

T = TypeVar("T")
USER_ERROR_EXIT_CODE = 2


class ConfigError(Exception):
    """Bad input the user can fix: the message names the key or file, the rule and the fix."""


def exits_cleanly_on_user_error(main: Callable[..., T]) -> Callable[..., T]:
    """Turn a `ConfigError` escaping ``main`` into ``error: <message>`` on stderr and exit code 2.

    Under ``accelerate launch``/``torchrun`` the launcher then reports the failed ranks with a
    traceback of its own (``ChildFailedError``); the ``error:`` line above it is the message to read.
    """

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except ConfigError as error:
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # every rank checks the same input: say it once
                print(f"error: {error}", file=sys.stderr)
            sys.exit(USER_ERROR_EXIT_CODE)

    return wrapper
