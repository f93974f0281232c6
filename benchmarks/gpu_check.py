"""GPU check (driven by benchmarks/gpu_check.sh): LoRA and QLoRA on one GPU, fsdp-peft against plain
transformers `Trainer` + peft with the same settings, for a ~1B and an 8B-shaped random-weight Llama; the
GRPO recipe on the ~1B shape: its rollouts against the unsharded model and stock TRL, and a few training steps; and a
random-weight Qwen3-MoE shape: QLoRA with its experts in 4 bits and LoRA on a bf16 base, LoRA on every expert. Before
them, bitsandbytes' 4-bit kernels against a decoder written from the formats' definition.

One module per check under ``benchmarks/gpu_checks/`` (its docstring says what it runs and measures): ``kernels``,
``sft`` (the SFT pairs and their MFU), ``grpo``, ``generation``, ``moe``, ``vision``, ``sequence_parallel``;
``common`` holds what they share. This driver runs them in that order within the budget and writes the report.

    python benchmarks/gpu_check.py --dry-run        # CPU: embedded tiny models, tiny sizes, same code path
    python benchmarks/gpu_check.py --shapes moe     # one GPU: the MoE runs alone
    python benchmarks/gpu_check.py --shapes kernels # one GPU: the 4-bit kernels against the reference alone
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path

from gpu_checks.common import (
    HERE,
    LORA,
    RECIPE_LAUNCH,
    RUN_MINIMUM_SECONDS,
    SIZES,
    TINY_MODELS,
    VISION_SIZES,
    budget_left,
    checkpoint,
    planned,
    recipe_yaml,
    scratch_directory,
)
from gpu_checks.generation import GENERATE_MODES, generate_check
from gpu_checks.grpo import GRPO_DRY_RUNS, GRPO_RUNS, GRPO_SIZES, grpo_run, grpo_summary
from gpu_checks.kernels import kernel_check, kernel_run, print_kernels
from gpu_checks.moe import EXPERT_BYTES_BOUND, MOE_DRY_RUNS, MOE_LORA, MOE_RUNS
from gpu_checks.sequence_parallel import SP_RANKS, SP_SIZES, sequence_parallel_check
from gpu_checks.sft import LIGER_IMPLS, SFT_IMPLS, run_one, sft_ratios, sft_run
from gpu_checks.vision import VISION_DRY_RUNS, VISION_RUNS, vision_check

SFT_DRY_RUNS = ("qlora",)  # the dry run's SFT pair (fsdp-peft and plain): the LoRA pair differs in load_in_4bit only


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

    from fsdp_peft.model.paths import tiny_model_path

    started = time.monotonic()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    order = (
        args.shapes
        or ("kernels,tiny,grpo,generate,moe,vlm,sp" if args.dry_run else "kernels,1b,grpo,generate,moe,vlm,sp,8b")
    ).split(",")
    shapes = {
        "grpo": "tiny" if args.dry_run else args.grpo_shape,
        "generate": "tiny" if args.dry_run else "8b",
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
            "activation_checkpointing": (
                "fsdp-peft: the recipe's auto (the plan's choice); plain: every layer; plain liger: none"
            ),
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
            "launch": f"{RECIPE_LAUNCH} --num_processes 1",
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
            "launch": f"{RECIPE_LAUNCH} --num_processes 1",
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for item in order:
        if item == "kernels":  # no model: its own random tensors
            entry = {"model": "kernels", "method": "4-bit", "impl": "vs reference"}
            measured(entry, kernel_run, args, report, started)
            continue
        shape = shapes.get(item, item)
        if item == "vlm":
            vision_check(shape, vision_runs, device, gpu_memory, args, report, started, measured)
            continue
        if item == "sp":
            report["settings"]["sp"] = {"model": shape, **SP_SIZES[shape], "ranks": SP_RANKS, "recipe": "llama_qlora"}
            sequence_parallel_check(shape, device, gpu_memory, args, report, started, measured)
            continue
        path = checkpoint(shape, device) if budget_left(args, started) >= RUN_MINIMUM_SECONDS else ""  # else skipped
        if item == "generate":  # the command's SOURCE: a directory (an embedded model's too)
            model = str(tiny_model_path(TINY_MODELS[shape])) if shape in TINY_MODELS else path
            generate_check(shape, model, GENERATE_MODES, args, report, started, measured)
            continue
        if item == "grpo":
            for mode, method in grpo_runs:
                entry = {"model": shape, "method": method, "impl": f"grpo {mode}"}
                measured(entry, lambda left: grpo_run(entry, mode, path, gpu_memory, left), args, report, started)
            report["grpo_rollouts"] = grpo_summary(report["runs"])
            args.out.write_text(json.dumps(report, indent=1))
            continue
        moe = item == "moe"  # fsdp-peft only: plain Trainer + peft cannot quantize the experts
        for method in moe_runs if moe else SFT_DRY_RUNS if args.dry_run else ("lora", "qlora"):
            directory = scratch_directory(f"gpu_check_{shape}_{method}_")
            for impl in ("fsdp-peft",) if moe else SFT_IMPLS:
                entry = {"model": shape, "method": method, "impl": impl}
                if budget_left(args, started) >= RUN_MINIMUM_SECONDS:  # else measured() records the run as skipped
                    size, lora = SIZES[shape], MOE_LORA if moe else LORA
                    steps = size.get("steps", args.steps)
                    name = "config" if impl == "fsdp-peft" else impl
                    config = recipe_yaml(directory, path, method, size["batch"], size["seq"], steps, lora, name)
                    entry["planned"] = planned(config, gpu_memory)
                if impl in LIGER_IMPLS and device != "cuda":  # Triton: no kernel runs without a GPU driver
                    planned_bytes = entry.get("planned", {}).get("allocator_bytes")
                    report["skipped"].append(
                        f"{shape}/{method}/{impl}: Liger's Triton kernels need CUDA (planned {planned_bytes} bytes)"
                    )
                    continue
                measured(entry, lambda left: sft_run(impl, config, directory, left), args, report, started)
            report["sft_ratios"] = sft_ratios(report["runs"])
            for ratio in (r for r in report["sft_ratios"] if (r["model"], r["method"]) == (shape, method)):
                print(f"{shape:<8} {method:<6} {ratio['of']} / {ratio['over']}: {ratio['ratio']:.2f}x", flush=True)
    report["seconds"] = time.monotonic() - started
    args.out.write_text(json.dumps(report, indent=1))
    print(f"written: {args.out}")


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


def peak_text(entry: dict, gib) -> str:
    """``training peak (loading peak)`` of a run, as printed."""
    training, loading = (entry.get(f"peak_gpu_allocated_{part}_bytes") for part in ("training", "loading"))
    return f"{gib(training)} (loading {gib(loading)})"


def bound_text(entry: dict) -> str:
    """A GRPO run's memory-bandwidth bound of its rollouts and the share of it they reached (n/a without a GPU)."""
    bound = entry.get("rollout_bound_tokens_per_second")
    return f"{bound:.0f} tok/s, {entry['rollout_share_of_bound']:.1%} of it" if bound else "n/a"


