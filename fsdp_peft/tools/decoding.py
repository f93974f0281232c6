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

On a CPU with more than one thread, each plain linear layer of the compiled decode step may compute ``(W xᵀ)ᵀ`` in
place of ``x Wᵀ`` (`weight_first_layers`): the same products in one matmul, which MKL spreads over the threads better
at a decode step's few rows (measured on 2 cores at 16 rows: 1.25x the layers of SmolLM2, 1.8x its output layer). Each
layer shape is timed both ways once per process and number of rows (`weight_first_is_faster`), and computes so only
where that orientation wins by `ORIENTATION_MARGIN`: a timed choice, so two processes may differ in it, and in the
rounding of their products. At one row each plain linear layer computes its outputs as reductions over the weight's
rows instead (`row_reduction_layers`), one inductor kernel over all the threads where MKL's one-row product runs on
one (measured on 2 cores, weights out of cache: 1.1x to 2.6x SmolLM2's layer shapes with AVX512; without it, 0.6x
and 0.95x its two smallest and 1.2x to 2.4x the rest, 1.25x over a token step). GPUs and one-thread CPUs keep the
layers as they are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import shutil
import sys
import time
from collections import Counter
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
_RECOMPILE_LIMIT_HIT = "Dynamo recompile limit exceeded"  # how dynamo's count of refusals names a limit met
_LIMIT_MET = re.compile(r"exceeding the (\w+) cache size limit \(currently set to (\d+)\)")  # and which limit
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
        dequantized for the call here: `eager_because` found none left); on a CPU, the linear layers faster weight
        first at the call's rows computing so in the compiled step (`weight_first_layers`), at one row each as a
        reduction over its weight's rows (`row_reduction_layers`). After it, what was compiled is said
        (`say_graphs_compiled`)."""
        if not self.kwargs:
            yield
            return
        limits_met = recompile_limits_met()
        base = causal_lm_of(model)
        quantizer = getattr(base, "hf_quantizer", None)
        quantizer = quantizer if quantizer is not None and _bitsandbytes_4_bit(quantizer) else None
        with (
            fsdp2_forward_hooks_detached(units),
            weight_first_layers(model, self.rows),
            row_reduction_layers(model, self.rows),
        ):
            if quantizer is not None:
                base.hf_quantizer = None
            try:
                yield
            finally:
                if quantizer is not None:
                    base.hf_quantizer = quantizer
        say_graphs_compiled(limits_met)


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
    return _dynamo_counters().get("stats", {}).get("unique_graphs", 0)


def recompile_limits_met() -> Counter[str]:
    """dynamo's refusals to compile again in this process by the limit each met, as its setting reads:
    ``torch._dynamo.config.recompile_limit = 8`` (a function's graphs) or ``...accumulated_recompile_limit = 256``
    (all of them)."""
    met: Counter[str] = Counter()
    for reason, n in _dynamo_counters().get("unimplemented", {}).items():
        if reason.startswith(_RECOMPILE_LIMIT_HIT):
            found = _LIMIT_MET.search(reason)
            name, value = found.groups() if found else ("recompile_limit", torch._dynamo.config.recompile_limit)
            met[f"torch._dynamo.config.{name} = {value}"] += n
    return met


def _dynamo_counters() -> dict:
    """dynamo's counters of this process (empty where dynamo was never loaded: nothing compiled)."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import counters  # lazy: dynamo is loaded only where something compiled

    return counters


def say_graphs_compiled(limits_met: Counter[str]) -> None:
    """After a call given the compiled step: one line each time the process's count of compiled graphs grows
    (recompilation is visible, not silent); none compiled at all says the call decoded eagerly, and so does a call
    that met one of dynamo's recompile limits (`recompile_limits_met` beyond ``limits_met``, its count before the
    call), naming it."""
    graphs = graphs_compiled()
    if met := recompile_limits_met() - limits_met:
        _say_once(
            "generation decodes eagerly for batch sizes and cache lengths without a graph: dynamo's recompile "
            f"limit ({', '.join(sorted(met))}) met by the decode step; fewer distinct batch sizes (a call's last "
            "batch may be smaller) or a higher limit keep them compiled"
        )
    if graphs:
        _say_once(f"compiled decode step: {graphs} graphs compiled in this process")
    else:
        _say_once("generation decodes eagerly: transformers compiled no decode step (its own criteria)")


def weight_first_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x Wᵀ`` (+ bias) as ``(W xᵀ)ᵀ``: the same products in one matmul, the other way round, the output a
    transposed view."""
    out_features, in_features = weight.shape
    y = torch.mm(weight, x.reshape(-1, in_features).T).T
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], out_features)


def _weight_first_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A weight-first layer's forward: `weight_first_product` in the compiled decode step (the rows it was timed
    at); ``nn.Linear``'s own in an eager forward of the call (the prompt's, a vision tower's: other rows, untimed)."""
    if not torch.compiler.is_compiling():
        return torch.nn.functional.linear(x, self.weight, self.bias)
    return weight_first_product(x, self.weight, self.bias)


class WeightFirstLinear(torch.nn.Linear):
    """A plain ``nn.Linear`` for a call (`weight_first_layers`): its compiled forward computes ``(W xᵀ)ᵀ``."""

    forward = _weight_first_forward


@functools.cache
def weight_first_class(cls: type) -> type:
    """``cls``, a linear layer class computing with ``nn.Linear``'s forward, with the weight-first forward."""
    return _with_forward_of(WeightFirstLinear, cls)


def _with_forward_of(plain: type, cls: type) -> type:
    """``cls`` with the forward of ``plain`` (an ``nn.Linear`` subclass): ``plain`` itself for ``nn.Linear``, else a
    subclass of ``cls`` named after both."""
    if cls is torch.nn.Linear:
        return plain
    name = plain.__name__.removesuffix("Linear") + cls.__name__
    return type(name, (cls,), {"forward": plain.forward, "__module__": __name__})


def row_reduction_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x Wᵀ`` (+ bias) as ``Σₖ W[:, k] x[k]``: a product and a sum over each weight row, which inductor fuses into
    one reduction kernel (nothing of the product's size is made)."""
    y = (weight * x.unsqueeze(-2)).sum(-1)
    return y if bias is None else y + bias


def _row_reduction_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A row-reduction layer's forward: `row_reduction_product` in the compiled decode step (one row);
    ``nn.Linear``'s own in an eager forward of the call (the prompt's, a vision tower's)."""
    if not torch.compiler.is_compiling():
        return torch.nn.functional.linear(x, self.weight, self.bias)
    return row_reduction_product(x, self.weight, self.bias)


class RowReductionLinear(torch.nn.Linear):
    """A plain ``nn.Linear`` for a one-row call (`row_reduction_layers`): its compiled forward reduces over each
    weight row."""

    forward = _row_reduction_forward


@functools.cache
def row_reduction_class(cls: type) -> type:
    """``cls``, a linear layer class computing with ``nn.Linear``'s forward, with the row-reduction forward."""
    return _with_forward_of(RowReductionLinear, cls)


@contextlib.contextmanager
def weight_first_layers(model: torch.nn.Module, rows: int) -> Iterator[int]:
    """On a CPU with more than one thread and at 2 rows or more, each plain linear layer of ``model`` whose shape
    multiplies faster as ``(W xᵀ)ᵀ`` at ``rows`` rows (`weight_first_is_faster`) computes so for the block; yields how
    many. The layer's class is swapped for its `weight_first_class` and back at exit: the module stays where it is,
    with its parameters, hooks and ``isinstance`` checks (a LoRA layer's unmerged base and adapter, a wrapper
    reading ``.weight``); only the compiled step computes weight first, the call's eager forwards as before. Not a
    layer with a forward of its own or an instance-level one, an FSDP unit, or a weight other than a plain tensor on
    the CPU (a DTensor, a quantized or uninitialized one, the meta device). A class changed during the block (by
    something else) is left as it is. Elsewhere nothing changes; the count is said once per rows and count."""
    if rows < 2 or not _multi_threaded_cpu(model):
        yield 0
        return
    faster = lambda layer: weight_first_is_faster(layer.weight.detach(), rows)  # noqa: E731
    with _classes_swapped(model, faster, weight_first_class, f"multiply weight first at {rows} rows") as swapped:
        yield swapped


@contextlib.contextmanager
def row_reduction_layers(model: torch.nn.Module, rows: int) -> Iterator[int]:
    """On a CPU with more than one thread and at one row, each plain linear layer of ``model`` (as for
    `weight_first_layers`) computes each output of the compiled step as a reduction over its weight's row
    (`row_reduction_product`) for the block; yields how many. A one-row ``x Wᵀ`` runs on one thread in MKL, where
    inductor's kernel for the reduction reads the weight once over all the threads: measured on 2 cores with the
    weights out of cache (``benchmarks/one_row_products.py``), with AVX512 1.1x (its smallest, 192 x 576) to 2.6x
    (its output layer) each of SmolLM2's layer shapes; with AVX2 only, 0.6x and 0.95x its two smallest shapes,
    1.2x to 2.4x the rest, 1.25x over a token step. A rule, not timed per shape as the weight-first orientation is
    (a timing needs a compiled kernel per shape and the weights out of cache: in cache MKL looks faster than it is)."""
    if rows != 1 or not _multi_threaded_cpu(model):
        yield 0
        return
    with _classes_swapped(model, lambda _layer: True, row_reduction_class, "reduce over each weight row") as swapped:
        yield swapped


def _multi_threaded_cpu(model: torch.nn.Module) -> bool:
    return _device_of(model).type == "cpu" and torch.get_num_threads() >= 2 and not on_xla()


@contextlib.contextmanager
def _classes_swapped(model: torch.nn.Module, chosen, class_for, saying: str) -> Iterator[int]:
    """Each plain linear layer of ``model`` (`_plain_linear`) that ``chosen`` accepts of its ``class_for`` class for
    the block, and back at exit (a class changed meanwhile by something else is left as it is); yields how many."""
    swapped: list[tuple[torch.nn.Module, type]] = []
    try:
        for layer in model.modules():
            if not _plain_linear(layer) or not chosen(layer):
                continue
            swapped.append((layer, type(layer)))
            layer.__class__ = class_for(type(layer))
        if swapped:
            _say_once(f"compiled decode step: {len(swapped)} linear layers {saying}")
        yield len(swapped)
    finally:
        for layer, cls in reversed(swapped):
            if type(layer) is class_for(cls):
                layer.__class__ = cls


def _plain_linear(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` computes with ``nn.Linear``'s own forward over a plain CPU weight, nothing else in the way."""
    if type(layer).forward is not torch.nn.Linear.forward or "forward" in vars(layer) or isinstance(layer, FSDPModule):
        return False
    weight = getattr(layer, "weight", None)
    return type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.device.type == "cpu"


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
