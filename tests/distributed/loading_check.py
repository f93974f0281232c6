"""Run under ``accelerate launch`` (FSDP2): load, shard and train a LoRA or QLoRA model with `PeftFsdpTrainer`.

Each rank samples its own resident memory (RSS) from just before the model is built until training
begins (the loading phase: build or read, attach adapters, shard), writes its local parameter shards
to ``<out>/shards-rank<r>.pt`` and its RSS samples, and rank 0 prints one JSON line: the logged
losses, the FSDP settings in force, whether low-memory loading was used, and each rank's samples.

    accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml [--fsdp_cpu_ram_efficient_loading true] \
        tests/distributed/loading_check.py --out DIR [--model PATH] [--qlora] [--steps N] [--no-train] \
        [--keep-originals]
"""

import argparse
import json
import os
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from transformers import TrainerCallback, TrainingArguments, set_seed

from fsdp_peft.core._compat.torch_patches import fsdp_param_groups
from fsdp_peft.core.distributed import start_process_group
from fsdp_peft.model.loading import low_memory_loading_requested
from fsdp_peft.model.modeling import attach_lora, load_base_model
from fsdp_peft.procedures.trainer import PeftFsdpTrainer
from fsdp_peft.settings.config import RecipeArguments

start_process_group()  # the group the Trainer then uses, torn down at exit while the interpreter is whole

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--model", default="tiny-llama")
parser.add_argument("--qlora", action="store_true")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--no-train", action="store_true", help="stop once the model is loaded and sharded")
parser.add_argument("--gradient-checkpointing", action="store_true")
parser.add_argument(
    "--keep-originals", action="store_true", help="accelerate's sharding as released: no originals freed meanwhile"
)
cli = parser.parse_args()
if cli.keep_originals:
    import contextlib

    import fsdp_peft.parallel.shard

    fsdp_peft.parallel.shard.originals_released_while_sharding = contextlib.nullcontext


class RssSampler:
    """This process's resident memory (Linux ``/proc/self/statm``) every 2 ms, time-stamped, until stopped:
    all of it (RSS), and without file-backed pages (memory-mapped checkpoint pages, shared between ranks
    and counted in each one's RSS). No samples where there is no ``/proc``."""

    STATM = "/proc/self/statm"

    def __init__(self):
        self.samples, self.running = [], os.path.exists(self.STATM)
        self.page = os.sysconf("SC_PAGE_SIZE") if self.running else 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def mark(self):
        with open(self.STATM) as statm:
            _, resident, file_backed = (int(field) * self.page for field in statm.read().split()[:3])
        self.samples.append((time.time(), resident, resident - file_backed))  # all, and anonymous only

    def _run(self):
        while self.running:
            self.mark()
            time.sleep(0.002)

    def stop(self):
        if self.running:
            self.running = False
            self.thread.join()
            self.mark()


class StopAtTrainBegin(TrainerCallback):
    """Ends the loading phase (the model is sharded and filled) and, with --no-train, the run."""

    def __init__(self, sampler):
        self.sampler = sampler

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.sampler.stop()
        self.offload = type(self.trainer.accelerator.state.fsdp_plugin.cpu_offload).__name__
        self.activation_checkpointing = self.trainer.accelerator.state.fsdp_plugin.activation_checkpointing
        self.checkpoint_wrappers = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
        self.devices = sorted({str(p.device) for p in model.parameters()})
        states = [m._get_fsdp_state() for m in model.modules() if hasattr(m, "_get_fsdp_state")]
        groups = [group for state in states for group in fsdp_param_groups(state)]
        self.offloaded = sum(fsdp_param.offload_to_cpu for group in groups for fsdp_param in group.fsdp_params)
        self.layer_forwards = 0
        # a pre-hook: a recomputation stops once it has what backward needs, before the layer's end
        attention = next(m for n, m in model.named_modules() if ".layers.0." in n and n.endswith(".self_attn"))
        attention.register_forward_pre_hook(lambda *args: setattr(self, "layer_forwards", self.layer_forwards + 1))
        if cli.no_train:
            control.should_training_stop = True


recipe = RecipeArguments(
    model_name_or_path=cli.model,
    load_in_4bit=cli.qlora,
    torch_dtype="bfloat16" if cli.qlora else "float32",
    lora_r=8,
    lora_dropout=0.0,
)
training = TrainingArguments(
    output_dir=cli.out,
    max_steps=1 if cli.no_train else cli.steps,
    per_device_train_batch_size=2,
    learning_rate=1e-2,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    bf16=cli.qlora,
    seed=7,
    gradient_checkpointing=cli.gradient_checkpointing,
    disable_tqdm=True,
    use_cpu=not torch.accelerator.is_available(),
)
import bitsandbytes  # noqa: E402,F401  imported before the baseline: library code is not model memory

set_seed(training.seed)
sampler = RssSampler()
model = attach_lora(load_base_model(recipe), recipe, training)
generator = torch.Generator().manual_seed(0)
vocab = model.config.vocab_size
rows = [torch.randint(0, vocab, (16,), generator=generator) for _ in range(4 * training.world_size * cli.steps)]
data = [{"input_ids": row, "labels": row} for row in rows]
stop = StopAtTrainBegin(sampler)
trainer = PeftFsdpTrainer(model=model, args=training, train_dataset=data, callbacks=[stop])
stop.trainer = trainer
sampler.mark()
training_called = time.time()  # the samples after it: Trainer's preparation (sharding) until training begins
trainer.train()

rank = dist.get_rank()
samples = [None] * dist.get_world_size()
dist.all_gather_object(samples, sampler.samples)
called = [None] * dist.get_world_size()
dist.all_gather_object(called, training_called)
if rank == 0:
    report = {
        "low_memory_loading": low_memory_loading_requested(),
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "offload": stop.offload,
        "parameter_devices": stop.devices,
        "activation_checkpointing": stop.activation_checkpointing,
        "checkpoint_wrappers": stop.checkpoint_wrappers,
        "offloaded_parameters": stop.offloaded,
        "layer_0_attention_forwards": stop.layer_forwards,
        "rss_samples": samples,
        "training_called": called,  # each rank's
    }
    print(json.dumps(report))
if cli.no_train:
    raise SystemExit(0)
shards = {}
for name, parameter in trainer.model.named_parameters():
    local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
    shards[name] = local.detach().cpu().clone()
quant_states = {}
for name, module in trainer.model.named_modules():
    state = getattr(module, "quant_state", None)
    if state is not None:
        quant_states[name] = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in state.as_dict(packed=True).items()}
torch.save({"parameters": shards, "quant_states": quant_states}, os.path.join(cli.out, f"shards-rank{rank}.pt"))
