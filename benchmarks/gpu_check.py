"""GPU check (driven by benchmarks/gpu_check.sh): LoRA and QLoRA on one GPU, fsdp-peft against plain
transformers `Trainer` + peft with the same settings, for a ~1B and an 8B-shaped random-weight Llama; the
GRPO recipe on the ~1B shape: its rollouts against the unsharded model and stock TRL, and a few training steps; and a
random-weight Qwen3-MoE shape: QLoRA with its experts in 4 bits and LoRA on a bf16 base, LoRA on every expert. Before
them, bitsandbytes' 4-bit kernels against a decoder written from the formats' definition.

Each run is its own process (clean peak-memory counters) and trains ``--steps`` optimizer steps on random
token ids (``--seq`` tokens per row, ``--batch`` rows per step, bf16, gradient checkpointing, AdamW, LoRA
r=16 on all linear layers, dropout 0.05):

- ``fsdp-peft``: `fsdp_peft.model.modeling.load_base_model` + `attach_lora` +
`fsdp_peft.procedures.trainer.PeftFsdpTrainer`
  (one GPU: no FSDP; the library's loading, adapter dtypes and trainer);
- ``plain``: ``AutoModelForCausalLM.from_pretrained(quantization_config=...)`` + ``peft.get_peft_model`` +
  ``transformers.Trainer``.

Measured: tokens/s over the steps after the first two (synchronised step times), peak GPU memory
(``torch.cuda.max_memory_allocated`` and ``..._reserved``), model FLOPs utilisation, and the exact
per-rank parameter + gradient + optimizer bytes (`fsdp_peft.procedures.memory.MemoryReport`); next to the planner's
estimate (`fsdp_peft.tools.plan`, CUDA-context row left out, as torch's allocator does not see it); and whether every
logged loss is finite.

MFU = model FLOPs per token x tokens/s / peak dense bf16 FLOPs of the GPU. Model FLOPs per token of
LoRA training: 4 x (frozen matmul parameters, head included) [forward + input gradients] + 6 x (adapter
parameters) + 12 x layers x seq x hidden [attention scores and values, forward and backward]; the
recomputation of gradient checkpointing is not counted (it is not model work). A mixture of experts counts the
experts a token passes: top-k of each layer's expert weights, and that share of its stacked expert adapters.

GRPO runs (``grpo`` in ``--shapes``; `recipes/llama_grpo.py` on the ``--grpo-shape`` model, launched by
`benchmarks/grpo_rollouts.py`'s `run`, which times every rollout call): the embedded reversal prompts, groups of 8,
``completions`` per step of exactly ``completion_tokens`` tokens each (EOS held off), LoRA r=16 (dropout 0) on all
linear layers, bf16, activation checkpointing, ``loss_type: dapo``, ``beta: 0``, the exact-answer reward. Modes,
most important first:

- ``grpo recipe``, LoRA and QLoRA: FSDP2 through accelerate (``configs/accelerate/fsdp2.yaml --num_processes 1``:
  one rank, on one GPU or, in the dry run, the CPU), every unit gathered once per ``generate`` call;
- ``grpo unsharded``: one process, no FSDP (``python recipes/llama_grpo.py``);
- ``grpo stock``: the recipe's launch with ``generate_gather_budget: none``: TRL 1.16's path, each layer gathered
  and freed again at every decoded token (one rank: a copy and an allocation per layer and token, no communication;
  a gather over NCCL between GPUs costs more, which one GPU cannot show).

Measured, over the steps after the first: rollout tokens/s (generated tokens over the rollout calls' time), tokens/s
of the whole step (prompt and completion tokens, TRL's ``num_tokens``) and of its training part (the step less its
rollout call), peak GPU memory of training (rollouts included), the planner's estimate, and whether every logged
loss and reward is finite (random weights never produce the answer: the reward is 0 and so is the DAPO loss; what
is checked is that the steps run and log numbers). The LoRA runs of the three modes give ``grpo_rollouts``: the
recipe's rollout speed over the unsharded model's and over stock TRL's. The dry run keeps to two of the four runs
(`GRPO_DRY_RUNS`) to keep CI's time.

MoE runs (``moe`` in ``--shapes``): the ``fsdp-peft`` SFT run above (`run_one`) on a random-weight Qwen3-MoE
(`models.QWEN3_MOE_SHAPES`: Qwen3-30B-A3B's layer with 8 layers of 64 experts 768 wide, 8 per token, vocab 32k;
2.70B parameters, 2.42B of them in the experts), 4 rows of 2048 tokens per step, LoRA r=16 on attention (``auto``)
and on every expert (``lora_target_parameters: [auto]``), dropout 0 (none on expert parameters). QLoRA first
(``load_in_4bit``: the linear layers through bitsandbytes, the experts by `fsdp_peft.model.moe_quantization`), then LoRA
on the bf16 base; no plain Trainer + peft runs (peft cannot quantize the experts). Measured besides the SFT
figures (peak memory next to the plan, tokens/s, losses finite):

- the experts' bytes as this rank stores them (4-bit: the local bytes of the ``*_4bit`` parameters; bf16: the expert
  parameters) next to the plan's ``counts.expert_bytes`` and to the same experts in bf16; QLoRA must keep them at
  most `EXPERT_BYTES_BOUND` (0.3) of bf16 (the layout gives 0.258): ``expert_bytes_within_bound``;
- ``dequantization`` (QLoRA): `fsdp_peft.model.moe_quantization.dequantize_expert_rows` of the first MoE layer's experts
  (all its expert parameters) against that decoder layer's forward as training runs it (autograd on, bf16 autocast,
  the run's rows x tokens of random hidden states; the forward includes its hook's dequantization), median of 5.

The dry run keeps to the QLoRA run (`MOE_DRY_RUNS`), 3 steps, on the embedded ``tiny-qwen3-moe``.

Vision-language runs (``vlm``): ``recipes/qwen_vl_qlora.py`` then ``qwen_vl_lora.py``, each launched as users
launch it (FSDP2, one rank), on Qwen2.5-VL 7B's shape with random weights (`models.vision_checkpoint_path`: its
published config, the vision tower's 32 blocks included, 8.29B parameters) over the embedded colour task's rows with
their images resized to 448x448 (256 image tokens; a quarter of the rows text only, so the blank-image path of
`fsdp_peft.model.vision` runs too), 8 rows of up to 320 tokens a step, 6 steps, LoRA r=16 on the language model's
projections, activation checkpointing: tokens/s over the whole training (first step included), peak GPU memory next
to the plan, the parameter, gradient and optimizer bytes next to the plan's, losses finite. The dry run: the QLoRA
run on the embedded tiny-qwen2.5-vl, 3 steps.

Sequence-parallel runs (``sp``, `SP_SIZES`; they need 2 GPUs: one GPU skips them and says so in ``skipped``):
``recipes/llama_qlora.py`` on the 8B shape with ``sequence_parallel_size: 2`` on 2 ranks (one group: both train the
same rows, each holding half of every row) and then in one process on the same whole rows, 1 row of 16,384 tokens
a step (the embedded reversal rows packed: documents cross the ranks' boundary), 4 steps, LoRA r=16 without dropout:
tokens/s, training peak of each next to its plan (the split run planned on 2 ranks), and ``sequence_parallel``: the
largest relative loss difference between the two runs and the split run's training peak over the whole run's. The
dry run: both on the embedded tiny-llama, 2 rows of 64 tokens, 3 steps, 2 gloo ranks against one process.

4-bit kernels (``kernels``, first: seconds, one child process, `kernel_check`): bitsandbytes' CUDA kernels against
``tests/four_bit_reference.py``, a decoder of the 4-bit formats written from their definition (the oracle of the
4-bit tests, which found bitsandbytes' CPU kernel wrong), every comparison made with the same packed bytes and quant
state moved to CPU:

- ``dequantize_4bit``: ``quantize_4bit`` of random bf16 tensors ``[5, w]`` and ``[2, 3, w]``, ``w`` in
  `KERNEL_WIDTHS` (whole 64-value blocks and not), blocks of 64 to 4096, NF4 and FP4, double quantization on and
  off, quant storage uint8, bf16 and fp32; ``dequantize_4bit`` asked for the tensor's shape and for a flat one must
  equal the reference's decode exactly (largest absolute difference 0.0);
- ``linear4bit``: ``Linear4bit`` as the QLoRA recipes build it (NF4, double quantization, bf16 weights and storage),
  compute dtype fp32 and bf16, input widths 96, 128, 200, 4096, 1, 6 and 64 rows (bitsandbytes' forward picks a fused
  4-bit matmul or dequantize + matmul by rows): the forward against ``x @ decode(W, compute).T`` and the input
  gradient against ``g @ decode(W).to(compute)`` (bitsandbytes' backward decodes in the weights' dtype, then casts),
  relative error within `LINEAR_BOUNDS` (fp32 1e-5: summation order; bf16 2**-7: two roundings);
- ``expert_rows``: `fsdp_peft.model.moe_quantization`'s rows of a ``[8, 768, 2048]`` bf16 weight (NF4 and FP4, double
  quantization on and off) dequantized must equal the reference's reading of the documented layout exactly.

``matches_reference``: all three hold. The dry run runs the same cases on CPU, ``dequantize_4bit`` on the widths up to
768 (`KERNEL_DRY_WIDTHS`: CI's time; tests/test_four_bit.py checks the CPU kernel against the same reference).

    python benchmarks/gpu_check.py --dry-run        # CPU: embedded tiny models, tiny sizes, same code path
    python benchmarks/gpu_check.py --shapes moe     # one GPU: the MoE runs alone
    python benchmarks/gpu_check.py --shapes kernels # one GPU: the 4-bit kernels against the reference alone
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}
LORA = {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "lora_target_modules": ["all-linear"]}
SIZES = {  # model shape: rows per step, tokens per row (and optimizer steps where not --steps)
    "1b": {"batch": 8, "seq": 2048},
    "8b": {"batch": 4, "seq": 2048},
    "moe": {"batch": 4, "seq": 2048},
    "tiny": {"batch": 2, "seq": 32},
    "tiny-moe": {"batch": 2, "seq": 32, "steps": 3},  # CI's time: one step timed
}
TINY_MODELS = {"tiny": "tiny-llama", "tiny-moe": "tiny-qwen3-moe", "tiny-vl": "tiny-qwen2.5-vl"}  # fsdp_peft.model.tiny
# MoE runs: LoRA on attention and on every expert (peft's target_parameters), no dropout (none on expert parameters)
MOE_LORA = {**LORA, "lora_dropout": 0.0, "lora_target_modules": ["auto"], "lora_target_parameters": ["auto"]}
MOE_RUNS = ("qlora", "lora")  # most important first: the experts quantized by fsdp_peft.model.moe_quantization
# The dry run (CI) keeps to the QLoRA run (~20 s on 2 cores): the bf16 run differs from it only in load_in_4bit.
MOE_DRY_RUNS = ("qlora",)
SFT_DRY_RUNS = ("qlora",)  # the dry run's SFT pair (fsdp-peft and plain): the LoRA pair differs in load_in_4bit only
EXPERT_BYTES_BOUND = 0.3  # 4-bit experts: at most this share of their bf16 bytes (0.258 expected)
GRPO_SIZES = {  # GRPO model shape: completions per step, tokens per completion, steps (the first one untimed)
    "1b": {"completions": 64, "completion_tokens": 128, "steps": 4},
    "tiny": {"completions": 8, "completion_tokens": 8, "steps": 2},
}
GRPO_RUNS = (("recipe", "lora"), ("recipe", "qlora"), ("unsharded", "lora"), ("stock", "lora"))  # most important first
# The dry run (CI) keeps to two runs, ~13 s each on 2 cores (start-up): both launches, both methods; the other two
# differ from these only in one recipe key (generate_gather_budget: none) or the method.
GRPO_DRY_RUNS = (("recipe", "qlora"), ("unsharded", "lora"))
GRPO_LAUNCH = "configs/accelerate/fsdp2.yaml"  # one rank, on one GPU or (dry run) the CPU
# Vision-language runs (``vlm``): recipes/qwen_vl_qlora.py and qwen_vl_lora.py on Qwen2.5-VL 7B's shape (random weights,
# `models.vision_checkpoint_path`) over the embedded colour task's rows, images resized to 448x448 (256 image tokens),
# a quarter of the rows text only; the dry run: the embedded tiny-qwen2.5-vl, its 32x32 images (4 image tokens).
VISION_SIZES = {"qwen2.5-vl-7b": {"batch": 8, "seq": 320, "steps": 6}, "tiny-vl": {"batch": 4, "seq": 64, "steps": 3}}
VISION_RUNS = ("qlora", "lora")  # most important first
VISION_DRY_RUNS = ("qlora",)  # CI's time: the LoRA run differs in load_in_4bit only
# Sequence-parallel runs (``sp``): recipes/llama_qlora.py with sequence_parallel_size 2 on 2 ranks (one group: both
# ranks train the same rows, each holding half of every row) against one process on the same whole rows; packed rows
# of the embedded reversal task (documents crossing the ranks' boundary). On GPUs they need 2; one GPU skips them.
SP_SIZES = {"8b": {"batch": 1, "seq": 16384, "steps": 4}, "tiny": {"batch": 2, "seq": 64, "steps": 3}}
SP_RANKS = 2
RUN_MINIMUM_SECONDS = 30  # no run (nor checkpoint build) starts with less of the budget left
# The 4-bit kernels against the reference decoder (``kernels``, first: seconds): last dimensions that are and are not
# whole blocks of 64 (96, 160, 200 as the CPU kernel got them wrong; the real models' 768 to 14336), every block size.
KERNEL_WIDTHS = (96, 160, 200, 768, 2048, 2880, 14336)
KERNEL_DRY_WIDTHS = KERNEL_WIDTHS[:4]  # the dry run (CPU, CI's time): tests/test_four_bit.py checks the CPU kernel
KERNEL_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
KERNEL_EXPERTS = (8, 768, 2048)  # 8 experts of the MoE runs' 768 x 2048 weights
# Linear4bit against matmuls with the reference's weights, relative error: fp32, summation order alone (a sequential
# sum of 4096 products against BLAS: 1.2e-6; a misplaced block scale: 0.25); bf16, one unit in the last place: each
# side rounds its own output (H200, 2026-12-04: 4.3e-3 from bitsandbytes' fused few-row kernel, widths of whole blocks).
LINEAR_BOUNDS = {"float32": 1e-5, "bfloat16": 2**-7}


def checkpoint(shape: str, device: str) -> str:
    """The runs' ``model_name_or_path``: an embedded model's name (built here on first use), else the directory of a
    random-weight checkpoint of that shape (`models.checkpoint_path`, a VLM's `models.vision_checkpoint_path`)."""
    from models import checkpoint_path, vision_checkpoint_path

    from fsdp_peft.model.paths import tiny_model_path

    if shape in TINY_MODELS:
        tiny_model_path(TINY_MODELS[shape])
        return TINY_MODELS[shape]
    path = (vision_checkpoint_path if shape in VISION_SIZES else checkpoint_path)(shape, "bfloat16", device)
    if device == "cuda":  # the runs are child processes: give them the memory the build cached here
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
    return str(path)


def write_yaml(path: Path, values: dict) -> Path:
    path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in values.items()))
    return path


