"""The compiled step (``compile: true``): each decoder layer's forward compiled by ``torch.compile`` as a graph of
its own, in training only (training mode, outside generation's `eager_layers` blocks).

The torchtitan pattern under FSDP2: one graph per block, not the whole model, so FSDP's all-gather hooks, activation
checkpointing, the loss and the optimizer stay eager around it and a graph serves every layer (transformers passes
each layer's weights in as inputs). Evaluation and ``generate`` (a growing KV cache) run the eager forward.
Recompilation: the first layer's input needs no gradient (a frozen embedding) and the others' do, and a second
sequence length makes the length dynamic: about four graphs in all, counted in ``results.json``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

from fsdp_peft.settings.checkpointing import blocks


def compile_layers(model: torch.nn.Module) -> int:
    """Compile the training forward of every decoder layer of ``model`` (a PeftModel or a transformers model) and
    returns how many: the language model's (a vision tower's blocks stay eager: their attention splits each image's
    patches by lengths read from a tensor, a graph break in every block). A bitsandbytes 4-bit layer inside computes,
    when compiled, through `four_bit_linear` (chosen by class: under low-memory loading the weights, and their
    quantization state, arrive after this)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = blocks(base.get_decoder())
    bitsandbytes = sys.modules.get("bitsandbytes")  # loaded by a 4-bit build; none to find without it
    for layer in layers:
        for module in layer.modules():
            if bitsandbytes is not None and isinstance(module, bitsandbytes.nn.Linear4bit):
                module.forward = _four_bit_when_compiled(module, module.forward)
        layer.forward = _training_compiled(layer, layer.forward)
    return len(layers)


@torch.library.custom_op("fsdp_peft::four_bit_linear", mutates_args=())
def four_bit_linear(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    shape: list[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """``x @ W.T + bias`` for a 4-bit weight ``W``, as bitsandbytes' own training matmul computes it: ``W``
    dequantized in its stored dtype, then cast to the input's, the bias added by the matmul; backward dequantizes
    ``W`` again instead of saving it (the bias of a 4-bit base layer is frozen). One opaque op:
    the compiler can neither trace into bitsandbytes' ``Linear4bit.forward`` (it re-wraps an FSDP-gathered weight in
    a ``Params4bit`` every call: a graph break in every 4-bit layer) nor, seeing the dequantization in forward and
    in backward, merge the two and save the whole dequantized weight for backward."""
    weight = _dequantized(packed, absmax, blocksize, quant_type, shape, dtype, x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


@four_bit_linear.register_fake
def _(x, bias, packed, absmax, blocksize, quant_type, shape, dtype):
    return x.new_empty((*x.shape[:-1], shape[0]))


def _dequantized(packed, absmax, blocksize, quant_type, shape, dtype, to):
    return torch.ops.bitsandbytes.dequantize_4bit.default(packed, absmax, blocksize, quant_type, shape, dtype).to(to)


def _keep_for_backward(ctx, inputs, output):
    _, _, packed, absmax, *layout = inputs
    ctx.save_for_backward(packed, absmax)
    ctx.layout = layout


def _four_bit_linear_backward(ctx, grad):
    packed, absmax = ctx.saved_tensors
    return grad @ _dequantized(packed, absmax, *ctx.layout, grad.dtype), None, None, None, None, None, None, None


four_bit_linear.register_autograd(_four_bit_linear_backward, setup_context=_keep_for_backward)


def _four_bit_when_compiled(module: torch.nn.Module, eager):
    """``module``'s (a bitsandbytes ``Linear4bit``) forward: its own when eager, `four_bit_linear` when dynamo traces
    it; its quantization state read at each call (low-memory loading sets it after the model is built), the block
    scales of a doubly quantized weight dequantized first, the compute dtype and bias as its own."""

    def forward(x):
        if not torch.compiler.is_compiling():
            return eager(x)
        dtype = module.compute_dtype or x.dtype
        bias = None if module.bias is None else module.bias.to(dtype)
        return four_bit_linear(x.to(dtype), bias, *_four_bit_parts(module)).to(x.dtype)

    return forward


def _four_bit_parts(module: torch.nn.Module) -> tuple:
    """A bitsandbytes ``Linear4bit``'s packed weight and what dequantizes it (`four_bit_linear`'s arguments after
    ``x`` and ``bias``), its quantization state read now (low-memory loading sets it after the model is built); the
    block scales of a doubly quantized weight dequantized first."""
    state = getattr(module, "quant_state", None) or module.weight.quant_state
    absmax = state.absmax
    if state.nested:
        nested = state.state2
        absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(
            absmax, nested.absmax, nested.code, nested.blocksize, torch.float32
        )
        absmax = absmax + state.offset
    return module.weight, absmax, state.blocksize, state.quant_type, list(state.shape), state.dtype


def four_bit_weight(module: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A bitsandbytes ``Linear4bit``'s weight dequantized, in ``dtype``: what its forward multiplies by (it
    dequantizes in the stored dtype, then casts to the compute dtype)."""
    return _dequantized(*_four_bit_parts(module), dtype)


_EAGER_BLOCKS = [0]  # `eager_layers` blocks open


@contextlib.contextmanager
def eager_layers() -> Iterator[None]:
    """The compiled layers run their eager forward in the block, whatever the mode: generation (GRPO's rollouts run in
    training mode, with a KV cache that grows every token)."""
    _EAGER_BLOCKS[0] += 1
    try:
        yield
    finally:
        _EAGER_BLOCKS[0] -= 1


def _training_compiled(layer: torch.nn.Module, eager):
    compiled = torch.compile(eager)

    def forward(*args, **kwargs):
        return (compiled if layer.training and not _EAGER_BLOCKS[0] else eager)(*args, **kwargs)

    return forward


def compile_report(layers: int) -> dict:
    """What compiling cost this process: the layers compiled, the graphs dynamo made and the seconds it spent."""
    from torch._dynamo.utils import compilation_time_metrics, counters  # lazy: dynamo only for a compiled run

    seconds = sum(compilation_time_metrics.get("_compile.compile_inner", []))
    return {"layers": layers, "graphs": counters["stats"]["unique_graphs"], "compile_seconds": round(seconds, 2)}
