"""Directories that appear only when complete: written beside their target, then renamed into place."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def publish_directory(target: Path, replace: bool = False) -> Iterator[Path]:
    """Yield a staging directory next to ``target``; on success rename it to ``target``.

    A crash or exception leaves no ``target`` behind (only a hidden staging directory that is removed
    when the exception unwinds). With ``replace`` an existing ``target`` is swapped out; without it, a
    ``target`` created meanwhile by another process wins and the staging copy is dropped.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial.", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)
    try:
        yield staging
        if replace and target.exists():
            shutil.rmtree(target)
        try:
            os.rename(staging, target)
        except OSError:
            if replace or not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
