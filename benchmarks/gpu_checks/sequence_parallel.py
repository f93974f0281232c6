"""Sequence-parallel runs (``sp``, `SP_SIZES`; they need 2 GPUs: one GPU skips them and says so in ``skipped``):
``recipes/llama_qlora.py`` on the 8B shape with ``sequence_parallel_size: 2`` on 2 ranks (one group: both train the
same rows, each holding half of every row) and then in one process on the same whole rows, 1 row of 16,384 tokens
a step (the embedded reversal rows packed: documents cross the ranks' boundary), 4 steps, LoRA r=16 without dropout:
tokens/s, training peak of each next to its plan (the split run planned on 2 ranks), and ``sequence_parallel``: the
largest relative loss difference between the two runs and the split run's training peak over the whole run's. The
dry run: both on the embedded tiny-llama, 2 rows of 64 tokens, 3 steps, 2 gloo ranks against one process.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpu_checks.common import (
    LORA,
    RUN_MINIMUM_SECONDS,
    budget_left,
    checkpoint,
    planned,
    recipe_run,
    recipe_training,
    scratch_directory,
    write_yaml,
)

# Sequence-parallel runs (``sp``): recipes/llama_qlora.py with sequence_parallel_size 2 on 2 ranks (one group: both
# ranks train the same rows, each holding half of every row) against one process on the same whole rows; packed rows
# of the embedded reversal task (documents crossing the ranks' boundary). On GPUs they need 2; one GPU skips them.
SP_SIZES = {"8b": {"batch": 1, "seq": 16384, "steps": 4}, "tiny": {"batch": 2, "seq": 64, "steps": 3}}


SP_RANKS = 2


def sequence_parallel_check(
    shape: str, device: str, gpu_memory: int, args, report: dict, started: float, measured
) -> None:
    """The sequence-parallel pair (`SP_SIZES`): the split run on `SP_RANKS` ranks and one process on the whole rows,
    each next to its plan; then the largest relative loss difference between them and the ratio of their peaks.
    ``measured`` (the driver's) runs one, records it in ``report`` and prints it."""
    import torch

    gpus = torch.cuda.device_count() if device == "cuda" else SP_RANKS
    if gpus < SP_RANKS:
        report["skipped"].append(f"{shape}/qlora/sequence parallel: needs {SP_RANKS} GPUs, this machine has {gpus}")
        return
    path = checkpoint(shape, device) if budget_left(args, started) >= RUN_MINIMUM_SECONDS else ""  # else skipped
    entries = {}
    for kind, ranks in (("split", SP_RANKS), ("whole", 1)):
        entry = entries[kind] = {"model": shape, "method": "qlora", "impl": f"sp {kind}"}
        if budget_left(args, started) >= RUN_MINIMUM_SECONDS:
            directory = scratch_directory(f"gpu_check_sp_{kind}_")
            config = sequence_parallel_yaml(directory, path, SP_SIZES[shape], ranks)
            entry["planned"] = planned(config, gpu_memory, ranks)
        measured(entry, lambda left: recipe_run("llama_qlora", config, left, ranks), args, report, started)
    split, whole = entries["split"].get("losses"), entries["whole"].get("losses")
    if split and whole and len(split) == len(whole):
        peaks_of = [entries[kind].get("peak_gpu_allocated_training_bytes") for kind in ("split", "whole")]
        report["sequence_parallel"] = {
            "largest_relative_loss_difference": max(abs(a - b) / abs(b) for a, b in zip(split, whole)),
            "split_over_whole_training_peak": peaks_of[0] / peaks_of[1] if all(peaks_of) else None,
        }
        print(f"{'':<30}split vs whole rows: {report['sequence_parallel']}", flush=True)
    args.out.write_text(json.dumps(report, indent=1))


def sequence_parallel_yaml(directory: Path, model: str, size: dict, split: int) -> Path:
    """The QLoRA recipe config of a sequence-parallel run, ``split`` ranks to a row (1: the whole rows)."""
    values = {
        "model_name_or_path": model,
        "torch_dtype": "bfloat16",
        "load_in_4bit": True,
        "bnb_4bit_quant_storage": "bfloat16",
        **LORA,
        "lora_dropout": 0.0,  # the two runs draw no different masks
        "max_seq_length": size["seq"],
        "packing": True,  # short documents packed across the ranks' boundary
        "sequence_parallel_size": split,
        "generate_samples": 0,
        "generate_eval_samples": 0,
        "eval_strategy": "no",
        "per_device_train_batch_size": size["batch"],
        **recipe_training(directory, size["steps"], learning_rate=1e-4),
    }
    return write_yaml(directory / "sp.yaml", values)
