"""Sharded evaluation benchmark: wall time per sample of ``fsdp-peft eval`` on 2 FSDP2 ranks against one process.

One short LoRA run of `recipes/llama_lora.py` (the embedded tiny Llama, 2 CPU ranks, a checkpoint and an fp32
merged export at its last step), then, alternating so that the machine's load falls on both alike:

- ``sharded``: the checkpoint under ``torchrun --nproc_per_node 2`` (FSDP2 over 2 gloo ranks, each rank taking
  every second document, as docs/eval.md describes);
- ``one process``: the merged export in one process (no process group, no FSDP).

Both evaluate the shipped tasks ``tiny_reverse`` (200 greedy completions and 200 log-likelihoods); the time is the
harness's own evaluation (`eval.json`'s ``seconds_per_sample``: requests built, scored, gathered, metrics), not the
processes' start-up or the model's loading. Prints a table and writes ``benchmarks/results/eval_speed.json``.

    python benchmarks/eval_speed.py
    python benchmarks/eval_speed.py --steps 90 --repeats 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CPU_FSDP2 = "configs/accelerate/cpu_fsdp2.yaml"
MODES = ("sharded", "one process")


def run(command: list[str], log: Path) -> None:
    with open(log, "w") as handle:
        finished = subprocess.run(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT)
    if finished.returncode != 0:
        sys.exit(f"failed (exit {finished.returncode}): {' '.join(command)}\n{log.read_text()[-3000:]}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def train(work: Path, steps: int) -> Path:
    out = work / "run"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_FSDP2]
    command += ["--main_process_port", str(free_port()), "recipes/llama_lora.py", "--output_dir", str(out)]
    command += ["--max_steps", str(steps), "--warmup_steps", "0", "--lr_scheduler_type", "constant"]
    command += ["--save_strategy", "steps", "--save_steps", str(steps), "--generate_eval_samples", "0"]
    command += ["--export_merged", "true", "--export_dtype", "fp32"]
    run(command, work / "train.log")
    return out


def evaluate(mode: str, run_dir: Path, steps: int, out: Path) -> dict:
    cli = ["-m", "fsdp_peft.cli", "eval"]
    if mode == "sharded":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        command = [*launcher, "--master_port", str(free_port()), *cli, str(run_dir / f"checkpoint-{steps}")]
    else:
        command = [sys.executable, *cli, str(run_dir / "merged")]
    run([*command, "--tasks", "tiny_reverse", "--out", str(out)], out.with_suffix(".log"))
    return json.loads((out / "eval.json").read_text())


def alike(tasks: dict, reference: dict) -> bool:
    """The same counts and accuracies, and aggregates of log-likelihoods (perplexity) within 1e-5 of each other:
    the merged fp32 weights and base + adapter round differently (docs/eval.md: within 5.7e-6 per sample)."""
    return tasks.keys() == reference.keys() and all(
        tasks[t].keys() == reference[t].keys()
        and all(abs(tasks[t][k] - v) <= 1e-5 * max(1.0, abs(v)) for k, v in reference[t].items())
        for t in reference
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=90, help="training steps of the evaluated adapter")
    parser.add_argument("--repeats", type=int, default=4, help="evaluations of each kind, alternating")
    parser.add_argument("--results", type=Path, default=HERE / "results" / "eval_speed.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="eval_speed_") as work_name:
        work = Path(work_name)
        run_dir = train(work, args.steps)
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            for mode in MODES:
                summary = evaluate(mode, run_dir, args.steps, work / f"{mode.replace(' ', '_')}_{repeat}")
                runs[mode].append(summary)
    per_sample = {mode: [s["seconds_per_sample"] * 1000 for s in runs[mode]] for mode in MODES}
    medians = {mode: statistics.median(values) for mode, values in per_sample.items()}
    ratio = medians["sharded"] / medians["one process"]
    worst = max(per_sample["sharded"]) / min(per_sample["one process"])
    samples = {mode: sum(t["samples"] for t in runs[mode][0]["tasks"].values()) for mode in MODES}
    reference = runs["one process"][0]["tasks"]
    same_figures = all(alike(s["tasks"], reference) for mode in MODES for s in runs[mode])
    print(f"{'':12} {'samples':>8} {'ms per sample (each run)':>40} {'median':>8}")
    for mode in MODES:
        shown = ", ".join(f"{value:.2f}" for value in per_sample[mode])
        print(f"{mode:12} {samples[mode]:>8} {shown:>40} {medians[mode]:>8.2f}")
    print(f"sharded / one process: median {ratio:.2f}x, slowest sharded / fastest one process {worst:.2f}x")
    print(f"same figures in every run (perplexity within 1e-5): {same_figures}")
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "load_average_after": os.getloadavg(),
        "steps": args.steps,
        "repeats": args.repeats,
        "ms_per_sample": per_sample,
        "median_ms_per_sample": medians,
        "sharded_over_one_process_median": ratio,
        "slowest_sharded_over_fastest_one_process": worst,
        "same_figures": same_figures,
        "figures": runs["one process"][0]["tasks"],
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(record, indent=1))
    print(f"results: {args.results}")


if __name__ == "__main__":
    main()
