"""Every LoRA variant one at a time, LoRA and QLoRA, FSDP2 and FSDP1: 2 gloo ranks against one process.

tests/model/test_variants.py covers the variants combined (nine 2-rank runs, within the CI budget). This script runs
each variant on its own, for both recipes and both FSDP versions, as a user launches it, and reads back:

- the largest relative difference of the 5 logged losses between the 2-rank run and one process with the same
  global batch and seed (bound: 1e-5 for fp32 LoRA, 1e-4 for bf16-storage QLoRA),
- the planner's per-rank parameter, gradient and optimizer bytes against the measured ``memory.json`` (rank 0),
- or, for a combination fsdp-peft refuses, the one-line refusal (checked before anything starts).

It prints a table and writes ``benchmarks/results/variants.json``.

    python benchmarks/variants.py                                   # all (about 25 minutes on 2 cores)
    python benchmarks/variants.py --variants dora --methods lora --versions 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from train_cpu import RECIPES, launch, planned, scratch_directory, short_run_config  # noqa: E402  (the benchmarks' shared pieces)

STEPS = 5
PER_RANK_BATCH = 16
NEW_TOKENS = ["<|tool_call|>", "<|tool_result|>"]
VARIANTS = {
    "dora": {"use_dora": True},
    "rslora": {"use_rslora": True},
    "patterns": {"lora_rank_pattern": {"o_proj": 8}, "lora_alpha_pattern": {"down_proj": 16}},
    "modules_to_save": {"lora_modules_to_save": ["lm_head"]},
    "trainable_tokens": {"trainable_token_indices": [3, 5, 7]},
    "new_tokens": {"new_special_tokens": NEW_TOKENS},
    "embedding_lora": {"lora_target_modules": ["q_proj", "v_proj", "embed_tokens"]},
    "gaussian": {"init_lora_weights": "gaussian"},
    "pissa": {"init_lora_weights": "pissa_niter_4"},
    "olora": {"init_lora_weights": "olora"},
    "loftq": {"init_lora_weights": "loftq"},
    "eva": {"init_lora_weights": "eva"},
}
TOLERANCE = {"lora": 1e-5, "qlora": 1e-4}
MEMORY_KEYS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes")


def write_config(directory: Path, variant: str, method: str, per_device_batch: int) -> Path:
    return short_run_config(
        directory, method, **VARIANTS[variant], max_steps=STEPS, per_device_train_batch_size=per_device_batch
    )


def losses(output_dir: Path) -> list[float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def user_error(result) -> str | None:
    """The one-line ``error: ...`` fsdp-peft gives a refused configuration (first rank's), if it gave one."""
    lines = [line[line.index("error: ") :] for line in result.stderr.splitlines() if "error: " in line]
    return lines[0][:400] if lines else None


def failure(result) -> str:
    return (result.stderr.strip().splitlines() or ["no output"])[-1][:400]


def run_one(variant: str, method: str, version: int, single: dict) -> dict:
    entry = {"variant": variant, "method": method, "fsdp": version, "keys": VARIANTS[variant]}
    directory = scratch_directory(f"variants_{variant}_{method}_fsdp{version}_")
    config = write_config(directory, variant, method, PER_RANK_BATCH)
    launcher = REPO / "configs" / "accelerate" / f"cpu_fsdp{version}.yaml"
    command, result = launch(config, method, 2, launcher)
    entry["command"] = " ".join(command)
    if result.returncode != 0:
        refused = user_error(result)
        if refused:
            entry["refused"] = refused
        else:
            entry["failed"] = failure(result)
        return entry
    if (variant, method) not in single:
        one = scratch_directory(f"variants_{variant}_{method}_single_")
        _, reference = launch(write_config(one, variant, method, 2 * PER_RANK_BATCH), method, 1, None)
        single[variant, method] = one / "out" if reference.returncode == 0 else failure(reference)
    reference = single[variant, method]
    if isinstance(reference, str):
        entry["failed"] = f"one process: {reference}"
        return entry
    two, one = losses(directory / "out"), losses(reference)
    entry["losses"], entry["reference_losses"] = two, one
    entry["largest_relative_loss_difference"] = max(abs(a - b) / abs(b) for a, b in zip(two, one))
    entry["within_bound"] = (
        len(two) == len(one) == STEPS and entry["largest_relative_loss_difference"] <= TOLERANCE[method]
    )
    measured = json.loads((directory / "out" / "memory.json").read_text())["ranks"][0]
    plan = planned(config, 2, launcher)
    entry["measured"] = {key: measured[key] for key in MEMORY_KEYS}
    entry["planned"] = {key: plan[key] for key in MEMORY_KEYS}
    entry["plan_equals_measured"] = entry["measured"] == entry["planned"]
    return entry


def row(entry: dict) -> str:
    name = f"{entry['variant']:<17} {entry['method']:<6} FSDP{entry['fsdp']}"
    if "refused" in entry or "failed" in entry:
        what = "refused" if "refused" in entry else "FAILED"
        return f"{name}  {what}: {entry.get('refused') or entry.get('failed')}"
    ok = "ok" if entry["within_bound"] else "OUT OF BOUND"
    plan = "plan = measured" if entry["plan_equals_measured"] else f"plan {entry['planned']} vs {entry['measured']}"
    return f"{name}  {entry['largest_relative_loss_difference']:.2e} ({ok}), {plan}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--methods", nargs="+", choices=sorted(RECIPES), default=["lora", "qlora"])
    parser.add_argument("--versions", nargs="+", type=int, choices=[1, 2], default=[2, 1])
    parser.add_argument("--output", default=str(HERE / "results" / "variants.json"))
    args = parser.parse_args()

    single: dict = {}
    entries = []
    for variant in args.variants:
        for method in args.methods:
            for version in args.versions:
                entries.append(run_one(variant, method, version, single))
                print(row(entries[-1]), flush=True)
    import peft
    import torch
    import transformers

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        "steps": STEPS,
        "global_batch": 2 * PER_RANK_BATCH,
        "entries": entries,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    failed = [e for e in entries if "failed" in e or not e.get("within_bound", True)]
    failed += [e for e in entries if e.get("plan_equals_measured") is False]
    print(f"{len(entries)} runs: {len(failed)} failed or out of bound; results in {args.output}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
