"""The compiled decode step: a static KV cache of bucketed length and each new token's forward compiled.

``generate`` runs its decode steps eagerly by default: each token step launches every kernel of every layer from
Python, which on a GPU leaves rollouts at ~1 % of the memory bound (``docs/generation.md``). Here ``generate`` gets a
static KV cache (``cache_implementation="static"``) whose length is the prompt plus the new tokens rounded up to a
bucket of `CACHE_BUCKET` positions, and a ``compile_config``: transformers then runs the prompt's forward (the
prefill) eagerly and every decode step through one ``torch.compile``'d forward, captured as a CUDA graph on a GPU
(``mode="reduce-overhead"``). Transformers keeps the cache's length from call to call and only lets it grow, so a
process compiles one graph per batch size and bucket it meets: the count is reported (`graphs_compiled`).

The compiled step needs every weight whole on this rank for the whole call: a model without FSDP, or FSDP2 units all
kept gathered by `fsdp_peft.tools.generation.parameters_gathered`. Elsewhere (FSDP1 and budget-limited FSDP2, whose
weights gather in each forward; XLA, which compiles its own graphs; 4-bit layers left (not dequantized for the call:
their bitsandbytes forward breaks the graph in every layer); a model transformers cannot compile with a static cache;
a CPU without the C++ compiler inductor needs; ``generate_compiled: false``; CPUs under ``auto``) the eager decode
runs and one line says why, once per process and reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fsdp_peft.core._compat.torch_patches import fsdp2_forward_hooks_detached
from fsdp_peft.core.log import logger
from fsdp_peft.core.xla import on_xla
from fsdp_peft.model.loss import causal_lm_of

CACHE_BUCKET = 64  # static cache lengths are multiples of this: few graphs, little attention over empty slots
_SAID: set[str] = set()


@dataclass(frozen=True)
class Decoding:
    """How one ``generate`` call decodes: ``kwargs`` for ``generate`` (empty: eager), and why eager if it is."""

    kwargs: dict
    eager_because: str | None = None

    @contextlib.contextmanager
    def around_the_call(self, model, units: list) -> Iterator[None]:
        """The block ``generate`` runs in: compiled, with the forward hooks of FSDP2 ``units`` (all kept gathered by
        the caller) set aside, so the decode step is one graph instead of one per unit; and a bitsandbytes 4-bit
        model's quantizer out of transformers' sight (it refuses to compile bitsandbytes' layers, all of them
        dequantized for the call here: `eager_because` found none left)."""
        if not self.kwargs:
            yield
            return
        base = causal_lm_of(model)
        quantizer = getattr(base, "hf_quantizer", None)
        quantizer = quantizer if quantizer is not None and _bitsandbytes_4_bit(quantizer) else None
        with fsdp2_forward_hooks_detached(units):
            if quantizer is not None:
                base.hf_quantizer = None
            try:
                yield
            finally:
                if quantizer is not None:
                    base.hf_quantizer = quantizer


def decoding_for_call(model, setting: str, whole: bool, prompt_length: int, max_new_tokens: int) -> Decoding:
    """The decode step for one ``generate`` call of ``model`` over prompts ``prompt_length`` tokens long (padded):
    compiled over a static cache where `eager_because` finds nothing against it, else eager (said once per reason)."""
    reason = eager_because(model, setting, whole)
    if reason is not None:
        _say_once(f"generation decodes eagerly: {reason}")
        return Decoding({}, reason)
    length = math.ceil((prompt_length + max_new_tokens) / CACHE_BUCKET) * CACHE_BUCKET
    return Decoding(static_compiled_kwargs(length, cuda=_device_of(model).type == "cuda"))


def static_compiled_kwargs(cache_length: int, cuda: bool) -> dict:
    """``generate`` keyword arguments for a static cache of ``cache_length`` positions and a compiled decode step
    (a CUDA graph on a GPU)."""
    config = _compile_config_class()(fullgraph=False, dynamic=False, mode="reduce-overhead" if cuda else "default")
    return {
        "cache_implementation": "static",
        "max_cache_len": cache_length,
        "compile_config": config,
        "disable_compile": False,
    }


@functools.cache
def _compile_config_class() -> type:
    """transformers' ``CompileConfig`` told to compile on every device (it compiles only on accelerators unless
    ``_compile_all_devices`` is set), as a class attribute: FSDP2's root hook, casting ``generate``'s arguments for
    mixed precision, rebuilds dataclasses from their fields, which drops an instance's own attribute."""
    from transformers import CompileConfig  # lazy: generation config only where generation runs

    return dataclasses.make_dataclass(
        "EveryDeviceCompileConfig", [], bases=(CompileConfig,), namespace={"_compile_all_devices": True}
    )


def eager_because(model, setting: str, whole: bool) -> str | None:
    """Why ``model``'s decode step cannot or should not be compiled for a call (``whole``: every weight is whole
    on this rank for the call), or None."""
    if setting == "false":
        return "generate_compiled: false"
    if on_xla():
        return "on XLA the step is already a compiled graph"
    if not whole:
        return "the weights gather in every forward (FSDP1, or a gather budget below the model's size)"
    if _four_bit_layers_left(model):
        return "4-bit layers (bitsandbytes' forward breaks the graph in every layer)"
    base = causal_lm_of(model)
    quantizer = getattr(base, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable and not _bitsandbytes_4_bit(quantizer):
        return f"transformers cannot compile a model quantized by {type(quantizer).__name__}"
    if not getattr(base, "_can_compile_fullgraph", False):
        return f"transformers cannot compile {type(base).__name__} with a static cache"
    on_cpu = _device_of(model).type == "cpu"
    if setting == "auto" and on_cpu:
        return "on CPU compiling costs more than it saves in short runs (generate_compiled: true compiles here too)"
    if on_cpu and not any(shutil.which(name) for name in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")):
        return "no C++ compiler for inductor's CPU kernels (g++ or clang++ on PATH, or CXX)"
    return None


def graphs_compiled() -> int:
    """The graphs ``torch.compile`` has made in this process (dynamo's count; 0 before any)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters  # lazy: dynamo is loaded only where something compiled

    return counters["stats"]["unique_graphs"]


def say_graphs_compiled() -> None:
    """After a call given the compiled step: one line each time the process's count of compiled graphs grows
    (recompilation is visible, not silent); none compiled at all says the call decoded eagerly."""
    graphs = graphs_compiled()
    if graphs:
        _say_once(f"compiled decode step: {graphs} graphs compiled in this process")
    else:
        _say_once("generation decodes eagerly: transformers compiled no decode step (its own criteria)")


def _device_of(model) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _bitsandbytes_4_bit(quantizer) -> bool:
    return bool(getattr(getattr(quantizer, "quantization_config", None), "load_in_4bit", False))


def compiles_here(model, setting: str) -> bool:
    """Whether ``generate_compiled`` asks for the compiled step on ``model``'s device (``true``, or ``auto`` off
    CPU), before what a call finds against it: 4-bit layers are then dequantized for the call, which it needs."""
    return not on_xla() and (setting == "true" or (setting == "auto" and _device_of(model).type != "cpu"))


def _four_bit_layers_left(model) -> bool:
    """Whether ``model`` still computes with bitsandbytes 4-bit layers (none dequantized for the call)."""
    bitsandbytes = sys.modules.get("bitsandbytes")  # loaded by a 4-bit build; none to find without it
    return bitsandbytes is not None and any(isinstance(m, bitsandbytes.nn.Linear4bit) for m in model.modules())


def _say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        logger.info(line)
