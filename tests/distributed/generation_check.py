"""Run under torchrun (2 gloo ranks): generation from an FSDP2-sharded LoRA model under gather budgets.

Prints one JSON line on rank 0 with, per budget, the completions (as token ids) and the FSDP
all-gathers each ``generate_completions`` call made on rank 0, the reference completions (each
prompt alone, unsharded, before sharding), and the all-gathers of a training step before and after.
"""

import json

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import DTensor

from fsdp_peft.core.distributed import release_process_group, start_process_group
from fsdp_peft.model.modeling import load_base_model, load_tokenizer
from fsdp_peft.parallel.fsdp_policies import shard_for_generation
from fsdp_peft.settings.config import RecipeArguments
from fsdp_peft.tools.generation import (
    GenerationSettings,
    _budget_agreed_by_all_ranks,
    _fsdp2_units,
    gathered_bytes,
    generate_completions,
)

NEW_TOKENS = 8
start_process_group()  # and torn down at exit, while the interpreter is whole
rank = dist.get_rank()
torch.manual_seed(0)
recipe = RecipeArguments(torch_dtype="float32")
tokenizer = load_tokenizer(recipe)
model = get_peft_model(load_base_model(recipe), LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))
# Completions as token ids: a random adapter emits bytes that are not valid UTF-8 on their own.
tokenizer.batch_decode = lambda rows, **kwargs: [" ".join(map(str, row.tolist())) for row in rows]
prompts = [f"<|user|>{w}<|assistant|>" for w in ("apple", "river", "cloud", "stone", "tiger")]
with torch.no_grad():
    reference = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        out = model.generate(**ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        reference.extend(tokenizer.batch_decode(out[:, ids["input_ids"].shape[1] :]))

shard_for_generation(model, torch.device("cpu"))
units = _fsdp2_units(model)
gathers = [0]
original = _fsdp_param_group.foreach_all_gather


def counting_all_gather(*args, **kwargs):
    gathers[0] += 1
    return original(*args, **kwargs)


_fsdp_param_group.foreach_all_gather = counting_all_gather
batch = tokenizer(prompts, return_tensors="pt", add_special_tokens=False)


def training_step_all_gathers() -> int:
    gathers[0] = 0
    model.train()
    model(**batch, labels=batch["input_ids"]).loss.backward()
    return gathers[0]


before = training_step_all_gathers()
partial = sum(gathered_bytes(unit) for unit in units[:3])  # the root and the first two layers
report = {"reference": reference, "units": len(units), "budgets": {}}
for budget in ("all", "none", f"{partial}B"):
    gathers[0] = 0
    settings = GenerationSettings(NEW_TOKENS, batch_size=2, gather_budget=budget, ignore_eos=True)
    completions = generate_completions(model, tokenizer, prompts, settings, torch.device("cpu"))
    report["budgets"][budget] = {"completions": completions, "all_gathers": gathers[0]}

report["training_step_all_gathers"] = [before, training_step_all_gathers()]
report["all_parameters_sharded_dtensors"] = all(isinstance(p, DTensor) for p in model.parameters())
report["agreed_budget"] = _budget_agreed_by_all_ranks(None if rank == 0 else 12345)
if rank == 0:
    print(json.dumps(report), flush=True)
release_process_group()
