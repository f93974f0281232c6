"""PyTorch/XLA (TPU): the recipes on the Trainer's XLA FSDP route, with the PEFT-aware choices that apply there.

A run is on XLA when ``PJRT_DEVICE`` is set (``TPU`` on a TPU VM; ``CPU`` with ``CPU_NUM_DEVICES=N`` simulates N
devices, as the tests do). ``fsdp: true`` then means the Trainer's XLA FSDP, not torch FSDP:

- ``xla_fsdp_v2: true`` (the default): SPMD, one process driving every chip, parameters sharded over a
  ``("fsdp", "tensor")`` mesh; ``xla_fsdp_v2: false`` selects FSDP v1 (``XlaFullyShardedDataParallel``).
- decoder layers are the units (the family's decoder layer, as on GPUs); adapters keep fp32 master weights
  and compute in bf16 under ``bf16: true`` (`fsdp_peft.model.modeling.attach_lora`);
- ``xla_fsdp_grad_ckpt: true`` (the default) checkpoints every decoder layer: input grads are enabled, so
  the first layer's input requires grad even though the embedding is frozen (LoRA).

QLoRA (bitsandbytes has no XLA backend) and the torch-FSDP keys are refused before anything starts
(`fsdp_peft.tools.validation`). Everything the recipes do differently on XLA is in this module.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Iterable

import torch

XLA_KEYS = ("xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings")
XLA_UNIT_KEYS = ("transformer_layer_cls_to_wrap", "min_num_params")  # how the XLA route picks its units
DEVICE_VARIABLE = "PJRT_DEVICE"


def on_xla() -> bool:
    """Whether this run trains on XLA devices: ``PJRT_DEVICE`` names the PJRT runtime (TPU, or CPU in tests)."""
    return bool(os.environ.get(DEVICE_VARIABLE))


@contextlib.contextmanager
def xla_assumed():
    """Inside, `on_xla` holds (``PJRT_DEVICE=TPU`` unless already set), so a TPU config can be planned anywhere."""
    if on_xla():
        yield
        return
    os.environ[DEVICE_VARIABLE] = "TPU"
    try:
        yield
    finally:
        os.environ.pop(DEVICE_VARIABLE, None)


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


def prepare_for_xla_fsdp(model: torch.nn.Module, args, decoder_layers: Iterable[type]) -> None:
    """Before the Trainer wraps ``model``: its ``decoder_layers`` as units, and input grads for checkpointing.

    ``xla_fsdp_grad_ckpt`` checkpoints a unit only when its input requires grad; with the embedding frozen
    (LoRA), the first decoder layer's input does not, and that layer would silently go unchecked.
    """
    config = args.fsdp_config
    if not config.get("min_num_params") and not config.get("transformer_layer_cls_to_wrap"):
        config["transformer_layer_cls_to_wrap"] = sorted(cls.__name__ for cls in decoder_layers)
    if config.get("xla_fsdp_grad_ckpt"):
        model.enable_input_require_grads()


def checkpointed_layers(model: torch.nn.Module) -> int:
    """How many units torch_xla wrapped in activation checkpointing (``checkpoint_module`` keeps each one's own
    forward as ``_xla_checkpointed_forward_original``, torch-xla 2.9)."""
    return sum(1 for module in model.modules() if "_xla_checkpointed_forward_original" in vars(module))


def parameter_shardings(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's XLA sharding spec (``""`` when replicated), by name: what SPMD FSDP did."""
    import torch_xla  # lazy: only on the XLA route

    return {name: torch_xla._XLAC._get_xla_sharding_spec(p) for name, p in model.named_parameters()}


def sharding_summary(model: torch.nn.Module, fsdp_config: dict) -> str:
    """How an XLA FSDP run is sharded, in one line (GPU and CPU runs print their FSDP units): the mesh and its
    devices (v2, SPMD) or the wrapped units (v1), how many parameters are sharded, the checkpointed layers."""
    import torch_xla.runtime as xr  # lazy: only on the XLA route

    count = xr.global_runtime_device_count()
    devices = f"{count} device{'s' if count != 1 else ''}"
    checkpointed = checkpointed_layers(model)
    if fsdp_config.get("xla_fsdp_v2"):
        import torch_xla.distributed.spmd as xs  # lazy: only on the XLA route

        mesh = xs.get_global_mesh()
        shape = dict(zip(mesh.axis_names, mesh.mesh_shape)) if mesh is not None else {}
        shardings = parameter_shardings(model)
        sharded = sum(1 for spec in shardings.values() if spec.startswith("{devices="))
        return (
            f"XLA FSDP v2 (SPMD): mesh {shape} over {devices}; sharded parameters: "
            f"{sharded}/{len(shardings)}; checkpointed layers: {checkpointed}"
        )
    units = [m for m in model.modules() if type(m).__name__ == "XlaFullyShardedDataParallel"]
    return f"XLA FSDP v1: {len(units)} units over {devices}; checkpointed layers: {checkpointed}"


