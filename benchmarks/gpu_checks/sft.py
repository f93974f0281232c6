"""SFT runs (the model shapes in ``--shapes``: ``1b``, ``8b``; the dry run ``tiny``). Each run is its own process
(clean peak-memory counters) and trains ``--steps`` optimizer steps on random token ids (``--seq`` tokens per row,
``--batch`` rows per step, bf16, gradient checkpointing, AdamW, LoRA r=16 on all linear layers, dropout 0.05):

- ``fsdp-peft``: `fsdp_peft.model.modeling.load_base_model` + `attach_lora` +
  `fsdp_peft.procedures.trainer.PeftFsdpTrainer` (one GPU: no FSDP; the library's loading, adapter dtypes and trainer);
- ``plain``: ``AutoModelForCausalLM.from_pretrained(quantization_config=...)`` + ``peft.get_peft_model`` +
  ``transformers.Trainer``, every layer checkpointed (today's baseline);
- ``plain liger``: the same with ``use_liger_kernel`` (Liger's RMSNorm, RoPE, SwiGLU and fused linear
  cross-entropy) and nothing checkpointed: the best well-kept combination known (FINDINGS: 1.69x the baseline);
- ``fsdp-peft liger``: ``fsdp-peft`` with ``kernels: liger``.
The Liger runs need CUDA (Triton): the CPU dry run plans them and says they were not run.

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
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

from gpu_checks.common import DRIVER, PEAK_BF16_FLOPS, REPO, last_line, now, peaks
from gpu_checks.moe import dequantization_cost, expert_storage

SFT_IMPLS = ("fsdp-peft", "fsdp-peft liger", "plain", "plain liger")
PLAIN_CHECKPOINTED = {"plain": "every layer (the Trainer's)"}  # plain liger: none (its config says false)
LIGER_IMPLS = ("fsdp-peft liger", "plain liger")
# speed ratios reported for each model shape and method: (numerator, denominator)
SFT_RATIOS = (("fsdp-peft", "plain"), ("fsdp-peft", "plain liger"), ("fsdp-peft liger", "plain liger"))


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
    ours = args.impl.startswith("fsdp-peft")
    if ours:  # the recipe's activation checkpointing: auto, and its kernels, as fsdp_peft.recipe resolves them
        from fsdp_peft.model.kernels import kernel_training_values
        from fsdp_peft.procedures.sft import SFT_PROCEDURE
        from fsdp_peft.tools.plan import launch_plan, run_checkpointing

        plan = launch_plan(recipe, training_values, SFT_PROCEDURE, config_path)
        checkpointing, chosen = run_checkpointing(recipe, training_values, config_path, plan)
        training_values = {**training_values, **chosen, **kernel_training_values(recipe)}
    training = build_training_arguments(training_values, config_path)
    on_gpu = torch.cuda.is_available()

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_end(self, *a, **k):
            self.times.append(now())

    timer, memory = StepTimes(), MemoryReport()
    started = time.perf_counter()
    if ours:
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
        "activation_checkpointing": (
            checkpointing.to_json() if checkpointing else PLAIN_CHECKPOINTED.get(args.impl, "none")
        ),
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


def sft_ratios(runs: list[dict]) -> list[dict]:
    """Tokens/s of each pair in `SFT_RATIOS` that both ran, per model shape and method."""
    speed = {(r["model"], r["method"], r["impl"]): r.get("tokens_per_second") for r in runs}
    ratios = []
    for model, method in dict.fromkeys((r["model"], r["method"]) for r in runs if r["impl"] in SFT_IMPLS):
        for top, bottom in SFT_RATIOS:
            a, b = speed.get((model, method, top)), speed.get((model, method, bottom))
            if a and b:
                ratios.append({"model": model, "method": method, "of": top, "over": bottom, "ratio": a / b})
    return ratios


def sft_run(impl: str, config: Path, directory: Path, left: float) -> dict:
    """One SFT run (`run_one` in a child process)."""
    out = directory / f"{impl}.json"
    command = [sys.executable, str(DRIVER), "--one", "--impl", impl, "--config", str(config), "--result", str(out)]
    child = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=left)
    if child.returncode != 0:
        return {"failed": last_line(child.stderr)}
    return json.loads(out.read_text())