PLAIN_CHECKPOINTING = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}


def recipe_yaml(
    directory: Path, model: str, method: str, batch: int, seq: int, steps: int, lora: dict = LORA, name: str = "config"
) -> Path:
    """The recipe config an implementation follows (also what the planner reads); ``name`` ``plain``: plain Trainer's
    loss on full logits (loss_chunk_tokens 0) with every layer checkpointed (the baseline); fsdp-peft's runs the
    recipe's defaults: the chunked loss, and activation checkpointing as the plan chooses for this GPU (auto)."""
    values = {
        "model_name_or_path": model,
        "torch_dtype": "bfloat16",
        "load_in_4bit": method == "qlora",
        "bnb_4bit_quant_storage": "bfloat16",
        **lora,
        "max_seq_length": seq,
        "per_device_train_batch_size": batch,
        **(PLAIN_CHECKPOINTING if name == "plain" else {}),
        "bf16": True,
        "max_steps": steps,
        "learning_rate": 1e-4,
        "optim": "adamw_torch",
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "output_dir": str(directory / "out"),
        "disable_tqdm": True,
        "seed": 0,
        **({"loss_chunk_tokens": 0} if name == "plain" else {}),
    }
    return write_yaml(directory / f"{name}.yaml", values)


def grpo_yaml(directory: Path, model: str, method: str, batch: int, completion_tokens: int, steps: int) -> Path:
    """The GRPO recipe config of a GRPO run (``batch`` completions per rank and step; also what the planner reads)."""
    values = {
        "model_name_or_path": model,
        "torch_dtype": "bfloat16",
        "load_in_4bit": method == "qlora",
        "bnb_4bit_quant_storage": "bfloat16",
        **LORA,
        "lora_dropout": 0.0,  # as the GRPO configs ship: rollouts and training see the same adapter
        "dataset": "tiny-reverse",
        "use_chat_template": True,
        "max_seq_length": 64,
        "reward_funcs": ["exact_answer"],
        "num_generations": 8,
        "max_completion_length": completion_tokens,
        "temperature": 1.0,
        "loss_type": "dapo",
        "beta": 0.0,
        "generate_samples": 0,
        "per_device_train_batch_size": batch,
        **recipe_training(directory, steps, learning_rate=1e-5),
        "lr_scheduler_type": "constant",
    }
    return write_yaml(directory / "grpo.yaml", values)


