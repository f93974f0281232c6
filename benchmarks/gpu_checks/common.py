"""What every check of benchmarks/gpu_check.py shares: the model shapes and LoRA settings, the configs it writes,
the plan it compares with, the recipes' launch, timing and the run budget.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # benchmarks/


REPO = HERE.parent
DRIVER = HERE / "gpu_check.py"  # also the entry of each run's own process (--one, --kernels)


sys.path.insert(0, str(REPO))


sys.path.insert(0, str(HERE))

from train_cpu import scratch_directory  # noqa: E402, F401  (the benchmarks' shared pieces, for the checks)

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


# Memory bandwidth by the makers' data sheets (bytes/s; the SXM parts): what bounds decoding, which reads every weight
# once per token step
PEAK_MEMORY_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.04e12, "L40S": 0.864e12, "A10G": 0.6e12}


def peak_memory_bandwidth() -> float | None:
    """This GPU's data-sheet memory bandwidth in bytes/s (`PEAK_MEMORY_BANDWIDTH`), or None (another GPU, none)."""
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((v for k, v in PEAK_MEMORY_BANDWIDTH.items() if k in name), None)


LORA = {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "lora_target_modules": ["all-linear"]}


SIZES = {  # model shape: rows per step, tokens per row (and optimizer steps where not --steps)
    "1b": {"batch": 8, "seq": 2048},
    "8b": {"batch": 4, "seq": 2048},
    "moe": {"batch": 4, "seq": 2048},
    "tiny": {"batch": 2, "seq": 32},
    "tiny-moe": {"batch": 2, "seq": 32, "steps": 3},  # CI's time: one step timed
}


TINY_MODELS = {"tiny": "tiny-llama", "tiny-moe": "tiny-qwen3-moe", "tiny-vl": "tiny-qwen2.5-vl"}  # fsdp_peft.model.tiny


RECIPE_LAUNCH = "configs/accelerate/fsdp2.yaml"  # the recipes' launch: one rank (dry run: cpu_fsdp2.yaml)


# Vision-language runs (``vlm``): recipes/qwen_vl_qlora.py and qwen_vl_lora.py on Qwen2.5-VL 7B's shape (random weights,
# `models.vision_checkpoint_path`) over the embedded colour task's rows, images resized to 448x448 (256 image tokens),
# a quarter of the rows text only; the dry run: the embedded tiny-qwen2.5-vl, its 32x32 images (4 image tokens).
VISION_SIZES = {"qwen2.5-vl-7b": {"batch": 8, "seq": 320, "steps": 6}, "tiny-vl": {"batch": 4, "seq": 64, "steps": 3}}


RUN_MINIMUM_SECONDS = 30  # no run (nor checkpoint build) starts with less of the budget left


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
    loss on full logits (loss_chunk_tokens 0) with every layer checkpointed (the baseline); ``plain liger``: plain
    Trainer with Liger's kernels (its fused linear cross-entropy) and nothing checkpointed (the best well-kept
    combination known); fsdp-peft's runs the recipe's defaults: the chunked loss, and activation checkpointing as the
    plan chooses for this GPU (auto); ``fsdp-peft liger``: the same with ``kernels: liger``."""
    values = {
        "model_name_or_path": model,
        "torch_dtype": "bfloat16",
        "load_in_4bit": method == "qlora",
        "bnb_4bit_quant_storage": "bfloat16",
        **lora,
        "max_seq_length": seq,
        "per_device_train_batch_size": batch,
        **(PLAIN_CHECKPOINTING if name == "plain" else {}),
        **({"use_liger_kernel": True, "activation_checkpointing": False} if name == "plain liger" else {}),
        **({"kernels": "liger"} if name == "fsdp-peft liger" else {}),
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
        **({"loss_chunk_tokens": 0} if name.startswith("plain") else {}),
    }
    return write_yaml(directory / f"{name.replace(' ', '_')}.yaml", values)


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


def planned(config: Path, gpu_memory: int, ranks: int = 1) -> dict:
    from fsdp_peft.procedures.registry import plan_config
    from fsdp_peft.tools.plan import CUDA_CONTEXT_BYTES

    plan = plan_config(config, ranks, gpu_memory)
    return {
        "allocator_bytes": plan.gpu_total - CUDA_CONTEXT_BYTES,
        "total_with_context_bytes": plan.gpu_total,
        "parameter_gradient_optimizer_bytes": plan.parameter_gradient_optimizer_bytes,
        "expert_bytes": plan.counts.expert_bytes,  # a mixture of experts: as stored (0: none)
        "components": plan.gpu,
        "verdict": plan.to_json()["verdict"],
    }


def recipe_run(recipe: str, config: Path, left: float, ranks: int = 1) -> dict:
    """recipes/<recipe>.py launched as users launch it (FSDP2) on ``ranks`` ranks; tokens/s over the whole training
    (its first step included), the training and loading peaks and the parameter, gradient and optimizer bytes from
    its memory.json (rank 0), and the logged losses."""
    import torch
    from grpo_rollouts import child_env, free_port

    launch = RECIPE_LAUNCH if torch.cuda.is_available() else "configs/accelerate/cpu_fsdp2.yaml"
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


def peaks(memory: dict) -> dict:
    """A run's GPU peaks from its memory.json (`fsdp_peft.procedures.memory.MemoryReport`): training's (what the plan
    estimates), loading's (the model loaded and sharded, before the first step) and the whole run's."""
    names = ("peak_gpu_allocated_bytes", "peak_gpu_allocated_training_bytes", "peak_gpu_allocated_loading_bytes")
    return {name: memory.get(name) for name in (*names, "peak_gpu_reserved_bytes")}


def budget_left(args, started: float) -> float:
    return args.budget - (time.monotonic() - started)


def last_line(stderr: str) -> str:
    """Why a child run failed: its last error line (a launcher's report follows it), else its last line."""
    lines = stderr.strip().splitlines() or ["no output"]
    ours = [line for line in lines if line.startswith("error: ")]  # fsdp-peft's one-line refusals
    raised = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line) and "ChildFailedError" not in line]
    return (ours or raised or lines)[-1][:500]
