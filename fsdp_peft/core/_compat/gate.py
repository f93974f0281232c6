"""The gate: `check_upstream` runs when a recipe or an ``fsdp-peft`` command starts and stops it with one line when a
library is outside the releases fsdp-peft was verified with, a symbol it relies on moved or changed its signature,
or a patch's own window does not hold the installed release. It imports every patch module, so `PATCHES` is whole
when it checks."""

from __future__ import annotations

import functools
import os
import sys

from fsdp_peft.core._compat import (
    accelerate_patches,
    bitsandbytes_patches,
    peft_patches,
    torch_patches,
    transformers_patches,
    trl_patches,
)
from fsdp_peft.core._compat.registry import (
    PATCHES,
    UNVERIFIED_VARIABLE,
    UPSTREAM,
    CompatError,
    upstream_problem,
    verified_releases,
    version_problem,
)

PATCH_MODULES = (  # every module of patches, one per library
    torch_patches,
    transformers_patches,
    accelerate_patches,
    peft_patches,
    trl_patches,
    bitsandbytes_patches,
)


@functools.cache
def _checked() -> bool:
    xla_environment = "torch_xla" in verified_releases()  # its torch is torch-xla's; it never runs torch FSDP
    checked = [e for e in UPSTREAM if e.package in sys.modules or e.package != "trl"]  # trl: where imported
    problems = [upstream_problem(e) for e in checked if not (xla_environment and e.package == "torch")]
    if os.environ.get(UNVERIFIED_VARIABLE) != "1":  # lifts the release windows; the symbols are still checked
        problems = [version_problem(p) for p in verified_releases()] + problems
        patches = [p for p in PATCHES if p.package != "trl" or "trl" in sys.modules]  # trl's: where it is imported
        problems += [p.window_problem() for p in patches if not (xla_environment and p.package == "torch")]
    problems = [problem for problem in problems if problem]
    if problems:
        raise CompatError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return True


def check_upstream() -> None:
    """Stop with one line when an upstream library is not what fsdp-peft's patches were verified with."""
    _checked()
