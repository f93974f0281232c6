"""The recipes' `Trainer`: Hugging Face's own, plus FSDP on CPU and consolidated adapter saving."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist
from transformers import Trainer

from fsdp_peft.files import publish_directory
from fsdp_peft.fsdp import FsdpLayoutReport, enable_cpu_fsdp
from fsdp_peft.policies import configure_fsdp_for_peft


class PeftFsdpTrainer(Trainer):
    """`transformers.Trainer` with FSDP settings for PEFT, real FSDP in the CPU mode, adapter saving."""

    def __init__(self, *args, callbacks=None, **kwargs):
        super().__init__(*args, callbacks=[FsdpLayoutReport(), *(callbacks or [])], **kwargs)

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if enable_cpu_fsdp(self.accelerator, self.args):
            self.is_fsdp_enabled = True
        configure_fsdp_for_peft(self.accelerator)

    def save_adapter(self, directory: str | os.PathLike) -> Path:
        """Save the trained adapter in PEFT format, gathered from all shards; collective on every rank.

        Trainer's own ``save_model`` writes nothing under ``SHARDED_STATE_DICT``. Only trainable
        parameters are gathered, and the directory appears only once complete (written beside it, then
        renamed).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        directory = Path(directory)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
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
