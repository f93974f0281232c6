"""Run under torchrun (2 gloo ranks): a sharded QLoRA model's loss before, after and between eval forwards.

Prints one JSON line on rank 0: {"guarded": bool, "losses": [train, eval, train-again]}.
With ``--unguarded`` the bitsandbytes CPU repacking guard is switched back off, to show the pitfall.
"""

import json
import sys

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_peft.core.distributed import release_process_group, start_process_group
from fsdp_peft.model.modeling import load_base_model
from fsdp_peft.settings.config import RecipeArguments

start_process_group()  # and torn down at exit, while the interpreter is whole
guarded = "--unguarded" not in sys.argv
base = load_base_model(RecipeArguments(load_in_4bit=True, torch_dtype="bfloat16"))
if not guarded:
    for module in base.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = True
model = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in base.model.layers:
    fully_shard(layer, mp_policy=policy)
fully_shard(model, mp_policy=policy)

torch.manual_seed(0)
input_ids = torch.randint(0, 256, (2, 24))


def loss() -> float:
    with torch.no_grad():
        return model(input_ids=input_ids, labels=input_ids).loss.item()


model.train()
losses = [loss()]
model.eval()
losses.append(loss())
model.train()
losses.append(loss())
if dist.get_rank() == 0:
    print(json.dumps({"guarded": guarded, "losses": losses}))
release_process_group()
