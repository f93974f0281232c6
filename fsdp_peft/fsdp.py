"""FSDP plumbing around the Hugging Face `Trainer`: the CPU mode, and a report of how the model was wrapped.

CPU mode. Accelerate builds FSDP state only on accelerators: a CPU launch whose config says
``distributed_type: FSDP`` silently becomes DDP. `enable_cpu_fsdp` finishes the job accelerate started:
when FSDP was asked for (accelerate config or ``fsdp`` in the recipe YAML) and accelerate fell back to
``MULTI_CPU``, it installs the same `FullyShardedDataParallelPlugin` accelerate would have built and
switches the state to FSDP. From there the unchanged Trainer and accelerate FSDP code runs over gloo.
A launcher's parallelism config (HSDP: ``dp_replicate_size`` x ``dp_shard_size``) is applied the same way:
accelerate refuses it on a ``MULTI_CPU`` state, so it is held back while the `Accelerator` is built and
its device mesh is built on "cpu" once the state is FSDP. On GPUs accelerate already chose FSDP and built
the mesh, and these functions do nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator, ParallelismConfig
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback, TrainingArguments

from fsdp_peft._compat import state_switched_to_fsdp
from fsdp_peft.launch import fsdp_settings
from fsdp_peft.log import logger


def fsdp_requested(args: TrainingArguments) -> bool:
    """Whether the recipe YAML or the accelerate launcher asked for FSDP."""
    return fsdp_settings(args) is not None


def cpu_fsdp_requested(args: TrainingArguments) -> bool:
    """FSDP asked for on a machine without an accelerator: the CPU mode."""
    return fsdp_requested(args) and not torch.accelerator.is_available()


def skip_sync_module_states(args: TrainingArguments) -> None:
    """Switch off FSDP1's ``sync_module_states`` for the CPU mode; call before the `Accelerator` exists.

    Accelerate resolves that setting to an accelerator device and FSDP1 refuses it for CPU parameters.
    It only matters when ranks other than 0 start without weights (``cpu_ram_efficient_loading``);
    in the CPU mode every rank loads the same checkpoint with the same seed, so nothing is lost.
    """
    os.environ["FSDP_SYNC_MODULE_STATES"] = "false"
    if args.fsdp_plugin_args is not None:
        args.fsdp_plugin_args["sync_module_states"] = False


USE_PARALLELISM_CONFIG = "ACCELERATE_USE_PARALLELISM_CONFIG"  # set by `accelerate launch` for a parallelism_config


@contextlib.contextmanager
def parallelism_config_held_back(args: TrainingArguments):
    """In the CPU mode, hide the launcher's parallelism config from the `Accelerator` being built.

    Accelerate validates it against the state it builds, ``MULTI_CPU`` on a CPU, and refuses it;
    `enable_cpu_fsdp` applies it once the state is FSDP.
    """
    held = os.environ.pop(USE_PARALLELISM_CONFIG, None) if cpu_fsdp_requested(args) else None
    try:
        yield
    finally:
        if held is not None:
            os.environ[USE_PARALLELISM_CONFIG] = held


def enable_cpu_fsdp(accelerator: Accelerator, args: TrainingArguments) -> bool:
    """Turn accelerate's silent CPU fallback to DDP into real FSDP; returns whether it did."""
    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU or not fsdp_requested(args):
        return False
    plugin = FullyShardedDataParallelPlugin(**(args.fsdp_plugin_args or {}))
    unpinned_cpu_offload(plugin)
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state_switched_to_fsdp(state, plugin.fsdp_version)
    state.fsdp_plugin = plugin
    if os.environ.get(USE_PARALLELISM_CONFIG, "false").lower() == "true":
        apply_parallelism_config_on_cpu(accelerator)
    return True


def unpinned_cpu_offload(plugin: FullyShardedDataParallelPlugin) -> None:
    """FSDP2 offloading in the CPU mode: the same policy without pinned memory, which needs an accelerator.

    Shards, gradients and optimizer state then stay on the CPU, as offloading keeps them on GPUs, and
    FSDP runs its offloading code path (copies to the CPU are no-ops here).
    """
    if plugin.fsdp_version == 2 and isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)


def apply_parallelism_config_on_cpu(accelerator: Accelerator) -> None:
    """What `Accelerator` does with a launcher's parallelism config on GPUs, on a "cpu" device mesh."""
    config = ParallelismConfig()  # sizes from the launcher's PARALLELISM_CONFIG_* variables
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.get_device_mesh("cpu")
    config._validate_accelerator(accelerator)


def gathered_from_every_rank(value) -> list:
    """``value`` of every rank, in rank order (``[value]`` without a process group); collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


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
