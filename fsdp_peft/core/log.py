"""One rank-aware logger for every status message fsdp-peft prints (``[fsdp-peft] ...``).

Levels follow the Trainer's own arguments: ``log_level`` on the main process (``passive``: info) and
``log_level_replica`` on the others (default ``warning``, so replicas stay quiet); with ``log_on_each_node``
the first process of each node counts as main, as for Trainer's logs. Status lines go to stdout in recipes and
to stderr in commands whose stdout is their product (``generate``, ``export``); warnings always go to stderr.
Program output (completions, plans,
listings) and one-line user errors (`fsdp_peft.core.errors`) are not log messages.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import TextIO

from fsdp_peft.core.distributed import ranks

logger = logging.getLogger("fsdp_peft")
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "passive": logging.INFO,
}


class _Formatter(logging.Formatter):
    """``[fsdp-peft] message`` for status; warnings stand out like the ``error:`` lines of user errors."""

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno >= logging.ERROR:
            return f"error: {record.getMessage()}"
        if record.levelno >= logging.WARNING:
            return f"warning: {record.getMessage()}"
        return f"[fsdp-peft] {record.getMessage()}"


class _Handler(logging.StreamHandler):
    """Writes to the stream current at emit time (``sys.stdout`` may be replaced, e.g. by pytest)."""

    def __init__(self, stream_name: str):
        super().__init__()
        self.stream_name = stream_name

    @property
    def stream(self) -> TextIO:
        return getattr(sys, self.stream_name)

    @stream.setter
    def stream(self, value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        self.flush()


def configure_logging(
    log_level: str = "passive", log_level_replica: str = "warning", on_each_node: bool = True, stream: str = "stdout"
) -> None:
    """Set this process's level from its rank and where messages go; safe to call again."""
    place = ranks()
    main = place.is_local_main if on_each_node else place.is_main
    logger.setLevel(LEVELS.get(str(log_level if main else log_level_replica).lower(), logging.WARNING))
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    status, alerts = _Handler(stream), _Handler("stderr")
    status.addFilter(lambda record: record.levelno < logging.WARNING)
    alerts.setLevel(logging.WARNING)
    for handler in (status, alerts):
        handler.setFormatter(_Formatter())
        logger.addHandler(handler)
    logger.propagate = False


def configure_for_training(args) -> None:
    """Levels from the run's `TrainingArguments`, messages to stdout."""
    configure_logging(args.log_level, args.log_level_replica, args.log_on_each_node, "stdout")


@contextlib.contextmanager
def loading_bars_hidden():
    """Within: no "Loading weights" bar from transformers (a second's bar drawn over a command's own lines on every
    load of a checkpoint); download and other bars stay. The previous hook is back after."""
    from transformers.utils import logging as transformers_logging  # lazy: ls/cp must not import transformers

    def hook(factory, args, kwargs):
        return factory(*args, **({**kwargs, "disable": True} if kwargs.get("desc") == "Loading weights" else kwargs))

    previous = transformers_logging.set_tqdm_hook(hook)
    try:
        yield
    finally:
        transformers_logging.set_tqdm_hook(previous)


def counted(count: int, noun: str) -> str:
    """``1 checkpoint``, ``2 checkpoints``: a count as a user reads it (``noun`` singular, plural by ``s``)."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def tell(line: str) -> None:
    """Notes and warnings, through the logger (stderr under ``fsdp-peft export``/``generate``: stdout stays
    the command's output)."""
    if line.startswith("warning: "):
        logger.warning(line.removeprefix("warning: "))
    else:
        logger.info(line.removeprefix("[fsdp-peft] "))


configure_logging()