def recipe_training(directory: Path, steps: int, learning_rate: float) -> dict:
    """The training keys the GRPO and vision-language runs share: bf16, activation checkpointing, AdamW, no saves."""
    return {
        "activation_checkpointing": True,
        "activation_checkpointing_kwargs": {"use_reentrant": False},
        "bf16": True,
        "max_steps": steps,
        "learning_rate": learning_rate,
        "optim": "adamw_torch",
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "output_dir": str(directory / "out"),
        "disable_tqdm": True,
        "seed": 0,
    }


def random_rows(vocab: int, rows: int, seq: int):
    """Token rows of random ids (labels = inputs): every position trains, no padding."""
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, seq), generator=generator)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist(), "attention_mask": [[1] * seq] * rows})


def model_flops_per_token(model, seq: int) -> float:
    """Model FLOPs per trained token (see the module docstring)."""
    import torch

    from fsdp_peft.model.moe import expert_count, experts_per_token

    config = model.config
    experts = expert_count(config)
    routed = experts_per_token(config) / experts if experts else 1.0  # a token passes top-k of the experts
    frozen = adapters = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):  # bitsandbytes' Linear4bit included; peft's wrappers are not
            features = module.in_features * module.out_features
            if ".lora_" in name:  # an expert's adapters are stacked: one Linear holds every expert's
                adapters += features * (routed if ".experts." in name else 1)
            else:
                frozen += features
    for name, weight in [*model.named_parameters(), *model.named_buffers()]:  # 4-bit experts: a buffer in the forward
        if weight.ndim == 3 and ".experts." in name:  # [experts, out, in], not a Linear layer: top-k of them per token
            frozen += weight.numel() * routed
    attention = 12 * config.num_hidden_layers * seq * config.hidden_size
    return 4 * frozen + 6 * adapters + attention


