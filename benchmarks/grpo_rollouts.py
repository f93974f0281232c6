"""GRPO rollout benchmark: generated tokens/s of the recipe's rollouts against the unsharded model and stock TRL.

Three runs of `recipes/llama_grpo.py` (the embedded tiny Llama, fp32 LoRA, a fresh adapter), the same seed, global
batch and sampling settings; each times every rollout call (TRL's ``_generate_single_turn``) after the first:

- ``recipe``: FSDP2 over 2 gloo ranks, every unit gathered once per ``generate`` call (the recipe's path);
- ``stock``: the same sharding with ``generate_gather_budget: none``: TRL 1.16's own path on an FSDP2 model,
  each layer gathered and freed again at every decoded token;
- ``unsharded``: one process, no FSDP, the whole global batch in one call (``python recipes/llama_grpo.py``).

Every completion runs to ``--completion-tokens`` (``min_new_tokens`` set on TRL's generation config), so the three
do the same decoding work. Prints a table and writes ``benchmarks/results/grpo_rollouts.json``.

    python benchmarks/grpo_rollouts.py
    python benchmarks/grpo_rollouts.py --steps 8 --completion-tokens 32

`benchmarks/gpu_check.py` runs the same modes through `run` on one GPU (any recipe config, launcher config and
process count), and reads the rest of what the worker records: each step's end, TRL's logged metrics and the
peak GPU memory.
"""

from __future__ import annotations

import argparse
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
MODES = ("recipe", "stock", "unsharded")
CPU_FSDP2 = "configs/accelerate/cpu_fsdp2.yaml"


class RunFailed(RuntimeError):
    """A run that exited with an error; the message ends with its standard error."""


