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
        the caller) set aside, so the decode step is one graph instead of one per unit; and a 4-bit model's
        quantizer out of transformers' sight (it refuses to compile bitsandbytes' layers, all dequantized here)."""
        if not self.kwargs:
            yield
            return
        base = _transformers_model(model)
        quantizer = getattr(base, "hf_quantizer", None)
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
    from transformers import CompileConfig  # lazy: generation config only where generation runs

    config = CompileConfig(fullgraph=False, dynamic=False, mode="reduce-overhead" if cuda else "default")
    config._compile_all_devices = True  # transformers compiles only on accelerators unless told
    return {
        "cache_implementation": "static",
        "max_cache_len": cache_length,
        "compile_config": config,
        "disable_compile": False,
    }


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
    base = _transformers_model(model)
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
    """One line each time the process's count of compiled graphs grows: recompilation is visible, not silent."""
    _say_once(f"compiled decode step: {graphs_compiled()} graphs compiled in this process")


def _transformers_model(model):
    """The transformers model inside a PeftModel (or ``model`` itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _device_of(model) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _four_bit_layers_left(model) -> bool:
    """Whether ``model`` still computes with bitsandbytes 4-bit layers (none dequantized for the call)."""
    bitsandbytes = sys.modules.get("bitsandbytes")  # loaded by a 4-bit build; none to find without it
    return bitsandbytes is not None and any(isinstance(m, bitsandbytes.nn.Linear4bit) for m in model.modules())


def _say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        logger.info(line)
