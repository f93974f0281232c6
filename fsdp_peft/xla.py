"""PyTorch/XLA (TPU): the recipes on the Trainer's XLA FSDP route, with the PEFT-aware choices that apply there.

A run is on XLA when ``PJRT_DEVICE`` is set (``TPU`` on a TPU VM; ``CPU`` with ``CPU_NUM_DEVICES=N`` simulates N
devices, as the tests do). ``fsdp: true`` then means the Trainer's XLA FSDP, not torch FSDP:

- ``xla_fsdp_v2: true`` (the default): SPMD, one process driving every chip, parameters sharded over a
  ``("fsdp", "tensor")`` mesh; ``xla_fsdp_v2: false`` selects FSDP v1 (``XlaFullyShardedDataParallel``).
- decoder layers are the units (the family's decoder layer, as on GPUs); adapters keep fp32 master weights
  and compute in bf16 under ``bf16: true`` (`fsdp_peft.modeling.attach_lora`);
- ``xla_fsdp_grad_ckpt: true`` (the default) checkpoints every decoder layer: input grads are enabled, so
  the first layer's input requires grad even though the embedding is frozen (LoRA).

QLoRA (bitsandbytes has no XLA backend) and the torch-FSDP keys are refused before anything starts
(`fsdp_peft.validation`). Everything the recipes do differently on XLA is in this module.
"""

from __future__ import annotations

import importlib.util
import os

import torch

XLA_KEYS = ("xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings")
XLA_UNIT_KEYS = ("transformer_layer_cls_to_wrap", "min_num_params")  # how the XLA route picks its units
DEVICE_VARIABLE = "PJRT_DEVICE"


def on_xla() -> bool:
    """Whether this run trains on XLA devices: ``PJRT_DEVICE`` names the PJRT runtime (TPU, or CPU in tests)."""
    return bool(os.environ.get(DEVICE_VARIABLE))


def torch_xla_installed() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def xla_fsdp_config(fsdp_config: dict) -> dict:
    """The Trainer's ``fsdp_config`` for the XLA route from the recipe's (``fsdp_`` prefixes dropped):
    v2 (SPMD) and every layer checkpointed unless the recipe says otherwise."""
    config = {str(key).removeprefix("fsdp_"): value for key, value in fsdp_config.items()}
    return {
        **{key: config[key] for key in XLA_UNIT_KEYS if key in config},
        "xla": True,
        "xla_fsdp_v2": bool(config.get("xla_fsdp_v2", True)),
        "xla_fsdp_grad_ckpt": bool(config.get("xla_fsdp_grad_ckpt", True)),
        "xla_fsdp_settings": dict(config.get("xla_fsdp_settings") or {}),
    }


def gpu_only_fsdp_keys(fsdp_config: dict) -> list[str]:
    """The recipe's fsdp_config keys the XLA route has no use for (torch FSDP's: version, offload, ...)."""
    keys = [str(key).removeprefix("fsdp_") for key in fsdp_config]
    return [key for key in keys if key not in (*XLA_KEYS, *XLA_UNIT_KEYS)]


def prepare_for_xla_fsdp(model: torch.nn.Module, args) -> None:
    """Before the Trainer wraps ``model``: decoder layers as units, and input grads for checkpointing.

    ``xla_fsdp_grad_ckpt`` checkpoints a unit only when its input requires grad; with the embedding frozen
    (LoRA), the first decoder layer's input does not, and that layer would silently go unchecked.
    """
    from fsdp_peft.policies import decoder_layer_classes  # lazy: policies imports transformers' FSDP helpers

    config = args.fsdp_config
    if not config.get("min_num_params") and not config.get("transformer_layer_cls_to_wrap"):
        config["transformer_layer_cls_to_wrap"] = sorted(cls.__name__ for cls in decoder_layer_classes(model))
    if config.get("xla_fsdp_grad_ckpt"):
        model.enable_input_require_grads()


def checkpointed_layers(model: torch.nn.Module) -> int:
    """How many units torch_xla wrapped in activation checkpointing (``checkpoint_module``)."""
    return sum(1 for module in model.modules() if getattr(module, "_xla_checkpointed_module", False))


def parameter_shardings(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's XLA sharding spec (``""`` when replicated), by name: what SPMD FSDP did."""
    import torch_xla  # lazy: only on the XLA route

    return {name: torch_xla._XLAC._get_xla_sharding_spec(p) for name, p in model.named_parameters()}