def now() -> float:
    """``time.perf_counter()`` once the GPU's queued work is done."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def median_seconds(work, repeats: int = 5) -> float:
    """Median time of ``work()`` over ``repeats`` calls after one untimed call."""
    work()
    times = []
    for _ in range(repeats):
        started = now()
        work()
        times.append(now() - started)
    return sorted(times)[repeats // 2]


def run_one(args) -> dict:
    """One measured run in this process: ``args.impl`` on ``args.shape`` with ``args.method``."""
    # isort: off
    import fsdp_peft  # noqa: F401  first: its import hook keeps bitsandbytes' compiler out of the start

    # isort: on
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, default_data_collator

    from fsdp_peft.model.modeling import attach_lora, load_base_model, local_device, quantization_config
    from fsdp_peft.model.moe import expert_count
    from fsdp_peft.model.paths import resolve_model_path
    from fsdp_peft.procedures.memory import MemoryReport
    from fsdp_peft.settings.checkpointing import apply_checkpointing
    from fsdp_peft.settings.config import build_training_arguments, resolve_recipe_config

    config_path = Path(args.config)
    recipe, training_values, _ = resolve_recipe_config(["--config", str(config_path)], config_path, "outputs")
    checkpointing = None
    if args.impl == "fsdp-peft":  # the recipe's activation checkpointing: auto, as fsdp_peft.recipe resolves it
        from fsdp_peft.tools.plan import run_checkpointing

        checkpointing, chosen = run_checkpointing(recipe, training_values, "sft", config_path)
        training_values = {**training_values, **chosen}
    training = build_training_arguments(training_values, config_path)
    on_gpu = torch.cuda.is_available()

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_end(self, *a, **k):
            self.times.append(now())

    timer, memory = StepTimes(), MemoryReport()
    started = time.perf_counter()
    if args.impl == "fsdp-peft":
        from fsdp_peft.procedures.trainer import PeftFsdpTrainer

        model = attach_lora(load_base_model(recipe), recipe, training)
        apply_checkpointing(model, checkpointing)
        make = lambda **kw: PeftFsdpTrainer(  # noqa: E731  (MemoryReport is built in)
            **kw,
            callbacks=[timer],
            loss_chunk_tokens=recipe.loss_chunk_tokens,  # the recipe's loss, as fsdp_peft.procedures.sft
        )
    else:
        from peft import LoraConfig, get_peft_model

        base = AutoModelForCausalLM.from_pretrained(
            resolve_model_path(recipe.model_name_or_path),  # an embedded model's name: its directory
            dtype=torch.bfloat16,
            quantization_config=quantization_config(
                recipe, AutoConfig.from_pretrained(resolve_model_path(recipe.model_name_or_path))
            ),
            device_map={"": local_device()},
        )
        lora = LoraConfig(
            r=recipe.lora_r,
            lora_alpha=recipe.lora_alpha,
            lora_dropout=recipe.lora_dropout,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(base, lora)
        make = lambda **kw: Trainer(**kw, callbacks=[timer, memory])  # noqa: E731
    load_seconds = time.perf_counter() - started
    rows = training.per_device_train_batch_size * training.max_steps
    data = random_rows(model.config.vocab_size, rows, recipe.max_seq_length)
    flops_per_token = model_flops_per_token(model, recipe.max_seq_length)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer = make(model=model, args=training, train_dataset=data, data_collator=default_data_collator)
    trainer.train()
    tokens_per_step = training.per_device_train_batch_size * recipe.max_seq_length
    timed = [b - a for a, b in zip(timer.times[1:], timer.times[2:])] or [
        b - a for a, b in zip(timer.times, timer.times[1:])
    ]
    seconds = sorted(timed)[len(timed) // 2] if timed else float("nan")
    report = json.loads((Path(training.output_dir) / "memory.json").read_text())["ranks"][0]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    result = {
        "load_seconds": load_seconds,
        "step_seconds_median": seconds,
        "tokens_per_second": tokens_per_step / seconds,
        "model_flops_per_token": flops_per_token,
        "parameter_gradient_optimizer_bytes": report.get("parameter_gradient_optimizer_bytes"),
        **peaks(report),
        "peak_rss_bytes": report.get("peak_rss_bytes"),
        "final_loss": losses[-1] if losses else None,
        "losses_finite": bool(losses) and all(math.isfinite(loss) for loss in losses),
        "activation_checkpointing": checkpointing.to_json() if checkpointing else "every layer (the Trainer's)",
        "checkpointed_layers": report.get("checkpointed_layers"),
    }
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if on_gpu and k in torch.cuda.get_device_name()), None)
    result["mfu"] = flops_per_token * result["tokens_per_second"] / peak if peak else None
    if expert_count(model.config):  # a mixture of experts (after the peaks above: the timing below adds its own)
        result.update(expert_storage(model))
        result["dequantization"] = dequantization_cost(
            model, training.per_device_train_batch_size, recipe.max_seq_length
        )
    return result


def expert_storage(model) -> dict:
    """This rank's expert bytes as stored (4-bit: the local bytes of the ``*_4bit`` parameters; else the 3D expert
    parameters themselves) against the same experts in bf16."""
    from fsdp_peft.model.moe_quantization import expert_bytes

    stored, bf16 = expert_bytes(model)
    if not stored:  # 16-bit experts
        local = [p.to_local() if hasattr(p, "to_local") else p for n, p in model.named_parameters() if ".experts." in n]
        stored = sum(p.numel() * p.element_size() for p in local if p.ndim == 3)
        bf16 = sum(p.numel() * 2 for p in local if p.ndim == 3)
    quantized = stored < bf16
    return {
        "expert_bytes": stored,
        "expert_bf16_bytes": bf16,
        "expert_bytes_over_bf16": stored / bf16,
        "expert_bytes_within_bound": stored <= EXPERT_BYTES_BOUND * bf16 if quantized else None,
    }


def dequantization_cost(model, batch: int, seq: int) -> dict | None:
    """4-bit experts: `fsdp_peft.model.moe_quantization.dequantize_expert_rows` of the first MoE layer's experts (every
    expert parameter) against that decoder layer's forward as training runs it (autograd on, bf16 autocast, ``batch``
    x ``seq`` random hidden states; its hook's dequantization included), median of 5 each. ``None`` for 16-bit
    experts."""
    import torch

    from fsdp_peft.model.model_record import record_of
    from fsdp_peft.model.modeling import local_device
    from fsdp_peft.model.moe_quantization import dequantize_expert_rows

    blocks = record_of(model).quantized_experts
    if not blocks:
        return None
    moe, base, device = blocks[0], model.get_base_model(), local_device()
    layer = next(module for module in base.modules() if any(child is moe.block for child in module.children()))
    index = next((i for i, module in enumerate(base.model.layers) if module is layer), None)
    hidden = torch.randn(batch, seq, base.config.hidden_size, dtype=torch.bfloat16, device=device)
    positions = torch.arange(seq, device=device).expand(batch, -1)
    rotary = base.model.rotary_emb(hidden, positions)

    def dequantize():
        for entry in moe.parameters:
            dequantize_expert_rows(getattr(entry.module, entry.stored_name), entry.layout, entry.dtype)

    def forward():
        layer(hidden, position_embeddings=rotary, position_ids=positions)

    model.eval()  # no recomputation wrapper: one plain forward
    with torch.autocast(device.type, dtype=torch.bfloat16):
        dequantize_seconds, forward_seconds = median_seconds(dequantize), median_seconds(forward)
    return {
        "layer": index,
        "tokens": batch * seq,
        "experts": moe.parameters[0].experts,
        "parameters": [entry.name for entry in moe.parameters],
        "dequantize_seconds": dequantize_seconds,
        "layer_forward_seconds": forward_seconds,
        "dequantize_over_forward": dequantize_seconds / forward_seconds,
    }


def kernel_check() -> dict:
    """bitsandbytes' 4-bit kernels (CUDA; the dry run: CPU) against `four_bit_reference`'s decoder of the format's
    definition: comparing a kernel with itself cannot see a wrong one (the CPU kernel was, `fsdp_peft.core._compat`)."""
    # isort: off
    import fsdp_peft  # noqa: F401  first: its import hook (on CPU, the dry run: the fixed dequantization kernel)

    # isort: on
    import torch

    # The reference decoder is the test suite's oracle, kept in tests/ (plain modules, not installed): appended last,
    # so that none of tests/' modules shadows benchmarks/' own.
    sys.path.append(str(REPO / "tests"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    parts = {"dequantize_4bit": dequantize_cases, "linear4bit": linear4bit_cases, "expert_rows": expert_rows_cases}
    result: dict = {"device": device.type}
    for name, part in parts.items():
        try:
            result[name] = part(device)
        except Exception as error:  # one part's failure, not the other parts'
            result[name] = {"failed": f"{type(error).__name__}: {error}"[:500], "passed": False}
    result["matches_reference"] = all(result[name]["passed"] for name in parts)
    return result


def dequantize_cases(device) -> dict:
    """``dequantize_4bit`` on ``device``, asked for the tensor's shape and for a flat one, against the reference decode
    of the same bytes and state on CPU: every setting a recipe can choose, widths that are and are not whole blocks."""
    import bitsandbytes.functional as bnb_functional
    import torch
    from four_bit_reference import decode

    storages, settings = (torch.uint8, torch.bfloat16, torch.float32), 0
    compared, unequal, largest = 0, [], 0.0
    widths = KERNEL_WIDTHS if device.type == "cuda" else KERNEL_DRY_WIDTHS
    for width, rows in itertools.product(widths, ((5,), (2, 3))):
        shape = (*rows, width)
        weight = torch.randn(shape, generator=torch.Generator().manual_seed(width + len(shape))).to(torch.bfloat16)
        for blocksize, quant_type, nested, storage in itertools.product(
            KERNEL_BLOCKSIZES, ("nf4", "fp4"), (False, True), storages
        ):
            if -(-weight.numel() // 2) % storage.itemsize:  # bitsandbytes drops bytes short of a storage element
                continue
            packed, state = bnb_functional.quantize_4bit(
                weight.to(device),
                blocksize=blocksize,
                compress_statistics=nested,
                quant_type=quant_type,
                quant_storage=storage,
            )
            flat = copy.copy(state)
            flat.shape = torch.Size([weight.numel()])
            got = (bnb_functional.dequantize_4bit(packed, state), bnb_functional.dequantize_4bit(packed, flat))
            state.to("cpu")  # in place (after the kernels' calls): the reference reads only CPU tensors
            want = decode(packed.cpu(), state)
            settings += 1
            for asked, tensor in zip(("shaped", "flat"), got):
                tensor, compared = tensor.cpu().view(shape), compared + 1
                largest = max(largest, (tensor.float() - want.float()).abs().max().item())
                if tensor.dtype != want.dtype or not torch.equal(tensor, want):
                    unequal.append(f"{list(shape)} {quant_type} blocks {blocksize} nested {nested} {storage} {asked}")
    return {
        "settings": settings,
        "dequantizations": compared,
        "unequal": len(unequal),
        "first_unequal": unequal[:10],
        "max_abs_difference": largest,
        "passed": compared > 0 and not unequal,
    }


def linear4bit_cases(device) -> dict:
    """``Linear4bit`` as the QLoRA recipes build it (nf4, double quantization, bf16 weights and storage) on ``device``:
    forward and input gradient against matmuls with the reference's weights. bitsandbytes picks its forward kernel
    by rows (a fused 4-bit matmul for few, dequantize + matmul for many): 1, 6 and 64 rows."""
    import bitsandbytes
    import torch
    from four_bit_reference import decode, relative_error

    from fsdp_peft.core._compat.bitsandbytes_patches import cpu_weight_repacking_disabled

    cases = []
    for compute, in_features in itertools.product((torch.float32, torch.bfloat16), (96, 128, 200, 4096)):
        generator = torch.Generator().manual_seed(in_features)
        weight = torch.randn(96, in_features, generator=generator).to(torch.bfloat16)
        layer = bitsandbytes.nn.Linear4bit(
            in_features, 96, bias=False, compute_dtype=compute, quant_type="nf4", quant_storage=torch.bfloat16
        )
        layer.weight = bitsandbytes.nn.Params4bit(
            weight, requires_grad=False, quant_type="nf4", quant_storage=torch.bfloat16
        )
        cpu_weight_repacking_disabled(layer.to(device))  # quantized by the move; on CPU, as the recipes run it
        state = copy.deepcopy(layer.weight.quant_state)
        state.to("cpu")
        packed = layer.weight.data.cpu()
        # As bitsandbytes computes: the forward decodes into the compute dtype, the backward into the weights', casts.
        forward_weight = decode(packed, state, compute).to(device)
        backward_weight = decode(packed, state).to(compute).to(device)
        for rows in (1, 6, 64):
            x = torch.randn(rows, in_features, generator=generator).to(compute).to(device).requires_grad_()
            out = layer(x)
            grad = torch.randn(out.shape, generator=generator).to(compute).to(device)
            out.backward(grad)
            with torch.no_grad():
                errors = (relative_error(out, x @ forward_weight.T), relative_error(x.grad, grad @ backward_weight))
            dtype = str(compute).removeprefix("torch.")
            case = {"compute": dtype, "in_features": in_features, "rows": rows}
            within = all(error <= LINEAR_BOUNDS[dtype] for error in errors)  # NaN: not within
            cases.append({**case, "forward": errors[0], "input_gradient": errors[1], "within_bound": within})
    passed = all(case["within_bound"] for case in cases)
    nan_first = lambda error: math.inf if math.isnan(error) else error  # noqa: E731
    largest = {
        d: max((c[k] for c in cases if c["compute"] == d for k in ("forward", "input_gradient")), key=nan_first)
        for d in LINEAR_BOUNDS
    }
    return {"cases": cases, "max_relative_error": largest, "bounds": LINEAR_BOUNDS, "passed": passed}


def expert_rows_cases(device) -> dict:
    """`fsdp_peft.model.moe_quantization`'s 4-bit expert rows (its layout around bitsandbytes' kernels) quantized and
    dequantized on ``device`` against the reference's reading of the rows as the layout is documented."""
    import torch
    from four_bit_reference import decode_expert_rows

    from fsdp_peft.model.moe_quantization import dequantize_expert_rows, layout_for, quantize_expert_rows
    from fsdp_peft.settings.four_bit import FourBit

    weight = torch.randn(KERNEL_EXPERTS, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(device)
    cases = []
    for quant_type, nested in itertools.product(("nf4", "fp4"), (True, False)):
        layout = layout_for(weight.shape, FourBit(quant_type, nested, storage_dtype="bfloat16"))
        rows = quantize_expert_rows(weight, layout)
        got = dequantize_expert_rows(rows, layout, torch.bfloat16).cpu()
        want = decode_expert_rows(rows.cpu(), weight.shape, quant_type, nested, torch.bfloat16)
        difference = (got.float() - want.float()).abs().max().item()
        cases.append({"quant_type": quant_type, "double_quant": nested, "max_abs_difference": difference})
        cases[-1]["equal"] = got.dtype == want.dtype and torch.equal(got, want)
    return {"shape": list(KERNEL_EXPERTS), "cases": cases, "passed": all(case["equal"] for case in cases)}


def planned(config: Path, gpu_memory: int, ranks: int = 1) -> dict:
    from fsdp_peft.tools.plan import CUDA_CONTEXT_BYTES, plan_memory

    plan = plan_memory(config, ranks, gpu_memory)
    return {
        "allocator_bytes": plan.gpu_total - CUDA_CONTEXT_BYTES,
        "total_with_context_bytes": plan.gpu_total,
        "parameter_gradient_optimizer_bytes": plan.parameter_gradient_optimizer_bytes,
        "expert_bytes": plan.counts.expert_bytes,  # a mixture of experts: as stored (0: none)
        "components": plan.gpu,
        "verdict": plan.to_json()["verdict"],
    }


def environment() -> dict:
    import accelerate
    import bitsandbytes
    import peft
    import torch
    import transformers
    import trl

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hardware": {
            "gpu": gpu,
            "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if gpu else None,
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "accelerate": accelerate.__version__,
            "peft": peft.__version__,
            "bitsandbytes": bitsandbytes.__version__,
            "trl": trl.__version__,
        },
    }


