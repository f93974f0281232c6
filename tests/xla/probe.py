"""Run a recipe as ``python recipes/<name>.py ...`` does, and record what XLA FSDP did with it.

Usage: ``python tests/xla/probe.py recipes/llama_lora.py --output_dir DIR ...``. Writes ``DIR/xla_probe.json``:
each parameter's XLA sharding spec once the Trainer has wrapped the model, and which modules went through
torch_xla's activation checkpoint (counted at the call, so a layer the checkpoint wrapper skips is not counted).
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import torch_xla.distributed.fsdp.utils as xla_fsdp_utils

from fsdp_peft.core.xla import parameter_shardings
from fsdp_peft.procedures.trainer import PeftFsdpTrainer

probe: dict = {"shardings": {}, "checkpointed": {}}
original_checkpoint = xla_fsdp_utils.checkpoint


def counting_checkpoint(function, *args, **kwargs):
    layer = function.__self__  # checkpoint_module's bound forward: the layer it checkpoints
    probe["checkpointed"][str(id(layer))] = type(layer).__name__
    return original_checkpoint(function, *args, **kwargs)


original_prepare = PeftFsdpTrainer._prepare_for_training


def prepare_and_record(self, *args, **kwargs):
    prepared = original_prepare(self, *args, **kwargs)
    probe["shardings"] = parameter_shardings(self.model)
    return prepared


xla_fsdp_utils.checkpoint = counting_checkpoint
PeftFsdpTrainer._prepare_for_training = prepare_and_record
recipe, *arguments = sys.argv[1:]
output_dir = Path(arguments[arguments.index("--output_dir") + 1])
sys.argv = [recipe, *arguments]
try:
    runpy.run_path(recipe, run_name="__main__")
finally:
    if output_dir.is_dir():
        (output_dir / "xla_probe.json").write_text(json.dumps(probe, indent=1))
