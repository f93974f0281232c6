"""Greedy tokens from the SPMD-sharded model, sharded as the recipes' Trainer shards it, and from the same
model unsharded on the CPU, for the same prompts. Prints one JSON object.

Usage (with ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N``): ``python tests/xla/sharded_generation.py ADAPTER_DIR``.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments
from transformers.integrations.tpu import wrap_model_xla_fsdp

from fsdp_peft.core.xla import expose_generate, parameter_shardings, prepare_for_xla_fsdp, xla_fsdp_config
from fsdp_peft.model.paths import tiny_model_path
from fsdp_peft.parallel.fsdp_policies import decoder_layer_classes

PROMPTS = ["reverse: nkojg", "reverse: uzpjm", "reverse: tcdoc", "reverse: sonip"]
NEW_TOKENS = 6

xr.use_spmd()
devices = xr.global_runtime_device_count()
xs.set_global_mesh(xs.Mesh(np.array(range(devices)), (devices, 1), axis_names=("fsdp", "tensor")))  # as Trainer


def trained_model() -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32)
    return PeftModel.from_pretrained(base, sys.argv[1]).eval()


def greedy(model, device) -> list[list[int]]:
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    with torch.no_grad():
        output = model.generate(
            **encoded, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return output[:, encoded["input_ids"].shape[1] :].cpu().tolist()


tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
tokenizer.padding_side = "left"
unsharded = greedy(trained_model(), torch.device("cpu"))
args = TrainingArguments(output_dir="/tmp/unused", fsdp=True, fsdp_config=xla_fsdp_config({}), report_to="none")
model = trained_model()
prepare_for_xla_fsdp(model, args, decoder_layer_classes(model))
sharded_model = wrap_model_xla_fsdp(model, args, True)
expose_generate(sharded_model)
sharded = greedy(sharded_model, torch.device("xla"))
shardings = parameter_shardings(sharded_model)
print(json.dumps({"devices": devices, "sharded": sharded, "unsharded": unsharded, "shardings": shardings}))
