"""GRPO runs (``grpo`` in ``--shapes``; `recipes/llama_grpo.py` on the ``--grpo-shape`` model, launched by
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
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from gpu_checks.common import (
    LORA,
    RECIPE_LAUNCH,
    last_line,
    peak_memory_bandwidth,
    peaks,
    planned,
    recipe_training,
    scratch_directory,
    write_yaml,
)

GRPO_SIZES = {  # GRPO model shape: completions per step, tokens per completion, steps (the first one untimed)
    "1b": {"completions": 64, "completion_tokens": 128, "steps": 4},
    "tiny": {"completions": 8, "completion_tokens": 8, "steps": 2},
}


GRPO_RUNS = (("recipe", "lora"), ("recipe", "qlora"), ("unsharded", "lora"), ("stock", "lora"))  # most important first


# The dry run (CI) keeps to two runs, ~13 s each on 2 cores (start-up): both launches, both methods; the other two
# differ from these only in one recipe key (generate_gather_budget: none) or the method.
GRPO_DRY_RUNS = (("recipe", "qlora"), ("unsharded", "lora"))


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


def grpo_run(entry: dict, mode: str, model: Path, gpu_memory: int, left: float) -> dict:
    """One GRPO run of the recipe in ``mode`` (`grpo_rollouts.run`, one process); its plan goes into ``entry`` first."""
    import grpo_rollouts

    size = GRPO_SIZES[entry["model"]]
    directory = scratch_directory(f"gpu_check_grpo_{mode}_{entry['method']}_")
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
            accelerate_config=RECIPE_LAUNCH,
            timeout=left,
        )
    except grpo_rollouts.RunFailed as failed:
        return {"failed": last_line(str(failed))}
    figures = grpo_figures(record)
    return figures | rollout_bound(figures, entry["planned"]["components"], size["completion_tokens"])


def rollout_bound(figures: dict, components: dict, completion_tokens: int) -> dict:
    """The memory-bandwidth bound of the rollouts: each token step reads every weight once (the base, 4-bit with its
    constants for QLoRA, and the adapter, from the plan's counts) and makes a token for each completion in the call;
    on a GPU of `PEAK_MEMORY_BANDWIDTH`, else none."""
    weights = sum(components[key] for key in BOUND_WEIGHTS)
    bandwidth = peak_memory_bandwidth()
    rows = figures["rollout_tokens_per_call"] / completion_tokens  # completions decoded together
    bound = rows * bandwidth / weights if bandwidth else None
    return {
        "rollout_weight_bytes_per_token_step": weights,
        "rollout_bound_tokens_per_second": bound,
        "rollout_share_of_bound": figures["rollout_tokens_per_second"] / bound if bound else None,
    }


BOUND_WEIGHTS = ("base weights (shard)", "adapter weights (shard)", "quantization constants (whole)")  # one rank


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
