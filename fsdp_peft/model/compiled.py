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
    patches by lengths read from a tensor, a graph break in every block)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = blocks(base.get_decoder())
    for layer in layers:
        layer.forward = _training_compiled(layer, layer.forward)
    return len(layers)


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