def start_xla_runtime(fsdp_config: dict | None) -> None:
    """Switch PyTorch/XLA to SPMD before anything touches a device, when the run takes XLA FSDP v2.

    ``fsdp_config`` is the Trainer's (``fsdp_peft.settings.fsdp_settings.trainer_fsdp_arguments``). SPMD is one process
    driving every device; it must be on before the first XLA tensor exists.
    """
    if on_xla() and fsdp_config and fsdp_config.get("xla_fsdp_v2"):
        import torch_xla.runtime as xr  # lazy: only on the XLA route

        xr.use_spmd()


def unwrap_xla_fsdp(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside torch_xla's FSDP wrappers (v2 keeps it as ``module``; v1 behind a parameter flattener,
    itself a torch_xla module); any other model is returned as it is."""
    while type(model).__module__.startswith("torch_xla."):
        model = model.module
    return model


def xla_trainable_state_dict(model: torch.nn.Module, expected: list[str]) -> dict[str, torch.Tensor]:
    """Full CPU copies of the ``expected`` trainable tensors of an XLA FSDP model, by their unwrapped names.

    v2 (SPMD): a sharded tensor copied to the CPU is whole. v1: this process's shards, consolidated by
    torch_xla (one process holds them all: one device on CPU, one host's devices on a TPU VM).
    """
    if hasattr(model, "get_shard_metadata"):
        from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts  # lazy: only on the XLA route

        shards = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
        state_dict = consolidate_sharded_state_dicts([shards], model.get_shard_metadata())
    else:
        state_dict = {name: p.detach().cpu() for name, p in model.named_parameters() if p.requires_grad}
    state_dict = {_unwrapped_name(name): tensor for name, tensor in state_dict.items()}
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise RuntimeError(f"XLA adapter lacks {len(missing)} trainable tensors (e.g. {missing[0]}); not saving it")
    return {name: state_dict[name].clone() for name in expected}


def _unwrapped_name(name: str) -> str:
    wrappers = ("_orig_module", "_fsdp_wrapped_module", "_fpw_module")
    return ".".join(part for part in name.split(".") if part not in wrappers)


def expose_generate(wrapped: torch.nn.Module) -> None:
    """``generate`` on XLA FSDP's outer wrapper: the wrapped `PeftModel`'s own, through the sharded units."""
    inner = unwrap_xla_fsdp(wrapped)
    if inner is not wrapped and "generate" not in vars(wrapped):
        wrapped.generate = inner.generate


def xla_plan(fsdp_config: dict | None, chips: int, tokens: int) -> tuple[str, bool, int] | None:
    """How `fsdp-peft plan` counts a run on XLA FSDP (``PJRT_DEVICE`` set; ``fsdp_config`` the Trainer's): its
    name, whether every layer is checkpointed, and the tokens per chip (SPMD: one process, its batch split
    over the chips); else ``None``."""
    if not on_xla() or not fsdp_config or not fsdp_config.get("xla"):
        return None
    if fsdp_config["xla_fsdp_v2"]:
        return "XLA FSDP v2 (SPMD)", fsdp_config["xla_fsdp_grad_ckpt"], -(-tokens // chips)
    return "XLA FSDP v1", fsdp_config["xla_fsdp_grad_ckpt"], tokens


def load_spmd_checkpoint(model: torch.nn.Module, checkpoint: str) -> None:
    """Load an XLA FSDP v2 checkpoint's weights into ``model`` (not yet wrapped), every tensor required.

    Trainer saves the wrapped model's state dict (names with ``_orig_module``) and loads it non-strictly into
    the model before it is wrapped, where no name matches: a resumed run would silently restart from the
    initial adapter. Here the names are unwrapped first.
    """
    from pathlib import Path  # lazy: only resuming on XLA reads files here

    state_dict = torch.load(Path(checkpoint) / "pytorch_model.bin", map_location="cpu", weights_only=True)
    state_dict = {_unwrapped_name(name): tensor for name, tensor in state_dict.items()}
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if missing or unexpected:
        names = [*missing, *unexpected]
        raise RuntimeError(f"{checkpoint}: {len(names)} tensors do not match the model (e.g. {names[0]})")
