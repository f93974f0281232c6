"""Step time of the recipes' trainer against plain `transformers.Trainer` + peft, same model, data and settings.

A Llama-architecture model with random weights (vocabulary 32,000, hidden 256, 4 layers, fp32; LoRA r=16
on all linear layers, dropout 0), batches of 4 random 256-token rows, AdamW. In one process, the two
trainers alternate: each repetition builds the same model from the same seed and trains ``--steps``
steps with one trainer, then with the other; the median step time of a repetition leaves out its first
two steps. The figure is the median over repetitions of each side, and their ratio. Every process runs
one thread, so a shared machine's other work slows both sides alike as far as possible.

- ``fsdp-peft``: `fsdp_peft.procedures.trainer.PeftFsdpTrainer` with everything it adds (memory and FSDP layout
  reports, adapter bookkeeping, the PEFT wrap policy under FSDP). ``--loss-chunk-tokens`` (default 0,
  the model's own loss, so both sides compute the same) sets its chunked loss.
- ``plain``: `transformers.Trainer`; under FSDP (``--world-size 2``) with only the switch that turns
  accelerate's CPU fallback to DDP into FSDP2 (`fsdp_peft.parallel.cpu_fsdp.enable_cpu_fsdp`, FINDINGS §1), which a
  plain Trainer needs to shard on CPU at all, and the same ``fsdp_config``.

    python benchmarks/overhead.py                    # one process, then FSDP2 on 2 gloo ranks (torchrun)
    python benchmarks/overhead.py --reps 5 --steps 8 # the defaults

Writes ``benchmarks/results/overhead.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from grpo_rollouts import child_env  # noqa: E402  (benchmarks/ is on sys.path: this script's own folder)

MODEL = dict(
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
SEQ, BATCH = 256, 4


def one_side(impl: str, steps: int, world: int, chunk: int, out: str) -> float:
    """Median step time of ``impl`` in this process (steps after the second)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments, set_seed

    from fsdp_peft.parallel.cpu_fsdp import enable_cpu_fsdp
    from fsdp_peft.procedures.trainer import PeftFsdpTrainer

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, *args, **kwargs):
            self.times.append(time.perf_counter())

    class PlainTrainerOnCpuFsdp(Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if enable_cpu_fsdp(self.accelerator, self.args):
                self.is_fsdp_enabled = True

    fsdp = {}
    if world > 1:
        fsdp = {
            "fsdp": "full_shard auto_wrap",
            "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        }
    args = TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-4,
        logging_steps=steps,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        **fsdp,
    )
    set_seed(0)
    model = get_peft_model(
        LlamaForCausalLM(LlamaConfig(**MODEL)),
        LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, MODEL["vocab_size"], (SEQ,), generator=generator) for _ in range(BATCH * steps * world)]
    data = [{"input_ids": row, "labels": row} for row in rows]
    timer = StepTimes()
    if impl == "fsdp-peft":
        trainer = PeftFsdpTrainer(
            model=model, args=args, train_dataset=data, callbacks=[timer], loss_chunk_tokens=chunk
        )
    else:
        trainer = (PlainTrainerOnCpuFsdp if world > 1 else Trainer)(
            model=model, args=args, train_dataset=data, callbacks=[timer]
        )
    trainer.train()
    gaps = [b - a for a, b in zip(timer.times[1:], timer.times[2:])]
    from accelerate.state import AcceleratorState  # lazy: reset between trainers of one process

    AcceleratorState._reset_state(reset_partial_state=False)
    return statistics.median(gaps)


def alternate(cli) -> dict:
    """Both sides, alternating, ``cli.reps`` times; run by every rank."""
    import torch

    torch.set_num_threads(1)  # one thread per process: less at the mercy of other work on a shared machine
    times = {"fsdp-peft": [], "plain": []}
    with tempfile.TemporaryDirectory() as out:
        for rep in range(cli.reps):
            order = ("fsdp-peft", "plain") if rep % 2 == 0 else ("plain", "fsdp-peft")
            for impl in order:
                times[impl].append(one_side(impl, cli.steps, cli.world_size, cli.loss_chunk_tokens, out))
    medians = {impl: statistics.median(values) for impl, values in times.items()}
    return {
        "world_size": cli.world_size,
        "loss_chunk_tokens": cli.loss_chunk_tokens,
        "step_seconds": times,
        "median_step_seconds": medians,
        "ratio": medians["fsdp-peft"] / medians["plain"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--loss-chunk-tokens", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=0, help=argparse.SUPPRESS)  # set: run one launch here
    parser.add_argument("--out", type=Path, default=HERE / "results" / "overhead.json")
    cli = parser.parse_args()
    if cli.world_size:
        import torch.distributed as dist  # lazy: only the measuring processes

        result = alternate(cli)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(json.dumps(result))
        return
    common = ["--reps", str(cli.reps), "--steps", str(cli.steps), "--loss-chunk-tokens", str(cli.loss_chunk_tokens)]
    launches = {
        1: [sys.executable, __file__, "--world-size", "1", *common],
        2: [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            __file__,
            "--world-size",
            "2",
            *common,
        ],
    }
    results = []
    for world, command in launches.items():
        env = child_env(OMP_NUM_THREADS="1")
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if done.returncode:
            sys.exit(f"world size {world} failed:\n{done.stderr[-4000:]}")
        results.append(json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1]))
    print(f"{BATCH} x {SEQ} tokens per rank per step, {cli.steps} steps, {cli.reps} alternating repetitions")
    for r in results:
        m = r["median_step_seconds"]
        where = "one process" if r["world_size"] == 1 else "FSDP2, 2 ranks"
        print(f"{where}: fsdp-peft {m['fsdp-peft']:.4f} s, plain {m['plain']:.4f} s, ratio {r['ratio']:.3f}")
    cli.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "cpus": os.cpu_count()}
    cli.out.write_text(json.dumps({**meta, "model": MODEL, "seq": SEQ, "batch": BATCH, "runs": results}, indent=1))
    print(f"written {cli.out}")


if __name__ == "__main__":
    main()