def drive(args) -> None:
    """All runs, each in a child process, within ``--budget`` seconds; the JSON is rewritten after each."""
    import torch

    started = time.monotonic()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    order = (
        args.shapes or ("kernels,tiny,grpo,moe,vlm,sp" if args.dry_run else "kernels,1b,grpo,moe,vlm,sp,8b")
    ).split(",")
    shapes = {
        "grpo": "tiny" if args.dry_run else args.grpo_shape,
        "moe": "tiny-moe" if args.dry_run else "moe",
        "vlm": "tiny-vl" if args.dry_run else "qwen2.5-vl-7b",
        "sp": "tiny" if args.dry_run else "8b",
    }
    gpu_memory = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 80 * 2**30
    report = {
        **environment(),
        "command": "bash benchmarks/gpu_check.sh" + (" --dry-run" if args.dry_run else ""),
        "dry_run": args.dry_run,
        "settings": {
            **LORA,
            "steps": args.steps,
            "sizes": {s: SIZES[s] for s in order if s in SIZES and s not in shapes},
            "bf16": True,
            "activation_checkpointing": "fsdp-peft: the recipe's auto (the plan's choice); plain: every layer",
            "optim": "adamw_torch",
        },
        "runs": [],
        "skipped": [],
    }
    grpo_runs = GRPO_DRY_RUNS if args.dry_run else GRPO_RUNS
    if "grpo" in order:
        report["settings"]["grpo"] = {
            "model": shapes["grpo"],
            **GRPO_SIZES[shapes["grpo"]],
            "launch": f"{GRPO_LAUNCH} --num_processes 1",
            "runs": [" ".join(r) for r in grpo_runs],
        }
    moe_runs = MOE_DRY_RUNS if args.dry_run else MOE_RUNS
    if "moe" in order:
        from models import QWEN3_MOE_SHAPES

        report["settings"]["moe"] = {
            "model": shapes["moe"],
            "shape": QWEN3_MOE_SHAPES.get(shapes["moe"], TINY_MODELS.get(shapes["moe"])),
            **SIZES[shapes["moe"]],
            **MOE_LORA,
            "runs": [f"fsdp-peft {method}" for method in moe_runs],
            "expert_bytes_bound": EXPERT_BYTES_BOUND,
        }
    vision_runs = VISION_DRY_RUNS if args.dry_run else VISION_RUNS
    if "vlm" in order:
        report["settings"]["vlm"] = {
            "model": shapes["vlm"],
            **VISION_SIZES[shapes["vlm"]],
            "recipes": [f"qwen_vl_{method}" for method in vision_runs],
            "launch": f"{GRPO_LAUNCH} --num_processes 1",
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for item in order:
        if item == "kernels":  # no model: its own random tensors
            entry = {"model": "kernels", "method": "4-bit", "impl": "vs reference"}
            measured(entry, kernel_run, args, report, started)
            continue
        shape = shapes.get(item, item)
        if item == "vlm":
            vision_check(shape, vision_runs, device, gpu_memory, args, report, started)
            continue
        if item == "sp":
            report["settings"]["sp"] = {"model": shape, **SP_SIZES[shape], "ranks": SP_RANKS, "recipe": "llama_qlora"}
            sequence_parallel_check(shape, device, gpu_memory, args, report, started)
            continue
        path = checkpoint(shape, device) if budget_left(args, started) >= RUN_MINIMUM_SECONDS else ""  # else skipped
        if item == "grpo":
            for mode, method in grpo_runs:
                entry = {"model": shape, "method": method, "impl": f"grpo {mode}"}
                measured(entry, lambda left: grpo_run(entry, mode, path, gpu_memory, left), args, report, started)
            report["grpo_rollouts"] = grpo_summary(report["runs"])
            args.out.write_text(json.dumps(report, indent=1))
            continue
        moe = item == "moe"  # fsdp-peft only: plain Trainer + peft cannot quantize the experts
        for method in moe_runs if moe else SFT_DRY_RUNS if args.dry_run else ("lora", "qlora"):
            directory = Path(tempfile.mkdtemp(prefix=f"gpu_check_{shape}_{method}_"))
            for impl in ("fsdp-peft",) if moe else ("fsdp-peft", "plain"):
                entry = {"model": shape, "method": method, "impl": impl}
                if budget_left(args, started) >= RUN_MINIMUM_SECONDS:  # else measured() records the run as skipped
                    size, lora = SIZES[shape], MOE_LORA if moe else LORA
                    steps = size.get("steps", args.steps)
                    name = "plain" if impl == "plain" else "config"
                    config = recipe_yaml(directory, path, method, size["batch"], size["seq"], steps, lora, name)
                    entry["planned"] = planned(config, gpu_memory)
                measured(entry, lambda left: sft_run(impl, config, directory, left), args, report, started)
    report["seconds"] = time.monotonic() - started
    args.out.write_text(json.dumps(report, indent=1))
    print(f"written: {args.out}")


def vision_check(shape: str, methods, device: str, gpu_memory: int, args, report: dict, started: float) -> None:
    """The vision-language runs: each recipe launched (FSDP2, one rank) on ``shape``, its plan beside it."""
    path = checkpoint(shape, device) if budget_left(args, started) >= RUN_MINIMUM_SECONDS else ""  # else skipped
    for method in methods:
        entry: dict = {"model": shape, "method": method, "impl": "fsdp-peft vlm"}
        if budget_left(args, started) >= RUN_MINIMUM_SECONDS:
            directory = Path(tempfile.mkdtemp(prefix=f"gpu_check_vlm_{method}_"))
            config = vision_yaml(directory, path, method, VISION_SIZES[shape])
            entry["planned"] = planned(config, gpu_memory)
        measured(entry, lambda left: recipe_run(f"qwen_vl_{method}", config, left), args, report, started)


def vision_yaml(directory: Path, model: str, method: str, size: dict) -> Path:
    """The config of a vision-language run (also what the planner reads)."""
    values = {
        "model_name_or_path": model,
        "torch_dtype": "bfloat16",
        "load_in_4bit": method == "qlora",
        "bnb_4bit_quant_storage": "bfloat16",
        **LORA,
        "lora_target_modules": ["auto"],  # the language model's projections (peft's all-linear would reach the tower)
        "dataset": "tiny-colors",
        "max_seq_length": size["seq"],
        "generate_samples": 0,
        "per_device_train_batch_size": size["batch"],
        **recipe_training(directory, size["steps"], learning_rate=1e-4),
    }
    return write_yaml(directory / "vlm.yaml", values)


def recipe_run(recipe: str, config: Path, left: float, ranks: int = 1) -> dict:
    """recipes/<recipe>.py launched as users launch it (FSDP2) on ``ranks`` ranks; tokens/s over the whole training
    (its first step included), the training and loading peaks and the parameter, gradient and optimizer bytes from
    its memory.json (rank 0), and the logged losses."""
    import torch
    from grpo_rollouts import child_env, free_port

    launch = GRPO_LAUNCH if torch.cuda.is_available() else "configs/accelerate/cpu_fsdp2.yaml"
    launcher = ["-m", "accelerate.commands.launch", "--config_file", launch, "--num_processes", str(ranks)]
    launcher += ["--main_process_port", str(free_port())]
    command = [sys.executable, *launcher, f"recipes/{recipe}.py", "--config", str(config)]
    env = child_env(TOKENIZERS_PARALLELISM="false")
    child = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=left)
    if child.returncode != 0:
        return {"failed": last_line(child.stderr)}
    out = config.parent / "out"
    results = json.loads((out / "results.json").read_text())
    memory = json.loads((out / "memory.json").read_text())["ranks"][0]
    losses = [e["loss"] for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    return {
        "steps": results["steps"],
        "tokens": results["tokens"],
        "train_seconds": results["train_seconds"],
        "tokens_per_second": results["tokens"] / results["train_seconds"],
        "parameter_gradient_optimizer_bytes": memory.get("parameter_gradient_optimizer_bytes"),
        **peaks(memory),
        "peak_rss_bytes": memory.get("peak_rss_bytes"),
        "final_loss": losses[-1] if losses else None,
        "losses": losses,
        "losses_finite": bool(losses) and all(math.isfinite(loss) for loss in losses),
    }


def sequence_parallel_check(shape: str, device: str, gpu_memory: int, args, report: dict, started: float) -> None:
    """The sequence-parallel pair (`SP_SIZES`): the split run on `SP_RANKS` ranks and one process on the whole rows,
    each next to its plan; then the largest relative loss difference between them and the ratio of their peaks."""
    import torch

    gpus = torch.cuda.device_count() if device == "cuda" else SP_RANKS
    if gpus < SP_RANKS:
        report["skipped"].append(f"{shape}/qlora/sequence parallel: needs {SP_RANKS} GPUs, this machine has {gpus}")
        return
    path = checkpoint(shape, device) if budget_left(args, started) >= RUN_MINIMUM_SECONDS else ""  # else skipped
    entries = {}
    for kind, ranks in (("split", SP_RANKS), ("whole", 1)):
        entry = entries[kind] = {"model": shape, "method": "qlora", "impl": f"sp {kind}"}
        if budget_left(args, started) >= RUN_MINIMUM_SECONDS:
            directory = Path(tempfile.mkdtemp(prefix=f"gpu_check_sp_{kind}_"))
            config = sequence_parallel_yaml(directory, path, SP_SIZES[shape], ranks)
            entry["planned"] = planned(config, gpu_memory, ranks)
        measured(entry, lambda left: recipe_run("llama_qlora", config, left, ranks), args, report, started)
    split, whole = entries["split"].get("losses"), entries["whole"].get("losses")
    if split and whole and len(split) == len(whole):
        peaks_of = [entries[kind].get("peak_gpu_allocated_training_bytes") for kind in ("split", "whole")]
        report["sequence_parallel"] = {
            "largest_relative_loss_difference": max(abs(a - b) / abs(b) for a, b in zip(split, whole)),
            "split_over_whole_training_peak": peaks_of[0] / peaks_of[1] if all(peaks_of) else None,
        }
        print(f"{'':<30}split vs whole rows: {report['sequence_parallel']}", flush=True)
    args.out.write_text(json.dumps(report, indent=1))


def sequence_parallel_yaml(directory: Path, model: str, size: dict, split: int) -> Path:
    """The QLoRA recipe config of a sequence-parallel run, ``split`` ranks to a row (1: the whole rows)."""
    values = {
        "model_name_or_path": model,
        "torch_dtype": "bfloat16",
        "load_in_4bit": True,
        "bnb_4bit_quant_storage": "bfloat16",
        **LORA,
        "lora_dropout": 0.0,  # the two runs draw no different masks
        "max_seq_length": size["seq"],
        "packing": True,  # short documents packed across the ranks' boundary
        "sequence_parallel_size": split,
        "generate_samples": 0,
        "generate_eval_samples": 0,
        "eval_strategy": "no",
        "per_device_train_batch_size": size["batch"],
        **recipe_training(directory, size["steps"], learning_rate=1e-4),
    }
    return write_yaml(directory / "sp.yaml", values)


def peaks(memory: dict) -> dict:
    """A run's GPU peaks from its memory.json (`fsdp_peft.procedures.memory.MemoryReport`): training's (what the plan
    estimates), loading's (the model loaded and sharded, before the first step) and the whole run's."""
    names = ("peak_gpu_allocated_bytes", "peak_gpu_allocated_training_bytes", "peak_gpu_allocated_loading_bytes")
    return {name: memory.get(name) for name in (*names, "peak_gpu_reserved_bytes")}


def budget_left(args, started: float) -> float:
    return args.budget - (time.monotonic() - started)


def measured(entry: dict, run, args, report: dict, started: float) -> None:
    """``run(seconds left)``'s figures (or why it failed) into ``entry``, and ``entry`` into the report; skipped when
    less than 30 s of the budget are left."""
    left = budget_left(args, started)
    if left < RUN_MINIMUM_SECONDS:
        report["skipped"].append(f"{entry['model']}/{entry['method']}/{entry['impl']}: time budget spent")
        return
    run_started = time.monotonic()
    try:
        entry.update(run(left))
    except subprocess.TimeoutExpired:
        entry["failed"] = "time budget spent during the run"
    except Exception as error:  # reading a run's figures: one run's failure, not the unattended check's
        entry["failed"] = f"gpu_check: {type(error).__name__}: {error}"[:500]
    entry["run_seconds"] = time.monotonic() - run_started
    if entry.get("peak_gpu_allocated_training_bytes") and entry.get("planned"):  # the plan estimates training's peak
        training_peak = entry["peak_gpu_allocated_training_bytes"]
        entry["planned_over_measured_peak"] = entry["planned"]["allocator_bytes"] / training_peak
    if entry.get("expert_bytes") and entry.get("planned", {}).get("expert_bytes"):
        entry["expert_bytes_over_planned"] = entry["expert_bytes"] / entry["planned"]["expert_bytes"]
    report["runs"].append(entry)
    print_entry(entry)
    args.out.write_text(json.dumps(report, indent=1))


def last_line(stderr: str) -> str:
    """Why a child run failed: its last error line (a launcher's report follows it), else its last line."""
    lines = stderr.strip().splitlines() or ["no output"]
    ours = [line for line in lines if line.startswith("error: ")]  # fsdp-peft's one-line refusals
    raised = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line) and "ChildFailedError" not in line]
    return (ours or raised or lines)[-1][:500]


