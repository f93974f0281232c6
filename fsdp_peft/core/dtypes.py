"""One dtype vocabulary: every key and command that names a dtype takes ``float32`` or ``fp32`` (any case)."""

from __future__ import annotations

import contextlib

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_SHORT_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # accepted wherever a dtype is named


def dtype_named(text: str) -> str | None:
    """The dtype ``text`` names (``float32`` or ``fp32``, any case) as in `DTYPES`; ``None`` when it names none."""
    name = str(text).strip().lower()
    name = DTYPE_SHORT_NAMES.get(name, name)
    return name if name in DTYPES else None


def short_dtype_name(text: str) -> str | None:
    """The short name (``fp32``) of the dtype ``text`` names in either spelling; ``None`` when it names none."""
    named = dtype_named(text)
    return next((short for short, name in DTYPE_SHORT_NAMES.items() if name == named), None)


@contextlib.contextmanager
def trainable_dtypes_kept(model):
    """Inside, anything may recast ``model``'s trainable parameters (peft loading an adapter, TRL's trainers casting
    adapters to bf16); on leaving, each parameter trainable on entering gets back the dtype it had."""
    dtypes = {name: parameter.dtype for name, parameter in model.named_parameters() if parameter.requires_grad}
    yield
    for name, parameter in model.named_parameters():
        if name in dtypes and parameter.dtype != dtypes[name]:
            parameter.data = parameter.data.to(dtypes[name])
