"""User errors: reported as one line on stderr with a non-zero exit, never as a traceback."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Callable, TypeVar

T = TypeVar("T")
USER_ERROR_EXIT_CODE = 2
# How long a rank other than the node's first waits, after the same user error, for the launcher to stop
# it once the first rank has printed the message and exited.
OTHER_RANKS_WAIT_S = 30.0


class ConfigError(Exception):
    """Bad input the user can fix: the message names the key or file, the rule and the fix."""


def exits_cleanly_on_user_error(main: Callable[..., T]) -> Callable[..., T]:
    """Turn a `ConfigError` escaping ``main`` into ``error: <message>`` on stderr and exit code 2.

    Under ``accelerate launch``/``torchrun`` the launcher then reports the failed ranks with a traceback of its own
    (``ChildFailedError``), which nothing inside a rank can suppress; the line is also handed to the launcher
    (`tell_the_launcher`), so its report ends with it.
    """

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except ConfigError as error:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            if local_rank != 0:
                # Every rank checks the same input; the first says it once. Exiting at once here could let the
                # launcher stop the first rank before it printed (no message at all), so wait to be stopped,
                # and speak only if that never happens (the input differed on this rank).
                time.sleep(OTHER_RANKS_WAIT_S)
                line = f"error: (local rank {local_rank}) {error}"
            else:
                line = f"error: {error}"
            print(line, file=sys.stderr)
            tell_the_launcher(line)
            sys.exit(USER_ERROR_EXIT_CODE)

    return wrapper


def tell_the_launcher(line: str) -> None:
    """Write ``line`` where torch elastic (``torchrun``, ``accelerate launch``) reads a failed rank's error: its report
    of the failed ranks then ends with the line as the root cause, where it would say "To enable traceback see ...".

    The file is ``$TORCHELASTIC_ERROR_FILE``, in the JSON form torch elastic's own ``@record`` writes; without
    ``py_callstack`` the report shows the message itself. Outside such a launcher there is no file to write.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    report = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
    with open(path, "w") as file:
        json.dump(report, file)