def sft_run(impl: str, config: Path, directory: Path, left: float) -> dict:
    """One SFT run (`run_one` in a child process)."""
    out = directory / f"{impl}.json"
    command = [sys.executable, __file__, "--one", "--impl", impl, "--config", str(config), "--result", str(out)]
    child = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=left)
    if child.returncode != 0:
        return {"failed": last_line(child.stderr)}
    return json.loads(out.read_text())


def kernel_run(left: float) -> dict:
    """`kernel_check` in a child process: a kernel's fault (a sticky CUDA error) stays out of the later runs."""
    out = Path(tempfile.mkdtemp(prefix="gpu_check_kernels_")) / "kernels.json"
    command = [sys.executable, __file__, "--kernels", "--result", str(out)]
    child = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=left)
    if child.returncode != 0:
        return {"failed": last_line(child.stderr)}
    return json.loads(out.read_text())


def grpo_run(entry: dict, mode: str, model: Path, gpu_memory: int, left: float) -> dict:
    """One GRPO run of the recipe in ``mode`` (`grpo_rollouts.run`, one process); its plan goes into ``entry`` first."""
    import grpo_rollouts

    size = GRPO_SIZES[entry["model"]]
    directory = Path(tempfile.mkdtemp(prefix=f"gpu_check_grpo_{mode}_{entry['method']}_"))
    config = grpo_yaml(directory, model, entry["method"], size["completions"], size["completion_tokens"], size["steps"])
    entry["planned"] = planned(config, gpu_memory)
    try:
        record = grpo_rollouts.run(
            mode,
            directory,
            steps=size["steps"],
            completions=size["completions"],
            completion_tokens=size["completion_tokens"],
            recipe_args=("--config", str(config)),
            sharded_processes=1,
            accelerate_config=GRPO_LAUNCH,
            timeout=left,
        )
    except grpo_rollouts.RunFailed as failed:
        return {"failed": last_line(str(failed))}
    return grpo_figures(record)


