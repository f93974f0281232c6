"""accelerate's FSDP preparation, checkpoints and state, patched for PEFT and for memory."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType

from fsdp_peft.core._compat.registry import patch
from fsdp_peft.core.errors import ConfigError


@patch("accelerate")
@contextlib.contextmanager
def context_parallel_hooks_skipped(accelerator):
    """Replaces ``Accelerator._prepare_cp`` of ``accelerator`` with a pass-through while the model is prepared.

    Why: sequence parallelism (`fsdp_peft.parallel.sequence_parallel`) takes accelerate's context-parallel mesh, data
    split and loss scaling, but not its ring attention; accelerate 1.15's ``_prepare_cp`` hooks every
    ``self_attn`` to drop its attention mask for good, which would make left-padded generation and evaluation
    attend to padding. Ulysses splits and masks inside its own attention, only while a split is active.
    Remove when: accelerate attaches those hooks only inside its context-parallel context.
    """
    accelerator._prepare_cp = lambda *args: args
    try:
        yield
    finally:
        del accelerator._prepare_cp


@patch("accelerate")
@contextlib.contextmanager
def fsdp1_adapter_checkpoints(trainable_names: list[str], adapter: str):
    """Replaces accelerate's FSDP model-state selection and transformers' FSDP optimizer loading, for FSDP1
    sharded checkpoints (``SHARDED_STATE_DICT``) of a PEFT model, so they hold and restore the adapter and its
    optimizer state.

    Why, two gaps in accelerate 1.15's FSDP1 path:
    - accelerate selects a PEFT model's checkpoint tensors through peft, which finds adapter tensors by module
      names; FSDP1's wrappers change those names, so none were found and none saved. Here they are selected by
      their unwrapped names and stored under peft's keys (adapter name dropped), the keys FSDP2 checkpoints have.
    - accelerate loads FSDP1 optimizer state into a template made from the optimizer's current state, which is
      empty before the first step, so nothing was restored and Adam restarted from zero
      (docs/compat.md#the-measurements). Here the template comes from the checkpoint's own metadata.
    Remove when: accelerate selects FSDP1 adapter tensors by unwrapped names and loads optimizer state from
    the checkpoint's metadata.
    """
    import accelerate.utils.fsdp_utils as fsdp_utils  # lazy: patch target, resolved when patched
    import transformers.trainer  # lazy: patch target, resolved when patched

    # the adapter name dropped, inside a name or at its end (``trainable_tokens_delta.default``)
    by_key = {re.sub(rf"\.{re.escape(adapter)}(?=\.|$)", "", name): name for name in trainable_names}
    original_get, original_set = fsdp_utils._get_model_state_dict, fsdp_utils._set_model_state_dict
    original_load_optimizer = transformers.trainer.load_fsdp_optimizer

    def fsdp1_sharded(model, adapter_only: bool, sd_options) -> bool:
        if not adapter_only or sd_options is not None or not isinstance(model, FSDP):  # options mean FSDP2
            return False
        return FSDP.get_state_dict_type(model).state_dict_type == StateDictType.SHARDED_STATE_DICT

    def get_model_state_dict(model, adapter_only=False, sd_options=None):
        if not fsdp1_sharded(model, adapter_only, sd_options):
            return original_get(model, adapter_only=adapter_only, sd_options=sd_options)
        state = model.state_dict()
        return {key: state[name] for key, name in by_key.items() if name in state}

    def set_model_state_dict(model, state_dict, adapter_only=False, sd_options=None):
        if not fsdp1_sharded(model, adapter_only, sd_options):
            return original_set(model, state_dict, adapter_only=adapter_only, sd_options=sd_options)
        missing = sorted(set(by_key) - set(state_dict))
        if missing:
            raise ConfigError(
                f"checkpoint lacks {len(missing)} adapter tensors (e.g. {missing[0]}); it cannot be resumed"
            )
        return model.load_state_dict({by_key[key]: value for key, value in state_dict.items()}, strict=False)

    def load_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, input_dir, **kwargs):
        if fsdp_plugin.fsdp_version != 1 or fsdp_plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT:
            return original_load_optimizer(fsdp_plugin, accelerator, optimizer, model, input_dir, **kwargs)
        accelerator.wait_for_everyone()
        configs = (fsdp_plugin.state_dict_config, fsdp_plugin.optim_state_dict_config)
        with FSDP.state_dict_type(model, fsdp_plugin.state_dict_type, *configs):
            reader = dcp.FileSystemReader(str(Path(input_dir) / f"{fsdp_utils.OPTIMIZER_NAME}_0"))
            state = load_sharded_optimizer_state_dict(model.state_dict(), "optimizer", reader)["optimizer"]
            optimizer.load_state_dict(
                FSDP.optim_state_dict_to_load(model=model, optim=optimizer, optim_state_dict=state)
            )
        accelerator.wait_for_everyone()

    fsdp_utils._get_model_state_dict, fsdp_utils._set_model_state_dict = get_model_state_dict, set_model_state_dict
    transformers.trainer.load_fsdp_optimizer = load_fsdp_optimizer
    try:
        yield
    finally:
        fsdp_utils._get_model_state_dict, fsdp_utils._set_model_state_dict = original_get, original_set
        transformers.trainer.load_fsdp_optimizer = original_load_optimizer


@patch("accelerate")
@contextlib.contextmanager
def fsdp2_prepare_model_replaced(replacement: Callable[[Callable], Callable]):
    """Replaces ``accelerate.accelerator.fsdp2_prepare_model`` by ``replacement(original)`` meanwhile.

    Why: low-memory loading (`fsdp_peft.model.loading.weights_loaded_after_sharding`) streams the weights into a
    skeleton right after FSDP2 sharded it, inside `Accelerator.prepare`; accelerate's own
    ``cpu_ram_efficient_loading`` skips models holding bitsandbytes ``Params4bit`` (every rank then holds a
    full 4-bit copy while loading).
    Remove when: accelerate's low-memory loading handles bitsandbytes 4-bit (accelerate PR #3987).
    """
    import accelerate.accelerator as accelerate_module  # lazy: patch target, resolved when patched

    original = accelerate_module.fsdp2_prepare_model
    accelerate_module.fsdp2_prepare_model = replacement(original)
    try:
        yield
    finally:
        accelerate_module.fsdp2_prepare_model = original


@patch("accelerate")
@contextlib.contextmanager
def originals_released_while_sharding():
    """Meanwhile accelerate's FSDP2 preparation frees each unit's unsharded weights as ``fully_shard`` replaces them.

    Why: accelerate takes ``model.state_dict()`` before sharding and holds it until it returns, though only its
    low-memory branch (``cpu_ram_efficient_loading`` without 4-bit weights) reads it: every unsharded weight stays
    allocated beside the new shards, so each rank peaks at its whole model plus its shards
    (docs/compat.md#the-measurements). The state dict is empty here unless that branch will read it.
    Remove when: accelerate takes the state dict in its low-memory branch only.
    """

    def releasing(original):
        def prepare(accelerator, model):
            plugin = accelerator.state.fsdp_plugin
            four_bit = any(type(p).__name__ == "Params4bit" for p in model.parameters())
            if plugin.cpu_ram_efficient_loading and not four_bit:  # accelerate's low-memory branch reads it
                return original(accelerator, model)
            model.state_dict = lambda *args, **kwargs: {}  # an instance attribute over the method, this call only
            try:
                return original(accelerator, model)
            finally:
                del model.state_dict

        return prepare

    with fsdp2_prepare_model_replaced(releasing):
        yield


@patch("accelerate")
def state_switched_to_fsdp(state, fsdp_version: int) -> None:
    """Sets accelerate's ``distributed_type`` to FSDP in both the `AcceleratorState` and the shared
    ``PartialState._shared_state`` (every later ``AcceleratorState()`` re-copies the latter).

    Why: accelerate builds FSDP state only on accelerators; a CPU launch asking for FSDP silently becomes
    DDP. FSDP1 also compares its compute device ``cpu`` with accelerate's ``cpu:0``, so the device is set too.
    Remove when: accelerate supports FSDP on CPU over gloo.
    """
    from accelerate import PartialState  # lazy: patch target, resolved when patched
    from accelerate.utils import DistributedType  # lazy: patch target, resolved when patched

    for values in (state.__dict__, PartialState._shared_state):
        values["distributed_type"] = DistributedType.FSDP
        if fsdp_version == 1:
            values["device"] = torch.device("cpu")