def print_entry(entry: dict) -> None:
    head = f"{entry['model']:<8} {entry['method']:<6} {entry['impl']:<14}"
    if "failed" in entry:
        print(f"{head} failed: {entry['failed']}")
        return
    if "matches_reference" in entry:
        print_kernels(head, entry)
        return
    if "share_of_bound" in entry:  # fsdp-peft generate
        bound = entry["bound_tokens_per_second"]
        against = f"bound {bound:.0f} tok/s, {entry['share_of_bound']:.1%} of it" if bound else "bound n/a"
        print(
            f"{head} {entry['tokens_per_second']:>9.1f} tok/s ({against}); first call {entry['first_call_seconds']:.1f}"
            f" s, {entry['graphs_compiled']} graphs compiled",
            flush=True,
        )
        return
    from fsdp_peft.tools.plan import gib as size

    gib = lambda v: size(v) if v else "n/a"  # noqa: E731
    if "rollout_tokens_per_second" in entry:
        number = lambda v: f"{v:.4g}" if v is not None else "n/a"  # noqa: E731
        print(
            f"{head} rollouts {entry['rollout_tokens_per_second']:>8.0f} tok/s (bound {bound_text(entry)})"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU: the embedded tiny model, tiny sizes")
    parser.add_argument(
        "--shapes",
        help="what runs, in this order: kernels (4-bit kernels against the reference decoder), SFT model shapes, grpo"
        " (the GRPO runs), generate (fsdp-peft generate), moe (the MoE runs), vlm (the vision-language runs) and sp"
        " (sequence parallelism); default kernels,1b,grpo,generate,moe,vlm,sp,8b (dry run: kernels,tiny,grpo,"
        "generate,moe,vlm,sp)",
    )
    parser.add_argument("--grpo-shape", default="1b", choices=sorted(GRPO_SIZES), help="the GRPO runs' model shape")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first two are not timed)")
    parser.add_argument("--budget", type=float, default=420, help="seconds for all runs together")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gpu_check.json")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kernels", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=SFT_IMPLS, help=argparse.SUPPRESS)
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