def grpo_figures(record: dict) -> dict:
    """Rollout, step and training figures of one GRPO run (`grpo_rollouts.timed_recipe`'s record), the steps after
    the first; one rollout call per step."""
    from grpo_rollouts import rollout_figures

    rollouts = rollout_figures(record)
    ends, calls, logs = record["step_ends"], record["calls"], record.get("log_history", [])
    seen = {entry["step"]: entry["num_tokens"] for entry in logs if "num_tokens" in entry}  # after each step, all ranks
    timed = range(1, min(len(ends), len(calls)))
    seconds = sum(ends[i] - ends[i - 1] for i in timed)
    training_seconds = seconds - sum(calls[i][0] for i in timed)
    tokens = sum(seen[i + 1] - seen[i] for i in timed)  # log steps count from 1
    losses = [entry["loss"] for entry in logs if "loss" in entry]
    rewards = [entry["reward"] for entry in logs if "reward" in entry]
    memory = json.loads((Path(record["output_dir"]) / "memory.json").read_text())["ranks"][0]
    return {
        "processes": record["processes"],
        "steps_timed": len(timed),
        "rollout_tokens_per_second": rollouts["tokens_per_second"],
        "rollout_seconds_per_call": rollouts["seconds_per_call"],
        "rollout_tokens_per_call": rollouts["tokens_per_call"],
        "step_seconds_mean": seconds / len(timed),
        "tokens_per_step": tokens / len(timed),
        "tokens_per_second": tokens / seconds,
        "training_tokens_per_second": tokens / training_seconds,
        "parameter_gradient_optimizer_bytes": memory.get("parameter_gradient_optimizer_bytes"),
        **peaks(memory),
        "peak_rss_bytes": memory.get("peak_rss_bytes"),
        "final_loss": losses[-1] if losses else None,
        "final_reward": rewards[-1] if rewards else None,
        "loss_and_reward_finite": bool(losses and rewards) and all(math.isfinite(v) for v in losses + rewards),
    }


