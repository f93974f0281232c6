"""GPU check (driven by benchmarks/gpu_check.sh): LoRA and QLoRA on one GPU, fsdp-peft against plain
transformers `Trainer` + peft with the same settings, for a ~1B and an 8B-shaped random-weight Llama; and the
GRPO recipe on the ~1B shape: its rollouts against the unsharded model and stock TRL, and a few training steps.

Each run is its own process (clean peak-memory counters) and trains ``--steps`` optimizer steps on random
token ids (``--seq`` tokens per row, ``--batch`` rows per step, bf16, gradient checkpointing, AdamW, LoRA
r=16 on all linear layers, dropout 0.05):

- ``fsdp-peft``: `fsdp_peft.modeling.load_base_model` + `attach_lora` + `fsdp_peft.trainer.PeftFsdpTrainer`
  (one GPU: no FSDP; the library's loading, adapter dtypes and trainer);
- ``plain``: ``AutoModelForCausalLM.from_pretrained(quantization_config=...)`` + ``peft.get_peft_model`` +
  ``transformers.Trainer``.

Measured: tokens/s over the steps after the first two (synchronised step times), peak GPU memory
(``torch.cuda.max_memory_allocated`` and ``..._reserved``), model FLOPs utilisation, and the exact
per-rank parameter + gradient + optimizer bytes (`fsdp_peft.memory.MemoryReport`); next to the planner's
estimate (`fsdp_peft.plan`, CUDA-context row left out, as torch's allocator does not see it).

MFU = model FLOPs per token x tokens/s / peak dense bf16 FLOPs of the GPU. Model FLOPs per token of
LoRA training: 4 x (frozen matmul parameters, head included) [forward + input gradients] + 6 x (adapter
parameters) + 12 x layers x seq x hidden [attention scores and values, forward and backward]; the
recomputation of gradient checkpointing is not counted (it is not model work).

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

    python benchmarks/gpu_check.py --dry-run        # CPU: embedded tiny model, tiny sizes, same code path
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
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
SIZES = {  # model shape: rows per step, tokens per row
    "1b": {"batch": 8, "seq": 2048},
    "8b": {"batch": 4, "seq": 2048},
    "tiny": {"batch": 2, "seq": 32},
}
GRPO_SIZES = {  # GRPO model shape: completions per step, tokens per completion, steps (the first one untimed)
    "1b": {"completions": 64, "completion_tokens": 128, "steps": 4},
    "tiny": {"completions": 8, "completion_tokens": 8, "steps": 2},
}
GRPO_RUNS = (("recipe", "lora"), ("recipe", "qlora"), ("unsharded", "lora"), ("stock", "lora"))  # most important first
# The dry run (CI) keeps to two runs, ~13 s each on 2 cores (start-up): both launches, both methods; the other two
# differ from these only in one recipe key (generate_gather_budget: none) or the method.
GRPO_DRY_RUNS = (("recipe", "qlora"), ("unsharded", "lora"))
GRPO_LAUNCH = "configs/accelerate/fsdp2.yaml"  # one rank, on one GPU or (dry run) the CPU


def checkpoint(shape: str, device: str) -> Path:
    from models import checkpoint_path

    from fsdp_peft.paths import tiny_model_path

    if shape == "tiny":
        return tiny_model_path()
    path = checkpoint_path(shape, "bfloat16", device)
    if device == "cuda":  # the runs are child processes: give them the memory the build cached here
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
    return path


def write_yaml(path: Path, values: dict) -> Path:
    path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in values.items()))
    return path


def recipe_yaml(directory: Path, model: Path, method: str, batch: int, seq: int, steps: int) -> Path:
    """The recipe config both implementations follow (also what the planner reads)."""
    values = {
        "model_name_or_path": str(model),
        "torch_dtype": "bfloat16",
        "load_in_4bit": method == "qlora",
        "bnb_4bit_quant_storage": "bfloat16",
        **LORA,
        "max_seq_length": seq,
        "per_device_train_batch_size": batch,
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
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
    }
    return write_yaml(directory / "config.yaml", values)


def grpo_yaml(directory: Path, model: Path, method: str, batch: int, completion_tokens: int, steps: int) -> Path:
    """The GRPO recipe config of a GRPO run (``batch`` completions per rank and step; also what the planner reads)."""
    values = {
        "model_name_or_path": str(model),
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
        "activation_checkpointing": True,
        "activation_checkpointing_kwargs": {"use_reentrant": False},
        "bf16": True,
        "max_steps": steps,
        "learning_rate": 1e-5,
        "lr_scheduler_type": "constant",
        "optim": "adamw_torch",
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "output_dir": str(directory / "out"),
        "disable_tqdm": True,
        "seed": 0,
    }
    return write_yaml(directory / "grpo.yaml", values)


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

    config = model.config
    frozen = adapters = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):  # bitsandbytes' Linear4bit included; peft's wrappers are not
            features = module.in_features * module.out_features
            if ".lora_" in name:
                adapters += features
            else:
                frozen += features
    attention = 12 * config.num_hidden_layers * seq * config.hidden_size
    return 4 * frozen + 6 * adapters + attention


def run_one(args) -> dict:
    """One measured run in this process: ``args.impl`` on ``args.shape`` with ``args.method``."""
    # isort: off
    import fsdp_peft  # noqa: F401  first: its import hook keeps bitsandbytes' compiler out of the start

    # isort: on
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, default_data_collator

    from fsdp_peft.config import build_training_arguments, resolve_recipe_config
    from fsdp_peft.memory import MemoryReport
    from fsdp_peft.modeling import attach_lora, load_base_model, local_device, quantization_config

    config_path = Path(args.config)
    recipe, training_values, _ = resolve_recipe_config(["--config", str(config_path)], config_path, "outputs")
    training = build_training_arguments(training_values, config_path)
    on_gpu = torch.cuda.is_available()

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_end(self, *a, **k):
            if on_gpu:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())

    timer, memory = StepTimes(), MemoryReport()
    started = time.perf_counter()
    if args.impl == "fsdp-peft":
        from fsdp_peft.trainer import PeftFsdpTrainer

        model = attach_lora(load_base_model(recipe), recipe, training)
        make = lambda **kw: PeftFsdpTrainer(**kw, callbacks=[timer])  # noqa: E731  (MemoryReport is built in)
    else:
        from peft import LoraConfig, get_peft_model

        base = AutoModelForCausalLM.from_pretrained(
            recipe.model_name_or_path,
            dtype=torch.bfloat16,
            quantization_config=quantization_config(recipe),
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
    result = {
        "load_seconds": load_seconds,
        "step_seconds_median": seconds,
        "tokens_per_second": tokens_per_step / seconds,
        "model_flops_per_token": flops_per_token,
        "parameter_gradient_optimizer_bytes": report.get("parameter_gradient_optimizer_bytes"),
        "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated() if on_gpu else None,
        "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved() if on_gpu else None,
        "peak_rss_bytes": report.get("peak_rss_bytes"),
        "final_loss": next((e["loss"] for e in reversed(trainer.state.log_history) if "loss" in e), None),
    }
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if on_gpu and k in torch.cuda.get_device_name()), None)
    result["mfu"] = flops_per_token * result["tokens_per_second"] / peak if peak else None
    return result


def planned(config: Path, gpu_memory: int) -> dict:
    from fsdp_peft.plan import CUDA_CONTEXT_BYTES, plan_memory

    plan = plan_memory(config, 1, gpu_memory)
    return {
        "allocator_bytes": plan.gpu_total - CUDA_CONTEXT_BYTES,
        "total_with_context_bytes": plan.gpu_total,
        "parameter_gradient_optimizer_bytes": plan.parameter_gradient_optimizer_bytes,
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
    order = (args.shapes or ("tiny,grpo" if args.dry_run else "1b,grpo,8b")).split(",")
    grpo_shape = "tiny" if args.dry_run else args.grpo_shape
    gpu_memory = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 80 * 2**30
    report = {
        **environment(),
        "command": "bash benchmarks/gpu_check.sh" + (" --dry-run" if args.dry_run else ""),
        "dry_run": args.dry_run,
        "settings": {
            **LORA,
            "steps": args.steps,
            "sizes": {s: SIZES[s] for s in order if s in SIZES},
            "bf16": True,
            "gradient_checkpointing": True,
            "optim": "adamw_torch",
        },
        "runs": [],
        "skipped": [],
    }
    grpo_runs = GRPO_DRY_RUNS if args.dry_run else GRPO_RUNS
    if "grpo" in order:
        report["settings"]["grpo"] = {
            "model": grpo_shape,
            **GRPO_SIZES[grpo_shape],
            "launch": f"{GRPO_LAUNCH} --num_processes 1",
            "runs": [" ".join(r) for r in grpo_runs],
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for item in order:
        shape = grpo_shape if item == "grpo" else item
        path = checkpoint(shape, device)
        if item == "grpo":
            for mode, method in grpo_runs:
                entry = {"model": shape, "method": method, "impl": f"grpo {mode}"}
                measured(entry, lambda left: grpo_run(entry, mode, path, gpu_memory, left), args, report, started)
            report["grpo_rollouts"] = grpo_summary(report["runs"])
            args.out.write_text(json.dumps(report, indent=1))
            continue
        for method in ("lora", "qlora"):
            directory = Path(tempfile.mkdtemp(prefix=f"gpu_check_{shape}_{method}_"))
            size = SIZES[shape]
            config = recipe_yaml(directory, path, method, size["batch"], size["seq"], args.steps)
            plan = planned(config, gpu_memory)
            for impl in ("fsdp-peft", "plain"):
                entry = {"model": shape, "method": method, "impl": impl, "planned": plan}
                measured(entry, lambda left: sft_run(impl, config, directory, left), args, report, started)
    report["seconds"] = time.monotonic() - started
    args.out.write_text(json.dumps(report, indent=1))
    print(f"written: {args.out}")


def measured(entry: dict, run, args, report: dict, started: float) -> None:
    """``run(seconds left)``'s figures (or why it failed) into ``entry``, and ``entry`` into the report; skipped when
    less than 30 s of the budget are left."""
    left = args.budget - (time.monotonic() - started)
    if left < 30:
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
    if entry.get("peak_gpu_allocated_bytes") and entry.get("planned"):
        entry["planned_over_measured_peak"] = entry["planned"]["allocator_bytes"] / entry["peak_gpu_allocated_bytes"]
    report["runs"].append(entry)
    print_entry(entry)
    args.out.write_text(json.dumps(report, indent=1))


def last_line(stderr: str) -> str:
    return (stderr.strip().splitlines() or ["no output"])[-1][:500]


def sft_run(impl: str, config: Path, directory: Path, left: float) -> dict:
    """One SFT run (`run_one` in a child process)."""
    out = directory / f"{impl}.json"
    command = [sys.executable, __file__, "--one", "--impl", impl, "--config", str(config), "--result", str(out)]
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
    import math

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
        "peak_gpu_allocated_bytes": record.get("peak_gpu_allocated_bytes"),
        "peak_gpu_reserved_bytes": record.get("peak_gpu_reserved_bytes"),
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


def print_entry(entry: dict) -> None:
    head = f"{entry['model']:<5} {entry['method']:<6} {entry['impl']:<14}"
    if "failed" in entry:
        print(f"{head} failed: {entry['failed']}")
        return
    from fsdp_peft.plan import gib as size

    gib = lambda v: size(v) if v else "n/a"  # noqa: E731
    if "rollout_tokens_per_second" in entry:
        number = lambda v: f"{v:.4g}" if v is not None else "n/a"  # noqa: E731
        print(
            f"{head} rollouts {entry['rollout_tokens_per_second']:>8.0f} tok/s"
            f"  step {entry['tokens_per_second']:>8.0f} tok/s (training {entry['training_tokens_per_second']:.0f})"
            f"  peak {gib(entry['peak_gpu_allocated_bytes'])}  planned {gib(entry['planned']['allocator_bytes'])}"
            f"  loss {number(entry['final_loss'])} reward {number(entry['final_reward'])}"
            f" ({'finite' if entry['loss_and_reward_finite'] else 'NOT FINITE'})",
            flush=True,
        )
        return
    mfu = f"{entry['mfu']:.1%}" if entry.get("mfu") else "n/a"
    print(
        f"{head} {entry['tokens_per_second']:>9.0f} tok/s  MFU {mfu:>6}  peak {gib(entry['peak_gpu_allocated_bytes'])}"
        f"  planned {gib(entry['planned']['allocator_bytes'])}"
        f"  p+g+o {gib(entry['parameter_gradient_optimizer_bytes'])}"
        f" (planned {gib(entry['planned']['parameter_gradient_optimizer_bytes'])})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU: the embedded tiny model, tiny sizes")
    parser.add_argument(
        "--shapes",
        help="what runs, in this order: SFT model shapes and grpo (the GRPO runs); default 1b,grpo,8b"
        " (dry run: tiny,grpo)",
    )
    parser.add_argument("--grpo-shape", default="1b", choices=sorted(GRPO_SIZES), help="the GRPO runs' model shape")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first two are not timed)")
    parser.add_argument("--budget", type=float, default=420, help="seconds for all runs together")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gpu_check.json")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=["fsdp-peft", "plain"], help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.result.write_text(json.dumps(run_one(args)))
    else:
        drive(args)


if __name__ == "__main__":
    main()
