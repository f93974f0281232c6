"""bitsandbytes' kernels and imports: compiling deferred, the CPU 4-bit kernel's block scales, CPU weight
repacking."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import math
import warnings
from typing import Callable

import torch

from fsdp_peft.core._compat.registry import (
    _source_of,
    patch,
    version_problem,
)

DEQUANTIZE_4BIT = "bitsandbytes::dequantize_4bit"


_CPU_DEQUANTIZATION: dict = {}  # "original": bitsandbytes' own CPU kernel, "library": the registration that replaced it


@patch(
    "bitsandbytes",
    still_needed=lambda: "support_avx512bf16_for_cpu" in _source_of("bitsandbytes.nn:Linear4bit.forward"),
)
def cpu_weight_repacking_disabled(model: torch.nn.Module) -> int:
    """Sets bitsandbytes' ``Linear4bit.support_avx512bf16_for_cpu`` to False on every 4-bit layer; returns how many.

    Why: on CPU, ``Linear4bit.forward`` in eval mode repacks ``weight.data`` in place for its AVX512-BF16
    kernel and flags the shared ``quant_state``. Under FSDP that hits the unsharded copy and every later
    forward is wrong (docs/compat.md#the-measurements).
    GPU runs never take this path. `UPSTREAM` checks that ``forward`` still reads the switch.
    Remove when: bitsandbytes repacks into a copy, not in place.
    """
    changed = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            changed += 1
    return changed


BITSANDBYTES_COMPILING_MODULE = "bitsandbytes.backends.default.ops"
BITSANDBYTES_CPU_MODULE = "bitsandbytes.backends.cpu.ops"


@contextlib.contextmanager
def torch_compile_deferred():
    """``torch.compile(fn, **options)`` inside returns a function that compiles ``fn`` with those options on its first
    call, as ``torch.compile`` itself does, but without loading the compiler (dynamo, inductor) until then."""
    compile_now = torch.compile

    def deferred(model=None, **options):
        if model is None:  # used as ``@torch.compile(**options)``
            return lambda function: deferred(function, **options)
        compiled = []

        @functools.wraps(model)
        def compiled_on_first_call(*args, **kwargs):
            if not compiled:
                compiled.append(compile_now(model, **options))
            return compiled[0](*args, **kwargs)

        return compiled_on_first_call

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = compile_now


@contextlib.contextmanager
def cpu_4bit_dequantization_fixed_after():
    """Runs the body (bitsandbytes' CPU backend registering its kernels), then fixes its 4-bit dequantization."""
    yield
    cpu_4bit_dequantization_block_aligned()


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader (every other attribute passes through), executing it inside ``around()``."""

    def __init__(self, loader, around: Callable[[], contextlib.AbstractContextManager]):
        self.loader, self.around = loader, around

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        with self.around():
            self.loader.exec_module(module)


BITSANDBYTES_IMPORTS = {  # bitsandbytes module: what its execution runs inside (fsdp_peft/__init__.py's finder)
    BITSANDBYTES_COMPILING_MODULE: torch_compile_deferred,
    BITSANDBYTES_CPU_MODULE: cpu_4bit_dequantization_fixed_after,
}


@patch(
    "bitsandbytes",
    still_needed=lambda: "torch.compile(fn" in _source_of("bitsandbytes.backends.default.ops:_try_torch_compile"),
)
def bitsandbytes_compiling_module_spec(name: str, path, target=None):
    """The import spec of a module of `BITSANDBYTES_IMPORTS` with its loader wrapped (``fsdp_peft/__init__.py`` asks
    for it as the module is imported); ``None`` (import as is) for any other module or outside the verified window.

    Why: bitsandbytes 0.50 wraps four default-backend kernels in ``torch.compile`` at import time
    (``_try_torch_compile``), which loads dynamo's tracer and inductor in every process that imports peft, even
    when those kernels never run (on GPUs the CUDA backend serves them): a sixth of a rank's imports on CPU
    (docs/compat.md#the-measurements). Compiling on the first call is what ``torch.compile`` does anyway, and
    bitsandbytes' wrapper still falls back to the eager kernel if that compile fails. The CPU backend's module is
    wrapped too, so that `cpu_4bit_dequantization_block_aligned` replaces its 4-bit dequantization as soon as it is
    registered.
    Remove when: bitsandbytes compiles its default kernels lazily (and the CPU patch is gone).
    """
    around = BITSANDBYTES_IMPORTS.get(name)
    if around is None or version_problem("bitsandbytes"):
        return None
    spec = importlib.machinery.PathFinder.find_spec(name, path, target)
    if spec is not None and spec.loader is not None:
        spec.loader = _PatchingLoader(spec.loader, around)
    return spec


def bitsandbytes_cpu_dequantize_4bit():
    """bitsandbytes' own CPU kernel of ``dequantize_4bit`` (the replaced one, once patched); called with a dispatch key
    set and the op's arguments (``A, absmax, blocksize, quant_type, shape, dtype``)."""
    if "original" in _CPU_DEQUANTIZATION:
        return _CPU_DEQUANTIZATION["original"]
    return torch.library.get_kernel(DEQUANTIZE_4BIT, "CPU")


def _misplaces_block_scales() -> bool:
    """bitsandbytes' own CPU kernel on the smallest failing shape (two rows of 96 values, blocks of 64): does the
    result differ from the same bytes dequantized in block-aligned rows? (tests/model/test_four_bit.py holds both
    against the reference decoder.) The wrong kernel is the one bitsandbytes builds for AVX512 CPUs; on another CPU
    (AVX2) it runs a kernel that is right, where the question cannot be asked here: True (still needed elsewhere)."""
    if not bitsandbytes_cpu_kernel_is_avx512():
        return True
    import bitsandbytes.functional as bnb_functional  # lazy: only QLoRA needs bitsandbytes

    weight = torch.linspace(-1, 1, 192).reshape(2, 96)
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=False)
    kernel, keys = bitsandbytes_cpu_dequantize_4bit(), torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    shaped = kernel.call_boxed(keys, packed, state.absmax, 64, "nf4", [2, 96], torch.float32)
    aligned = kernel.call_boxed(keys, packed, state.absmax, 64, "nf4", [3, 64], torch.float32)
    return not torch.equal(shaped, aligned.view(2, 96))


def bitsandbytes_cpu_kernel_is_avx512() -> bool:
    """Whether this CPU runs bitsandbytes' AVX512 4-bit kernels (it chooses by torch's CPU capability)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


@patch("bitsandbytes", still_needed=_misplaces_block_scales)
def cpu_4bit_dequantization_block_aligned() -> None:
    """Replaces bitsandbytes' CPU kernel of ``bitsandbytes::dequantize_4bit`` with one that calls it on the same values
    viewed as rows of one block each (or one row, when the blocks do not divide them) and views the result in the
    asked shape (idempotent; process-wide; CUDA and every other device keep their own kernels).

    Why: bitsandbytes 0.50's CPU kernel assigns block scales wrongly when a row of the asked shape does not start on a
    block boundary and its length is a multiple of 16 (``[128, 96]``, ``[8, 128, 96]``, ``[64, 32]`` in blocks of 64;
    one row, or one block in all, is right): every ``Linear4bit`` with such an input width and every 4-bit expert of
    such a width computed with wrong weights on CPU, nearly three times a right NF4 round trip's error
    (docs/compat.md#the-measurements). The values and their scales are right; only their pairing is not. Rows that
    are whole blocks are the case the kernel gets right, at the shaped call's speed (a single row would run on one
    thread). ``Linear4bit``'s forward and backward, bitsandbytes' no-grad ``gemm_4bit`` and ``dequantize_4bit`` all
    reach the kernel through the op, so all of them are fixed.
    Remove when: bitsandbytes' CPU kernel indexes block scales by the value's flat position (`_misplaces_block_scales`
    turns false).
    """
    if "original" in _CPU_DEQUANTIZATION:
        return
    original = torch.library.get_kernel(DEQUANTIZE_4BIT, "CPU")

    def block_aligned(keys, A, absmax, blocksize, quant_type, shape, dtype):
        count = math.prod(shape)
        rows = [count // blocksize, blocksize] if count % blocksize == 0 else [count]
        return original.call_boxed(keys, A, absmax, blocksize, quant_type, rows, dtype).view(shape)

    library = torch.library.Library("bitsandbytes", "IMPL")
    with warnings.catch_warnings():  # torch warns that a kernel is overridden: that is the point
        warnings.simplefilter("ignore")
        library.impl(DEQUANTIZE_4BIT.split("::")[1], block_aligned, "CPU", with_keyset=True, allow_override=True)
    _CPU_DEQUANTIZATION.update(original=original, library=library)