def grpo_summary(runs: list[dict]) -> dict:
    """The recipe's rollout speed over the unsharded model's and stock TRL's (the lora runs), where both ran."""
    speed = {
        r["impl"]: r["rollout_tokens_per_second"]
        for r in runs
        if r["impl"].startswith("grpo ") and r["method"] == "lora" and "rollout_tokens_per_second" in r
    }
    recipe = speed.get("grpo recipe")
    return {
        f"recipe_over_{other}": recipe / speed[f"grpo {other}"] if recipe and f"grpo {other}" in speed else None
        for other in ("unsharded", "stock")
    }


def peak_text(entry: dict, gib) -> str:
    """``training peak (loading peak)`` of a run, as printed."""
    training, loading = (entry.get(f"peak_gpu_allocated_{part}_bytes") for part in ("training", "loading"))
    return f"{gib(training)} (loading {gib(loading)})"


def print_entry(entry: dict) -> None:
    head = f"{entry['model']:<8} {entry['method']:<6} {entry['impl']:<14}"
    if "failed" in entry:
        print(f"{head} failed: {entry['failed']}")
        return
    if "matches_reference" in entry:
        print_kernels(head, entry)
        return
    from fsdp_peft.tools.plan import gib as size

    gib = lambda v: size(v) if v else "n/a"  # noqa: E731
    if "rollout_tokens_per_second" in entry:
        number = lambda v: f"{v:.4g}" if v is not None else "n/a"  # noqa: E731
        print(
            f"{head} rollouts {entry['rollout_tokens_per_second']:>8.0f} tok/s"
            f"  step {entry['tokens_per_second']:>8.0f} tok/s (training {entry['training_tokens_per_second']:.0f})"
            f"  peak {peak_text(entry, gib)}  planned {gib(entry['planned']['allocator_bytes'])}"
            f"  loss {number(entry['final_loss'])} reward {number(entry['final_reward'])}"
            f" ({'finite' if entry['loss_and_reward_finite'] else 'NOT FINITE'})",
            flush=True,
        )
        return
    mfu = f"{entry['mfu']:.1%}" if entry.get("mfu") else "n/a"
    print(
        f"{head} {entry['tokens_per_second']:>9.0f} tok/s  MFU {mfu:>6}  peak {peak_text(entry, gib)}"
        f"  planned {gib(entry['planned']['allocator_bytes'])}"
        f"  p+g+o {gib(entry['parameter_gradient_optimizer_bytes'])}"
        f" (planned {gib(entry['planned']['parameter_gradient_optimizer_bytes'])})"
        f"  loss {'finite' if entry['losses_finite'] else 'NOT FINITE'}",
        flush=True,
    )
    if "expert_bytes" in entry:
        within = {True: f" (<= {EXPERT_BYTES_BOUND})", False: f" OVER {EXPERT_BYTES_BOUND}", None: ""}
        cost = entry.get("dequantization")
        print(
            f"{'':<30}experts {gib(entry['expert_bytes'])} (planned {gib(entry['planned']['expert_bytes'])},"
            f" {entry['expert_bytes_over_bf16']:.3f} of bf16{within[entry['expert_bytes_within_bound']]})"
            + (
                f"  dequantizing layer {cost['layer']}'s experts {cost['dequantize_seconds'] * 1e3:.2f} ms,"
                f" {cost['dequantize_over_forward']:.1%} of its forward ({cost['layer_forward_seconds'] * 1e3:.2f} ms)"
                if cost
                else ""
            ),
            flush=True,
        )


def print_kernels(head: str, entry: dict) -> None:
    """The kernel check's verdict, then a line per part: its figures, or why it failed."""
    verdict = "MATCH" if entry["matches_reference"] else "DO NOT MATCH"
    print(f"{head} on {entry['device']}: the 4-bit kernels {verdict} the reference decoder", flush=True)
    parts = {}  # the entry's key: its line
    if "failed" not in (part := entry["dequantize_4bit"]):
        count, settings = part["dequantizations"], part["settings"]
        parts["dequantize_4bit"] = (
            f"{count - part['unequal']} of {count} equal ({settings} settings, shaped and flat),"
            f" largest |difference| {part['max_abs_difference']}"
        )
    if "failed" not in (part := entry["linear4bit"]):
        largest, bounds = part["max_relative_error"], part["bounds"]
        errors = ", ".join(f"{d} {largest[d]:.2e} (bound {bounds[d]:.2e})" for d in largest)
        parts["linear4bit"] = f"largest relative error of forward and input gradient: {errors}"
    if "failed" not in (part := entry["expert_rows"]):
        cases = part["cases"]
        largest = max(case["max_abs_difference"] for case in cases)
        equal = sum(case["equal"] for case in cases)
        parts["expert_rows"] = f"{part['shape']}: {equal} of {len(cases)} equal, largest |difference| {largest}"
    for key in ("dequantize_4bit", "linear4bit", "expert_rows"):  # as the JSON names them
        print(f"{'':<30}{key}: {parts.get(key) or 'failed: ' + entry[key]['failed']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU: the embedded tiny model, tiny sizes")
    parser.add_argument(
        "--shapes",
        help="what runs, in this order: kernels (4-bit kernels against the reference decoder), SFT model shapes, grpo"
        " (the GRPO runs), moe (the MoE runs) and vlm (the vision-language runs); default kernels,1b,grpo,moe,vlm,8b"
        " (dry run: kernels,tiny,grpo,moe,vlm)",
    )
    parser.add_argument("--grpo-shape", default="1b", choices=sorted(GRPO_SIZES), help="the GRPO runs' model shape")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first two are not timed)")
    parser.add_argument("--budget", type=float, default=420, help="seconds for all runs together")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gpu_check.json")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kernels", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=["fsdp-peft", "plain"], help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.result.write_text(json.dumps(run_one(args)))
    elif args.kernels:
        args.result.write_text(json.dumps(kernel_check()))
    else:
        drive(args)


if __name__ == "__main__":
    main()
