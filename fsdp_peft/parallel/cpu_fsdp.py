"""FSDP on CPUs through the Hugging Face `Trainer`: the CPU mode accelerate lacks.

Accelerate builds FSDP state only on accelerators: a CPU launch whose config says
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
import os

import torch
from accelerate import Accelerator, ParallelismConfig
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.fsdp import CPUOffloadPolicy
from transformers import TrainingArguments

from fsdp_peft.core._compat.accelerate_patches import state_switched_to_fsdp
from fsdp_peft.settings.fsdp_settings import fsdp_settings


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
    """In the CPU mode, hide the parallelism config (the launcher's, or the arguments' for sequence
    parallelism) from the `Accelerator` being built.

    Accelerate validates it against the state it builds, ``MULTI_CPU`` on a CPU, and refuses it;
    `enable_cpu_fsdp` applies it once the state is FSDP.
    """
    if not cpu_fsdp_requested(args):
        yield
        return
    held = os.environ.pop(USE_PARALLELISM_CONFIG, None)
    arguments_config, args.parallelism_config = args.parallelism_config, None
    try:
        yield
    finally:
        args.parallelism_config = arguments_config
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
    if args.parallelism_config is not None:
        apply_parallelism_config_on_cpu(accelerator, args.parallelism_config)
    elif os.environ.get(USE_PARALLELISM_CONFIG, "false").lower() == "true":
        apply_parallelism_config_on_cpu(accelerator, ParallelismConfig())  # sizes from PARALLELISM_CONFIG_*
    return True


def unpinned_cpu_offload(plugin: FullyShardedDataParallelPlugin) -> None:
    """FSDP2 offloading in the CPU mode: the same policy without pinned memory, which needs an accelerator.

    Shards, gradients and optimizer state then stay on the CPU, as offloading keeps them on GPUs, and
    FSDP runs its offloading code path (copies to the CPU are no-ops here).
    """
    if plugin.fsdp_version == 2 and isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)


def apply_parallelism_config_on_cpu(accelerator: Accelerator, config: ParallelismConfig) -> None:
    """What `Accelerator` does with a parallelism config on GPUs, on a "cpu" device mesh."""
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.get_device_mesh("cpu")
    config._validate_accelerator(accelerator)