def timed_recipe(result_path: str) -> None:
    """Run the GRPO recipe (this process is one rank, or the unsharded process); rank 0 records in ``result_path``
    every rollout call (TRL's ``_generate_single_turn``: seconds, this rank's completion tokens), every optimizer
    step's end, and at the end TRL's logged metrics and the peak GPU memory of training (none on CPU)."""
    import torch
    from transformers import TrainerCallback

    from fsdp_peft.procedures import rl
    from fsdp_peft.recipe import run_recipe
    from fsdp_peft.settings.catalog import CONFIGS

    record: dict = {"calls": [], "step_ends": []}
    on_gpu = torch.cuda.is_available()

    def now() -> float:
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter()

    def write() -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            Path(result_path).write_text(json.dumps(record))

    class Record(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            if on_gpu:
                torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, *args, **kwargs):
            record["step_ends"].append(now())

        def on_train_end(self, args, state, *rest, **kwargs):
            record["log_history"] = state.log_history
            if on_gpu:
                record["peak_gpu_allocated_bytes"] = torch.cuda.max_memory_allocated()
                record["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved()
            write()

    class TimedRollouts(rl.rollout_trainer()):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.generation_config.min_new_tokens = self.args.max_completion_length  # the same work in every run
            self.add_callback(Record())

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
            started = now()
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            record["calls"].append((now() - started, sum(len(c) for c in completion_ids)))
            write()
            return completion_ids, logprobs

    rl.rollout_trainer = lambda: TimedRollouts
    run_recipe("llama_grpo", CONFIGS / "llama_grpo" / "tiny.yaml", procedure=rl.GRPO_PROCEDURE)


def run(
    mode: str,
    directory: Path,
    *,
    steps: int,
    completions: int,
    completion_tokens: int,
    recipe_args: tuple[str, ...] = (),
    sharded_processes: int = 2,
    accelerate_config: str = CPU_FSDP2,
    timeout: float | None = None,
) -> dict:
    """One run of `recipes/llama_grpo.py` in ``mode`` (``recipe_args`` first: ``--config FILE`` and other keys),
    ``completions`` per step over all ranks; returns what its worker recorded (`timed_recipe`), with the number of
    ``processes`` and the run's ``output_dir``. Raises `RunFailed`, or ``subprocess.TimeoutExpired`` after
    ``timeout`` seconds."""
    result = directory / f"{mode}.json"
    processes = 1 if mode == "unsharded" else sharded_processes
    overrides = [
        *recipe_args,
        "--output_dir",
        str(directory / mode),
        "--max_steps",
        str(steps),
        "--per_device_train_batch_size",
        str(completions // processes),
        "--num_generations",
        "8",
        "--max_completion_length",
        str(completion_tokens),
        "--generate_samples",
        "0",
        "--save_strategy",
        "no",
        "--disable_tqdm",
        "true",
        "--generate_gather_budget",
        "none" if mode == "stock" else "auto",
    ]
    script = [str(Path(__file__).resolve()), "--worker", str(result)]
    if mode == "unsharded":
        command = [sys.executable, *script, *overrides]
    else:
        launcher = ["-m", "accelerate.commands.launch", "--config_file", accelerate_config]
        launcher += ["--num_processes", str(processes), "--main_process_port", str(free_port())]
        command = [sys.executable, *launcher, *script, *overrides]
    env = child_env(TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=timeout)
    if finished.returncode != 0:
        raise RunFailed(f"{mode} run failed:\n{finished.stderr[-4000:]}")
    return {**json.loads(result.read_text()), "processes": processes, "output_dir": str(directory / mode)}


def rollout_figures(record: dict) -> dict:
    """Generated tokens/s of a run's rollout calls, all ranks together; the first call warms up and is left out."""
    calls = record["calls"][1:]
    seconds = sum(s for s, _ in calls) / len(calls)
    tokens = sum(t for _, t in calls) / len(calls) * record["processes"]  # every rank decodes its own completions
    return {
        "processes": record["processes"],
        "calls_timed": len(calls),
        "seconds_per_call": seconds,
        "tokens_per_call": tokens,
        "tokens_per_second": tokens / seconds,
    }


def child_env(**values: str) -> dict:
    """The environment of a child run: this one, the repository first on PYTHONPATH (what was there stays after it:
    packages installed to a --target directory, say), and ``values``."""
    path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path, **values}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps per run; one rollout call each")
    parser.add_argument("--completions", type=int, default=64, help="completions per step, all ranks together")
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args, recipe_overrides = parser.parse_known_args()
    if args.worker:
        sys.argv = [sys.argv[0], *recipe_overrides]
        return timed_recipe(args.worker)
    sizes = {"steps": args.steps, "completions": args.completions, "completion_tokens": args.completion_tokens}
    with tempfile.TemporaryDirectory(prefix="grpo_rollouts_") as directory:
        try:
            runs = {mode: rollout_figures(run(mode, Path(directory), **sizes)) for mode in MODES}
        except RunFailed as failed:
            sys.exit(str(failed))
    for mode, r in runs.items():
        print(
            f"{mode:>10}: {r['tokens_per_second']:8.1f} tokens/s  ({r['seconds_per_call']:.3f} s per call of "
            f"{r['tokens_per_call']:.0f} tokens, {r['processes']} process(es), {r['calls_timed']} calls timed)"
        )
    over_unsharded = runs["recipe"]["tokens_per_second"] / runs["unsharded"]["tokens_per_second"]
    over_stock = runs["recipe"]["tokens_per_second"] / runs["stock"]["tokens_per_second"]
    print(f"recipe / unsharded: {over_unsharded:.2f} (goal >= 0.8); recipe / stock TRL: {over_stock:.2f} (goal >= 2.5)")
    import torch
    import transformers
    import trl

    report = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/grpo_rollouts.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} {os.cpu_count()} CPU cores, {platform.processor() or platform.system()}",
        "load_average_at_end": os.getloadavg()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "steps": args.steps,
        "completions_per_step": args.completions,
        "completion_tokens": args.completion_tokens,
        "runs": runs,
        "recipe_over_unsharded": over_unsharded,
        "recipe_over_stock": over_stock,
    }
    out = HERE / "results" / "grpo_rollouts.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
