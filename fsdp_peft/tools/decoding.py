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

On a CPU with more than one thread, each plain linear layer of the compiled call may compute ``(W xᵀ)ᵀ`` in place of
``x Wᵀ`` (`WeightFirstLinear`): the same products in one matmul, which MKL spreads over the threads better at a decode
step's few rows (measured on 2 cores at 16 rows: 1.25x the layers of SmolLM2, 1.8x its output layer). Each layer
shape is timed both ways once per process and number of rows (`weight_first_is_faster`), and swapped only where that
orientation wins by `ORIENTATION_MARGIN`. GPUs and one-thread CPUs keep the layers as they are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule

from fsdp_peft.core._compat.torch_patches import fsdp2_forward_hooks_detached
from fsdp_peft.core.log import logger
from fsdp_peft.core.xla import on_xla
from fsdp_peft.model.loss import causal_lm_of

CACHE_BUCKET = 64  # static cache lengths are multiples of this: few graphs, little attention over empty slots
ORIENTATION_MARGIN = 1.1  # a layer computes (W xᵀ)ᵀ only where that is at least this much faster than x Wᵀ
_SAID: set[str] = set()
_ORIENTATION: dict[tuple, bool] = {}  # (weight shape, dtype, rows, threads): whether (W xᵀ)ᵀ is the faster


@dataclass(frozen=True)
class Decoding:
    """How one ``generate`` call decodes: ``kwargs`` for ``generate`` (empty: eager), and why eager if it is."""

    kwargs: dict
    eager_because: str | None = None
    rows: int = 1  # the prompts decoded together: a token step's rows

    @contextlib.contextmanager
    def around_the_call(self, model, units: list) -> Iterator[None]:
        """The block ``generate`` runs in: compiled, with the forward hooks of FSDP2 ``units`` (all kept gathered by
        the caller) set aside, so the decode step is one graph instead of one per unit; a bitsandbytes 4-bit
        model's quantizer out of transformers' sight (it refuses to compile bitsandbytes' layers, all of them
        dequantized for the call here: `eager_because` found none left); on a CPU, linear layers faster as
        `WeightFirstLinear` at the call's rows in its place (`weight_first_layers`)."""
        if not self.kwargs:
            yield
            return
        base = causal_lm_of(model)
        quantizer = getattr(base, "hf_quantizer", None)
        quantizer = quantizer if quantizer is not None and _bitsandbytes_4_bit(quantizer) else None
        with fsdp2_forward_hooks_detached(units), weight_first_layers(model, self.rows):
            if quantizer is not None:
                base.hf_quantizer = None
            try:
                yield
            finally:
                if quantizer is not None:
                    base.hf_quantizer = quantizer


def decoding_for_call(
    model, setting: str, whole: bool, prompt_length: int, max_new_tokens: int, rows: int = 1
) -> Decoding:
    """The decode step for one ``generate`` call of ``model`` over ``rows`` prompts ``prompt_length`` tokens long
    (padded): compiled over a static cache where `eager_because` finds nothing against it, else eager (said once per
    reason)."""
    reason = eager_because(model, setting, whole)
    if reason is not None:
        _say_once(f"generation decodes eagerly: {reason}")
        return Decoding({}, reason)
    length = math.ceil((prompt_length + max_new_tokens) / CACHE_BUCKET) * CACHE_BUCKET
    return Decoding(static_compiled_kwargs(length, cuda=_device_of(model).type == "cuda"), rows=rows)


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


class WeightFirstLinear(torch.nn.Module):
    """Stands in for plain linear layer ``linear`` for a call (`weight_first_layers`): ``(W xᵀ)ᵀ`` instead of
    ``x Wᵀ``, the output a transposed view. Reads ``linear``'s weight and bias at each forward (not its own
    parameters: the module tree's parameters stay where they are). A compiled step guards on the layers' types and
    weights, not on these objects: a new stand-in each call compiles nothing new."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.of = (linear,)  # a tuple, not a child module
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.of[0]
        y = torch.mm(linear.weight, x.reshape(-1, self.in_features).T).T
        if linear.bias is not None:
            y = y + linear.bias
        return y.reshape(*x.shape[:-1], self.out_features)


@contextlib.contextmanager
def weight_first_layers(model: torch.nn.Module, rows: int) -> Iterator[int]:
    """On a CPU with more than one thread, each plain linear layer of ``model`` (not an FSDP unit itself) whose shape
    multiplies faster as ``(W xᵀ)ᵀ`` at ``rows`` rows (`weight_first_is_faster`) replaced by its `WeightFirstLinear`
    for the block; yields how many. The layers are back at exit. Elsewhere nothing changes."""
    if _device_of(model).type != "cpu" or torch.get_num_threads() < 2 or on_xla():
        yield 0
        return
    swapped = []
    try:
        for parent, name, layer in child_slots(model):
            if type(layer).forward is not torch.nn.Linear.forward or isinstance(layer, FSDPModule):
                continue
            if not weight_first_is_faster(layer.weight.detach(), rows):
                continue
            parent.register_module(name, WeightFirstLinear(layer))
            swapped.append((parent, name, layer))
        yield len(swapped)
    finally:
        put_back(swapped)


def weight_first_is_faster(weight: torch.Tensor, rows: int) -> bool:
    """Whether ``weight @ xᵀ`` beats ``x @ weightᵀ`` by `ORIENTATION_MARGIN` for ``rows`` rows of ``x`` on this CPU
    with its threads: each timed (best of 5, after a warm-up) once per process, shape, dtype, rows and threads."""
    key = (tuple(weight.shape), weight.dtype, rows, torch.get_num_threads())
    if key not in _ORIENTATION:
        generator = torch.Generator().manual_seed(0)  # not the global generator: sampling draws the same numbers
        x = torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype)
        usual, first = (_best_seconds(lambda: x @ weight.T), _best_seconds(lambda: weight @ x.T))
        _ORIENTATION[key] = first * ORIENTATION_MARGIN <= usual
    return _ORIENTATION[key]


def _best_seconds(call, repeats: int = 5) -> float:
    call()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def child_slots(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """Every ``(parent, name, child)`` in ``model``, listed before any is swapped (the swaps leave the list as is)."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]


def put_back(swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]]) -> None:
    """Each ``(parent, name, child)`` slot given its original child again, the last swapped first."""
    for parent, name, child in reversed(swapped):
        parent.register_module(name, child)


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
