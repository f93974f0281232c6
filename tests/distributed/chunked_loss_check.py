"""Run under torchrun (2 gloo ranks): the recipes' trainer with the chunked loss vs the model's own loss.

Under FSDP1 and FSDP2 and for two data setups (packed rows with answer-only labels, gradient
checkpointing and 2 accumulation steps; padded rows with answer-only labels), trains the embedded model
(fp32 LoRA, lora_B drawn nonzero so every adapter gradient is nonzero from the first step) for 2 SGD
steps twice, ``loss_chunk_tokens`` 0 and 7, from the same seed, and records every micro-batch loss and
every local gradient shard before each optimizer step (SGD: the second step starts from parameters that
differ only by the learning rate times the first step's gradient difference). Under FSDP2 it also counts
the all-gathers of the unit that holds the output head. Prints one JSON line on rank 0.
"""

import json
import sys

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from transformers import TrainerCallback, set_seed

from fsdp_peft.core.distributed import start_process_group
from fsdp_peft.data.cache import load_data
from fsdp_peft.data.packing import data_collator
from fsdp_peft.model.modeling import attach_lora, load_base_model, load_tokenizer
from fsdp_peft.procedures.trainer import PeftFsdpTrainer
from fsdp_peft.settings.config import RecipeArguments, build_training_arguments

start_process_group()  # the group the Trainer then uses, torn down at exit while the interpreter is whole
OUT = sys.argv[sys.argv.index("--out") + 1]
SETUPS = {
    "packing": {"packing": True, "gradient_checkpointing": True, "gradient_accumulation_steps": 2},
    "padded": {"packing": False, "gradient_checkpointing": False, "gradient_accumulation_steps": 1},
}
head_gathers = 0
original_unshard = FSDPParamGroup.unshard


def counting_unshard(group, *args, **kwargs):
    """Count the all-gathers of the unit holding the output head (FSDP2)."""
    global head_gathers
    if not group.is_unsharded and any(p._param_fqn.endswith("lm_head.weight") for p in group.fsdp_params):
        head_gathers += 1
    return original_unshard(group, *args, **kwargs)


FSDPParamGroup.unshard = counting_unshard


class Recorder(TrainerCallback):
    def __init__(self):
        self.gradients = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        shards = {}
        for name, parameter in model.named_parameters():
            if parameter.grad is not None:
                grad = parameter.grad
                shards[name] = (grad.to_local() if hasattr(grad, "to_local") else grad).detach().clone()
        self.gradients.append(shards)


class RecordingTrainer(PeftFsdpTrainer):
    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.losses.append(loss.item())
        return loss


def run(version: int, setup: dict, chunk: int) -> dict:
    global head_gathers
    AcceleratorState._reset_state(reset_partial_state=False)
    head_gathers = 0
    recipe = RecipeArguments(
        torch_dtype="float32", lora_r=8, lora_dropout=0.0, max_seq_length=64, packing=setup["packing"]
    )
    training = build_training_arguments(
        {
            "output_dir": OUT,
            "max_steps": 2,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": setup["gradient_accumulation_steps"],
            "gradient_checkpointing": setup["gradient_checkpointing"],
            "learning_rate": 1e-2,
            "optim": "sgd",
            "save_strategy": "no",
            "report_to": [],
            "seed": 3,
            "disable_tqdm": True,
            "use_cpu": True,
            "fsdp": "full_shard auto_wrap",
            "fsdp_config": {"version": version, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        },
        "chunked_loss_check",
    )
    tokenizer = load_tokenizer(recipe)  # builds the embedded model on first use, drawing random numbers
    set_seed(training.seed)
    model = attach_lora(load_base_model(recipe, training), recipe, training)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.02)
    train_data, _, _ = load_data(recipe, tokenizer, training)
    recorder = Recorder()
    trainer = RecordingTrainer(
        model=model,
        args=training,
        train_dataset=train_data,
        data_collator=data_collator(recipe, tokenizer),
        callbacks=[recorder],
        loss_chunk_tokens=chunk,
    )
    trainer.losses = []
    trainer.train()
    return {
        "losses": trainer.losses,
        "gradients": recorder.gradients,
        "head_gathers": head_gathers,
        "chunked": trainer.loss_chunk_tokens,
    }


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())


def compare(full: dict, chunked: dict) -> dict:
    """Worst relative differences over both ranks: losses, all adapter gradients of a step, and per tensor."""
    loss_error = max(abs(c - f) / abs(f) for c, f in zip(chunked["losses"], full["losses"], strict=True))
    steps = list(zip(chunked["gradients"], full["gradients"], strict=True))
    per_tensor = [relative(step_c[key], step_f[key]) for step_c, step_f in steps for key in step_f]
    squares = torch.tensor(
        [[float(sum((c[k] - f[k]).norm() ** 2 for k in f)), float(sum(f[k].norm() ** 2 for k in f))] for c, f in steps],
        dtype=torch.float64,
    )
    dist.all_reduce(squares)
    worst = torch.tensor([loss_error, max(per_tensor)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    nonzero = torch.tensor([sum(float(g.norm()) > 0 for step in full["gradients"] for g in step.values())])
    dist.all_reduce(nonzero)
    return {
        "micro_batches": len(full["losses"]),
        "optimizer_steps": len(steps),
        "gradient_shards": len(per_tensor) * dist.get_world_size(),
        "nonzero_gradient_shards": int(nonzero),
        "loss_relative_error": worst[0].item(),
        "gradient_relative_error": (squares[:, 0] / squares[:, 1]).sqrt().max().item(),
        "worst_tensor_relative_error": worst[1].item(),
        "chunk_tokens": [full["chunked"], chunked["chunked"]],
        "head_gathers": [full["head_gathers"], chunked["head_gathers"]],
        "losses": [full["losses"], chunked["losses"]],
    }


report = {}
for version in (1, 2):
    for name, setup in SETUPS.items():
        report[f"fsdp{version}_{name}"] = compare(run(version, setup, 0), run(version, setup, 7))
if dist.get_rank() == 0:
    print(json.dumps(report))
