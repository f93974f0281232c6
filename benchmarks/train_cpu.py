"""CPU training benchmark: LoRA and QLoRA recipes at world size 1 (one process, no FSDP) and 2 (FSDP2, gloo).

For the embedded tiny model and a ~100M-parameter Llama (`benchmarks/models.py`: 134M, random weights),
each configuration runs the real recipe for a few steps, as a user launches it, and reads back:

- step time and tokens/s (``results.json``; the mean over the run, first step included),
- per-rank bytes of parameters, gradients and optimizer states, counted tensor by tensor after the
  first optimizer step, and peak RSS per rank after loading and over the run (``memory.json``,
  written by `fsdp_peft.procedures.memory.MemoryReport`),
- the planner's figures for the same config (`fsdp_peft.tools.plan`), next to the measured ones;

and, for the ~100M model at world size 2, peak RSS while loading with ``fsdp_cpu_ram_efficient_loading``
on and off. It prints a table and writes ``benchmarks/results/train_cpu.json``.

    python benchmarks/train_cpu.py                       # everything (about 10-20 minutes on 2 cores)
    python benchmarks/train_cpu.py --models tiny --steps 3

Threads: 2 per process at world size 1, 1 per process at world size 2 (the machine's 2 cores either way).
Timings on a shared machine are noisy; the byte counts are exact and do not depend on load.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

CPU_FSDP2 = REPO / "configs" / "accelerate" / "cpu_fsdp2.yaml"
RECIPES = {"lora": "llama_lora", "qlora": "llama_qlora"}
GLOBAL_BATCH = {"tiny": 16, "100m": 8}
SEQ_LENGTH = 64


def scratch_directory(prefix: str) -> Path:
    """A new temporary directory for one run's config and outputs, removed when this process exits."""
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def model_path(name: str) -> str:
    from models import llama_100m_path

    return "tiny-llama" if name == "tiny" else str(llama_100m_path())


def short_run_config(directory: Path, method: str, **values) -> Path:
    """A recipe YAML for a benchmark run: the recipe's tiny default, ``values`` over it, and a short,
    evaluation-free schedule writing into ``directory/out``."""
    values = {
        "include": str(REPO / "configs" / RECIPES[method] / "tiny.yaml"),
        **values,
        "warmup_steps": 0,
        "logging_steps": 1,
        "generate_samples": 0,
        "generate_eval_samples": 0,
        "output_dir": str(directory / "out"),
    }
    path = directory / "config.yaml"
    path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in values.items()))
    return path


def write_config(directory: Path, model: str, method: str, world: int, steps: int) -> Path:
    """The run's recipe YAML: a model, its global batch over ``world`` ranks, ``steps`` steps."""
    return short_run_config(
        directory,
        method,
        model_name_or_path=model_path(model),
        max_steps=steps,
        per_device_train_batch_size=GLOBAL_BATCH[model] // world,
        max_seq_length=SEQ_LENGTH,
    )


def accelerate_config(directory: Path, low_memory_loading: bool) -> Path:
    """configs/accelerate/cpu_fsdp2.yaml, with ``fsdp_cpu_ram_efficient_loading`` switched as asked."""
    text = CPU_FSDP2.read_text().replace(
        "fsdp_cpu_ram_efficient_loading: false", f"fsdp_cpu_ram_efficient_loading: {str(low_memory_loading).lower()}"
    )
    path = directory / "accelerate.yaml"
    path.write_text(text)
    return path


def launch(
    config: Path, method: str, world: int, launcher: Path | None
) -> tuple[list[str], subprocess.CompletedProcess]:
    recipe = str(REPO / "recipes" / f"{RECIPES[method]}.py")
    if world == 1:
        command = [sys.executable, recipe, "--config", str(config)]
    else:
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(launcher),
            "--num_processes",
            str(world),
            "--main_process_port",
            "0",
            recipe,
            "--config",
            str(config),
        ]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, 2 // world)), "TOKENIZERS_PARALLELISM": "false"}
    return command, subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)


def planned(config: Path, world: int, launcher: Path | None) -> dict:
    """The planner's figures for the run's config (what `fsdp-peft plan` prints)."""
    from fsdp_peft.cli import _environment, launcher_environment
    from fsdp_peft.procedures.registry import plan_config

    with _environment(launcher_environment(launcher) if launcher else {}):
        plan = plan_config(config, world, 80 * 2**30)
    return {
        "parameter_bytes": plan.gpu["base weights (shard)"] + plan.gpu["adapter weights (shard)"],
        "gradient_bytes": plan.gpu["gradients (shard)"],
        "optimizer_state_bytes": plan.gpu["optimizer states (shard)"],
        "parameter_gradient_optimizer_bytes": plan.parameter_gradient_optimizer_bytes,
        "quantization_constant_bytes": plan.gpu["quantization constants (whole)"],
        "loading_host_bytes_per_node": plan.host["loading: checkpoint copies (est.)"],
    }


