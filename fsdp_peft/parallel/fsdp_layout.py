"""How the model was wrapped: its FSDP units, each stored parameter's shard and dtype, and the report of both.

`FsdpLayoutReport` writes ``fsdp_layout.json`` after the first optimizer step and logs the one line a run
prints about its sharding (``FSDP units: 7; sharded parameters: 95/95``); the tests read the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

from fsdp_peft.core.log import logger


def unit_name(name: str) -> str:
    """A module or parameter name with FSDP1's wrapper components removed."""
    return name.replace("_fsdp_wrapped_module.", "").removesuffix("._fsdp_wrapped_module")


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any module of ``model`` is an FSDP unit (its forwards then need every rank)."""
    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def fsdp_units(model: torch.nn.Module) -> list[str]:
    """The FSDP units, each named by its module(s); ``""`` is the root.

    An FSDP2 unit can span several modules (one ``fully_shard`` call on a list, as accelerate does for
    tied embeddings and head): those are joined with ``+``.
    """
    units: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            units.setdefault(id(module._get_fsdp_state()), []).append(unit_name(name))
        elif isinstance(module, FullyShardedDataParallel):
            units.setdefault(id(module), []).append(unit_name(name))
    return ["+".join(names) for names in units.values()]


def device_mesh_layout(model: torch.nn.Module) -> dict | None:
    """The FSDP2 device mesh: dimension names, sizes, and the global ranks laid out along them (HSDP: 2-D)."""
    for parameter in model.parameters():
        if isinstance(parameter, DTensor):
            mesh = parameter.device_mesh
            names = list(mesh.mesh_dim_names or ())
            return {"dim_names": names, "shape": list(mesh.shape), "ranks": mesh.mesh.tolist()}
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parameter_layout(model: torch.nn.Module) -> list[dict]:
    """Per stored parameter (FSDP1: per flat parameter, with the tensors it ``holds``): dtype, trainable, full
    and local shape, placement."""
    layout = []
    for name, parameter in model.named_parameters():
        is_dtensor = isinstance(parameter, DTensor)
        if not is_dtensor and parameter.untyped_storage().size() == 0:
            continue  # FSDP1: a view of a freed gathered flat parameter (bitsandbytes re-registers those)
        local = parameter.to_local() if is_dtensor else parameter
        full = getattr(parameter, "_unpadded_unsharded_size", parameter.shape)  # FSDP1 flat parameters
        layout.append(
            {
                "name": unit_name(name),
                "dtype": _dtype_name(parameter.dtype),
                "trainable": parameter.requires_grad,
                "shape": list(full),
                "local_shape": list(local.shape),
                "placements": [str(p) for p in parameter.placements] if is_dtensor else None,
            }
        )
        if hasattr(parameter, "_fqns"):  # FSDP1 flat parameter: the tensors flattened into it, by module path
            layout[-1]["holds"] = [unit_name(f"{name.removesuffix('_flat_param')}{fqn}") for fqn in parameter._fqns]
    return layout


class FsdpLayoutReport(TrainerCallback):
    """Writes ``fsdp_layout.json`` after the first optimizer step, as seen from rank 0.

    It holds the device mesh (FSDP2); the FSDP units; each stored parameter's dtype, shape and shard; the
    dtype every parameter has inside its module's forward (what FSDP gathered and computes with); and the
    gradient dtypes.
    """

    def __init__(self):
        self.gathered: dict[str, str] = {}
        self.gradients: dict[str, str] = {}
        self.hooks: list = []
        self.written = False

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        for name, module in model.named_modules():
            if next(module.parameters(recurse=False), None) is not None:
                self.hooks.append(module.register_forward_pre_hook(self._record_gathered(unit_name(name))))

    def _record_gathered(self, prefix: str):
        def hook(module, inputs):
            for name, parameter in module.named_parameters(recurse=False):
                self.gathered.setdefault(f"{prefix}.{name}".lstrip("."), _dtype_name(parameter.dtype))

        return hook

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.gradients:
            for name, parameter in model.named_parameters():
                if parameter.grad is not None:
                    self.gradients[unit_name(name)] = _dtype_name(parameter.grad.dtype)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.written:
            return
        self.written = True
        for hook in self.hooks:
            hook.remove()
        units, layout, mesh = fsdp_units(model), parameter_layout(model), device_mesh_layout(model)
        if not state.is_world_process_zero:
            return
        report = {
            "world_size": args.world_size,
            "mesh": mesh,
            "units": units,
            "parameters": layout,
            "gathered_dtypes": self.gathered,
            "gradient_dtypes": self.gradients,
        }
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.output_dir) / "fsdp_layout.json").write_text(json.dumps(report, indent=1))
        if units:
            sharded = sum(1 for p in layout if p["local_shape"] != p["shape"])
            logger.info(f"FSDP units: {len(units)}; sharded parameters: {sharded}/{len(layout)}")
