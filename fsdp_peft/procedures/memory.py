"""Exact per-rank memory accounting of a training run: what each rank holds, counted tensor by tensor.

`MemoryReport` (registered by the recipes' trainer) counts, right after the first optimizer step, the
bytes this rank stores for parameters (its FSDP shard: ``DTensor.to_local()``), gradients (trainable
only, local shard), optimizer states (every tensor in ``optimizer.state``, local shard) and 4-bit
quantization constants (``quant_state`` tensors, which live on the module and are not sharded), plus
the peak resident set size after loading and over the whole run. Rank 0 writes them, one entry per
rank, to ``memory.json`` in ``output_dir``. `fsdp_peft.tools.plan` estimates the same numbers from the config.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

from fsdp_peft.core.distributed import gathered_from_every_rank
from fsdp_peft.core.log import logger
from fsdp_peft.settings.checkpointing import blocks

MEMORY_FILE = "memory.json"


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank stores: its shard for a DTensor, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of ``tensor`` (elements x element size, padding not included)."""
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def parameter_bytes(model: torch.nn.Module) -> int:
    """Local bytes of every stored parameter (FSDP1: of every flat parameter this rank holds)."""
    total = 0
    for parameter in model.parameters():
        if not hasattr(parameter, "to_local") and parameter.untyped_storage().size() == 0:
            continue  # FSDP1: a view into a freed gathered flat parameter
        total += tensor_bytes(parameter)
    return total


def gradient_bytes(model: torch.nn.Module) -> int:
    """Local bytes of every gradient currently held."""
    return sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer) -> int:
    """Local bytes of every tensor in the optimizer's state (Adam: two moments and a step per parameter)."""
    total = 0
    for state in optimizer.state.values():
        total += sum(tensor_bytes(value) for value in state.values() if isinstance(value, torch.Tensor))
    return total


def quantization_constant_bytes(model: torch.nn.Module) -> int:
    """Bytes of bitsandbytes 4-bit ``quant_state`` tensors (absmax, code, nested constants), each counted once."""
    seen: set[int] = set()
    total = 0

    def count(tensor) -> None:
        nonlocal total
        if isinstance(tensor, torch.Tensor) and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()

    for module in model.modules():
        # bitsandbytes keeps a copy on the module: FSDP's sharded DTensor weight loses its own
        # (its own registered weight: a wrapper's ``weight`` property, e.g. peft's trainable tokens, computes a tensor)
        weight = module._parameters.get("weight")
        state = getattr(module, "quant_state", None) or getattr(weight, "quant_state", None)
        if state is None:
            continue
        for name in ("absmax", "code", "offset"):
            count(getattr(state, name, None))
        nested = getattr(state, "state2", None)
        if nested is not None:
            for name in ("absmax", "code"):
                count(getattr(nested, name, None))
    return total


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def checkpointed_layers(model: torch.nn.Module) -> dict:
    """The model's checkpointable blocks (transformers' ``GradientCheckpointingLayer``) and how many recompute their
    forward in backward (their ``gradient_checkpointing`` flag, which activation checkpointing sets), as in force."""
    found = blocks(model)
    return {
        "checkpointable_layers": len(found),
        "checkpointed_layers": sum(bool(getattr(m, "gradient_checkpointing", False)) for m in found),
    }


class MemoryReport(TrainerCallback):
    """Counts this rank's parameter, gradient and optimizer bytes after the first optimizer step;
    rank 0 writes every rank's figures and peak RSS to ``memory.json`` when training ends."""

    def __init__(self):
        self.figures: dict = {}
        self.loading_reserved = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.figures["peak_rss_after_loading_bytes"] = peak_rss_bytes()
        if torch.cuda.is_available():  # loading and sharding apart from training: the peak restarts here
            self.figures["peak_gpu_allocated_loading_bytes"] = torch.cuda.max_memory_allocated()
            self.loading_reserved = torch.cuda.max_memory_reserved()
            torch.cuda.reset_peak_memory_stats()

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if "parameter_bytes" in self.figures:
            return
        figures = {
            "parameter_bytes": parameter_bytes(model),
            "trainable_parameter_bytes": sum(tensor_bytes(p) for p in model.parameters() if p.requires_grad),
            "gradient_bytes": gradient_bytes(model),
            "optimizer_state_bytes": optimizer_state_bytes(optimizer) if optimizer is not None else 0,
            "quantization_constant_bytes": quantization_constant_bytes(model),
            **checkpointed_layers(model),
        }
        figures["parameter_gradient_optimizer_bytes"] = (
            figures["parameter_bytes"] + figures["gradient_bytes"] + figures["optimizer_state_bytes"]
        )
        self.figures.update(figures)

    def on_train_end(self, args, state, control, **kwargs):
        mine = {**self.figures, "rank": args.process_index, "peak_rss_bytes": peak_rss_bytes()}
        if torch.cuda.is_available():  # training's peak, and the whole run's (loading's, where higher)
            mine["peak_gpu_allocated_training_bytes"] = torch.cuda.max_memory_allocated()
            mine["peak_gpu_allocated_bytes"] = max(
                mine["peak_gpu_allocated_training_bytes"], self.figures.get("peak_gpu_allocated_loading_bytes", 0)
            )
            mine["peak_gpu_reserved_bytes"] = max(torch.cuda.max_memory_reserved(), self.loading_reserved)
        ranks = gathered_from_every_rank(mine)
        if not state.is_world_process_zero:
            return
        report = {"world_size": args.world_size, "measured_after": "first optimizer step", "ranks": ranks}
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.output_dir) / MEMORY_FILE).write_text(json.dumps(report, indent=1))
        if "parameter_gradient_optimizer_bytes" in mine:
            largest = max(r["parameter_gradient_optimizer_bytes"] for r in ranks)
            logger.info(f"per-rank parameters + gradients + optimizer state: {largest / 2**20:.1f} MiB (largest rank)")
