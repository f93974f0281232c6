"""Run under torchrun (2 gloo ranks): generation from an FSDP2-sharded LoRA model under gather budgets.

Prints one JSON line on rank 0 with, per budget (and with the decode step compiled under budgets all and none), the
completions (as token ids), the FSDP all-gathers each ``generate_completions`` call made on rank 0, the LoRA layers
that computed merged and the graphs compiled so far; sampled completions, eager and compiled, from one seed; the
reference completions (each prompt alone, unsharded, the adapter unmerged, before sharding); the all-gathers of a
training step before and after; and whether every shard is bit for bit what it was before generating.
"""

import json

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import DTensor

from fsdp_peft.core.distributed import release_process_group, start_process_group
from fsdp_peft.model.modeling import load_base_model, load_tokenizer
from fsdp_peft.parallel.fsdp_policies import shard_for_generation
from fsdp_peft.settings.config import RecipeArguments
from fsdp_peft.tools.decoding import graphs_compiled
from fsdp_peft.tools.generation import (
    GenerationSettings,
    _budget_agreed_by_all_ranks,
    _fsdp2_units,
    gathered_bytes,
    generate_completions,
)

NEW_TOKENS = 8
start_process_group()  # and torn down at exit, while the interpreter is whole
if not dist.is_initialized():  # one rank: FSDP2 on a group of one, as accelerate sets it up on one GPU
    dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
recipe = RecipeArguments(torch_dtype="float32")
tokenizer = load_tokenizer(recipe)
lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)  # scaling 2, not 1
model = get_peft_model(load_base_model(recipe), lora)
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


merged_layers: set[str] = set()  # the LoRA layers that computed merged in a generate call
lora_layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLinear)}
for name, layer in lora_layers.items():  # the base computes in both forms: alone, or inside the LoRA layer
    layer.base_layer.register_forward_pre_hook(
        lambda _m, _a, name=name, lora=layer: merged_layers.add(name) if lora.merged else None
    )
wrapped: set[str] = set()  # merged LoRA layers whose own forward ran: none, their bases stand in their places
for name, layer in lora_layers.items():
    layer.register_forward_pre_hook(lambda module, _a, name=name: wrapped.add(name) if module.merged else None)
modules = dict(model.named_modules())

before = training_step_all_gathers()
shards = {name: p.to_local().clone() for name, p in model.named_parameters()}
partial = sum(gathered_bytes(unit) for unit in units[:3])  # the root and the first two layers
report = {"reference": reference, "units": len(units), "lora_layers": len(lora_layers), "budgets": {}}
runs = (("all", True), ("none", True), (f"{partial}B", True), ("all unmerged", False))
for budget, merged in (*runs, ("all compiled", True), ("none compiled", True)):
    gathers[0] = 0
    merged_layers.clear()
    compiled = "true" if budget.endswith("compiled") else "false"
    settings = GenerationSettings(
        NEW_TOKENS,
        batch_size=2,
        gather_budget=budget.split()[0],
        ignore_eos=True,
        merged_adapter=merged,
        compiled=compiled,
    )
    completions = generate_completions(model, tokenizer, prompts, settings, torch.device("cpu"))
    report["budgets"][budget] = {
        "completions": completions,
        "all_gathers": gathers[0],
        "merged_layers": sorted(merged_layers),
        "graphs": graphs_compiled(),
    }
# Sampled, the same seed: the compiled decode step draws what the eager one draws
report["sampled"] = {}
for compiled in ("false", "true"):
    torch.manual_seed(1234)
    settings = GenerationSettings(
        NEW_TOKENS,
        batch_size=2,
        gather_budget="all",
        ignore_eos=True,
        do_sample=True,
        temperature=0.9,
        compiled=compiled,
    )
    report["sampled"][compiled] = generate_completions(model, tokenizer, prompts, settings, torch.device("cpu"))
report["graphs"] = graphs_compiled()
# Units left gathered by a forward before the call (reshard_after_forward: false) and not kept (budget none): FSDP2
# does not reshard them after the call, so they must stay unmerged; the next forward computes as the one before.
for unit in units[1:]:
    unit.set_reshard_after_forward(False, recurse=False)
model.eval()
with torch.no_grad():
    logits_before = model(**batch).logits
merged_layers.clear()
settings = GenerationSettings(NEW_TOKENS, batch_size=2, gather_budget="none", ignore_eos=True)
completions = generate_completions(model, tokenizer, prompts, settings, torch.device("cpu"))
with torch.no_grad():
    logits_after = model(**batch).logits
report["gathered_before_the_call"] = {
    "completions": completions,
    "merged_layers": sorted(merged_layers),
    "next_forward_unchanged": torch.equal(logits_before, logits_after),
}
for unit in units:
    unit.set_reshard_after_forward(unit is not units[0], recurse=False)
    unit.reshard()
report["shards_unchanged"] = all(torch.equal(p.to_local(), shards[name]) for name, p in model.named_parameters())
report["merged_after"] = [name for name, layer in lora_layers.items() if layer.merged]
report["merged_layers_own_forward"] = sorted(wrapped)
report["modules_unchanged"] = dict(model.named_modules()) == modules
report["training_step_all_gathers"] = [before, training_step_all_gathers()]
report["all_parameters_sharded_dtensors"] = all(isinstance(p, DTensor) for p in model.parameters())
report["agreed_budget"] = _budget_agreed_by_all_ranks(None if rank == 0 else 12345)
if rank == 0:
    print(json.dumps(report), flush=True)
release_process_group()
if dist.is_initialized():
    dist.destroy_process_group()
