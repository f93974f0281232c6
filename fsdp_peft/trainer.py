"""The recipes' `Trainer`: Hugging Face's own, plus FSDP for PEFT, FSDP on CPU, and adapter saving."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
import transformers.trainer
from transformers import Trainer

from fsdp_peft.files import publish_directory
from fsdp_peft.fsdp import FsdpLayoutReport, cpu_fsdp_requested, enable_cpu_fsdp, skip_sync_module_states
from fsdp_peft.generation import is_sharded
from fsdp_peft.policies import configure_fsdp_for_peft, register_generate


@contextlib.contextmanager
def _trainer_peft_update_replaced():
    """Trainer's own FSDP1-only PEFT update would overwrite `configure_fsdp_for_peft`: skip it meanwhile."""
    original = transformers.trainer.update_fsdp_plugin_peft
    transformers.trainer.update_fsdp_plugin_peft = lambda model, accelerator: None
    try:
        yield
    finally:
        transformers.trainer.update_fsdp_plugin_peft = original


class PeftFsdpTrainer(Trainer):
    """`transformers.Trainer` with FSDP settings for PEFT, real FSDP in the CPU mode, adapter saving."""

    def __init__(self, *args, fsdp_reduce_dtype: torch.dtype = torch.float32, callbacks=None, **kwargs):
        self.fsdp_reduce_dtype = fsdp_reduce_dtype
        super().__init__(*args, callbacks=[FsdpLayoutReport(), *(callbacks or [])], **kwargs)

    def create_accelerator_and_postprocess(self):
        if cpu_fsdp_requested(self.args):
            skip_sync_module_states(self.args)
        super().create_accelerator_and_postprocess()
        if enable_cpu_fsdp(self.accelerator, self.args):
            self.is_fsdp_enabled = True

    def _prepare_for_training(self, *args, **kwargs):
        if self.is_fsdp_enabled and not is_sharded(self.model):
            configure_fsdp_for_peft(self.model, self.accelerator, self.fsdp_reduce_dtype)
        with _trainer_peft_update_replaced():
            prepared = super()._prepare_for_training(*args, **kwargs)
        register_generate(self.model)
        return prepared

    def save_adapter(self, directory: str | os.PathLike) -> Path:
        """Save the trained adapter in PEFT format, gathered from all shards; collective on every rank.

        Trainer's own ``save_model`` writes nothing under ``SHARDED_STATE_DICT``. Only trainable
        parameters are gathered, and the directory appears only once complete (written beside it, then
        renamed).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        directory = Path(directory)
        on_accelerator = self.args.device.type != "cpu"
        options = StateDictOptions(full_state_dict=True, cpu_offload=on_accelerator, ignore_frozen_params=True)
        if self.is_fsdp_enabled:
            state_dict = get_model_state_dict(self.model, options=options)
        else:
            state_dict = {k: v.detach().cpu() for k, v in self.model.named_parameters() if v.requires_grad}
        if self.args.should_save:
            with publish_directory(directory, replace=True) as staging:
                self.accelerator.unwrap_model(self.model).save_pretrained(staging, state_dict=state_dict)
        if dist.is_initialized():
            dist.barrier()
        return directory
