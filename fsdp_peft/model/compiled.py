"""The compiled step (``compile: true``): each decoder layer's forward compiled by ``torch.compile`` as a graph of
its own, in training only.

The torchtitan pattern under FSDP2: one graph per block, not the whole model, so FSDP's all-gather hooks, activation
checkpointing, the loss and the optimizer stay eager around it and a graph serves every layer (transformers passes
each layer's weights in as inputs). Evaluation and ``generate`` (a growing KV cache) run the eager forward.
Recompilation: the first layer's input needs no gradient (a frozen embedding) and the others' do, and a second
sequence length makes the length dynamic: about four graphs in all, counted in ``results.json``.
"""

from __future__ import annotations

import torch

from fsdp_peft.settings.checkpointing import blocks


def compile_layers(model: torch.nn.Module) -> int:
    """Compile the training forward of every decoder layer of ``model`` (a PeftModel or a transformers model) and
    returns how many: the language model's (a vision tower's blocks stay eager: their attention splits each image's
    patches by lengths read from a tensor, a graph break in every block). A 4-bit layer inside computes, when
    compiled, through `FourBitLinear`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = blocks(base.get_decoder())
    for layer in layers:
        for module in layer.modules():
            if getattr(module, "quant_state", None) is not None and hasattr(module, "compute_dtype"):
                module.forward = _four_bit_when_compiled(module, module.forward)
        layer.forward = _training_compiled(layer, layer.forward)
    return len(layers)


class FourBitLinear(torch.autograd.Function):
    """``x @ W.T`` for a 4-bit weight ``W``, as bitsandbytes' own training matmul computes it (dequantize, then a
    matmul in the input's dtype; backward dequantizes again instead of saving ``W``), written with bitsandbytes'
    registered ops only, which dynamo traces: its ``Linear4bit.forward`` re-wraps an FSDP-gathered weight in a
    ``Params4bit`` every call, which it cannot (a graph break in every 4-bit layer)."""

    @staticmethod
    def forward(ctx, x, packed, absmax, blocksize, quant_type, shape, dtype):
        weight = torch.ops.bitsandbytes.dequantize_4bit.default(packed, absmax, blocksize, quant_type, shape, dtype)
        ctx.save_for_backward(packed, absmax)
        ctx.layout = (blocksize, quant_type, shape, dtype)
        return torch.nn.functional.linear(x, weight.to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        packed, absmax = ctx.saved_tensors
        weight = torch.ops.bitsandbytes.dequantize_4bit.default(packed, absmax, *ctx.layout)
        return grad @ weight.to(grad.dtype), None, None, None, None, None, None


def _four_bit_when_compiled(module: torch.nn.Module, eager):
    """``module``'s (a bitsandbytes ``Linear4bit``) forward: its own when eager, `FourBitLinear` when dynamo traces
    it; the block scales of a doubly quantized weight dequantized first, the compute dtype and bias as its own."""
    state = module.quant_state

    def forward(x):
        if not torch.compiler.is_compiling():
            return eager(x)
        absmax = state.absmax
        if state.nested:
            nested = state.state2
            absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(
                absmax, nested.absmax, nested.code, nested.blocksize, torch.float32
            )
            absmax = absmax + state.offset
        dtype = module.compute_dtype or x.dtype
        shape = tuple(state.shape)
        out = FourBitLinear.apply(
            x.to(dtype), module.weight, absmax, state.blocksize, state.quant_type, shape, state.dtype
        )
        if module.bias is not None:
            out = out + module.bias.to(dtype)
        return out.to(x.dtype)

    return forward


def _training_compiled(layer: torch.nn.Module, eager):
    compiled = torch.compile(eager)

    def forward(*args, **kwargs):
        return (compiled if layer.training else eager)(*args, **kwargs)

    return forward


def compile_report(layers: int) -> dict:
    """What compiling cost this process: the layers compiled, the graphs dynamo made and the seconds it spent."""
    from torch._dynamo.utils import compilation_time_metrics, counters  # lazy: dynamo only for a compiled run

    seconds = sum(compilation_time_metrics.get("_compile.compile_inner", []))
    return {"layers": layers, "graphs": counters["stats"]["unique_graphs"], "compile_seconds": round(seconds, 2)}