def run_one(model: str, method: str, world: int, steps: int, low_memory_loading: bool = False) -> dict:
    directory = scratch_directory(f"train_cpu_{model}_{method}_ws{world}_")
    config = write_config(directory, model, method, world, steps)
    launcher = accelerate_config(directory, low_memory_loading) if world > 1 else None
    command, result = launch(config, method, world, launcher)
    entry = {
        "model": model,
        "method": method,
        "world_size": world,
        "low_memory_loading": low_memory_loading,
        "command": " ".join(command),
        "config": config.read_text(),
    }
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:") or "Error" in line]
        entry["failed"] = (errors or result.stderr.splitlines() or ["no output"])[-1][:400]
        return entry
    results = json.loads((directory / "out" / "results.json").read_text())
    memory = json.loads((directory / "out" / "memory.json").read_text())
    ranks = memory["ranks"]
    largest = max(ranks, key=lambda r: r["parameter_gradient_optimizer_bytes"])
    entry.update(
        steps=results["steps"],
        tokens=results["tokens"],
        train_seconds=results["train_seconds"],
        step_seconds=results["train_seconds"] / results["steps"],
        tokens_per_second=results["tokens"] / results["train_seconds"],
        measured={
            key: largest[key]
            for key in (
                "parameter_bytes",
                "gradient_bytes",
                "optimizer_state_bytes",
                "parameter_gradient_optimizer_bytes",
                "quantization_constant_bytes",
            )
        },
        peak_rss_bytes_per_rank=[r["peak_rss_bytes"] for r in ranks],
        loading_peak_rss_bytes_per_rank=[r["peak_rss_after_loading_bytes"] for r in ranks],
        planned=planned(config, world, launcher),
    )
    entry["planner_relative_error"] = {
        key: entry["planned"][key] / entry["measured"][key] - 1
        for key in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "parameter_gradient_optimizer_bytes")
        if entry["measured"][key]
    }
    return entry


def versions() -> dict:
    import accelerate
    import bitsandbytes
    import peft
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "peft": peft.__version__,
        "bitsandbytes": bitsandbytes.__version__,
    }


def mib(value: int) -> str:
    return f"{value / 2**20:.2f}"


def print_table(runs: list[dict]) -> None:
    print(
        f"{'model':<6}{'method':<7}{'ws':>3}{'lowmem':>7}{'step s':>8}{'tok/s':>8}{'p+g+o MiB':>11}"
        f"{'plan MiB':>10}{'err':>8}{'loadRSS MiB':>13}{'peakRSS MiB':>13}"
    )
    for r in runs:
        head = f"{r['model']:<6}{r['method']:<7}{r['world_size']:>3}{str(r['low_memory_loading'])[0]:>7}"
        if "failed" in r:
            print(f"{head}  failed: {r['failed']}")
            continue
        measured, plan = (
            r["measured"]["parameter_gradient_optimizer_bytes"],
            r["planned"]["parameter_gradient_optimizer_bytes"],
        )
        print(
            f"{head}{r['step_seconds']:>8.2f}{r['tokens_per_second']:>8.0f}{mib(measured):>11}{mib(plan):>10}"
            f"{r['planner_relative_error']['parameter_gradient_optimizer_bytes']:>+8.2%}"
            f"{mib(max(r['loading_peak_rss_bytes_per_rank'])):>13}{mib(max(r['peak_rss_bytes_per_rank'])):>13}"
        )


def ratios(runs: list[dict]) -> dict:
    """Per-rank parameter + gradient + optimizer bytes at world size 2 over world size 1, per model and method."""
    found = {}
    for one in runs:
        if one["world_size"] != 1 or "failed" in one:
            continue
        for two in runs:
            if (two["model"], two["method"], two["world_size"], two["low_memory_loading"]) == (
                one["model"],
                one["method"],
                2,
                False,
            ) and "failed" not in two:
                key = f"{one['model']}/{one['method']}"
                found[key] = (
                    two["measured"]["parameter_gradient_optimizer_bytes"]
                    / one["measured"]["parameter_gradient_optimizer_bytes"]
                )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,100m", help="comma-separated: tiny, 100m")
    parser.add_argument("--methods", default="lora,qlora", help="comma-separated: lora, qlora")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "train_cpu.json")
    args = parser.parse_args()
    runs = []
    for model in args.models.split(","):
        for method in args.methods.split(","):
            for world in (1, 2):
                runs.append(run_one(model, method, world, args.steps))
                print_table(runs[-1:])
            if model == "100m":
                runs.append(run_one(model, method, 2, args.steps, low_memory_loading=True))
                print_table(runs[-1:])
    print("\nall runs (CPU shared with other work: timings are noisy; byte counts are exact)")
    print_table(runs)
    found = ratios(runs)
    for key, value in found.items():
        print(f"per-rank params+grads+optimizer, world size 2 / 1, {key}: {value:.3f}")
    report = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/train_cpu.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, shared with other work (timings noisy)",
        "versions": versions(),
        "threads": "2 per process at world size 1, 1 per process at world size 2",
        "runs": runs,
        "world2_over_world1_parameter_gradient_optimizer_bytes": found,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
