"""The eval loss is the held-out tokens' mean cross-entropy, whatever the ranks and the evaluation batch size.

Quick: on accelerate's own sharded loaders (no process group needed to build them), every rank's batches, the rows
`HeldOutLoss` keeps hold each held-out row once, whatever the set's length, ranks, batch size and batch split, for
rows batched (fill dropped) and for packed rows joined into one (fill unlabelled).

Slow: rows whose completions differ in length, 5 of them, evaluated in batches of 2 on 2 ranks (accelerate fills the
last batch of each rank with 3 repeated rows), on 4 ranks with each row split over 2 (the same 2 data-parallel slices)
and in batches of 3 in one process: each run's figure against plain transformers + peft on the adapter it saved, one
row at a time, summing token losses and counting tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import held_out_token_loss, launch_recipe, read_json
from fsdp_peft.data.formats import read_examples
from fsdp_peft.data.tokenize import IGNORE_INDEX, tokenized_dataset
from fsdp_peft.settings.config import RecipeArguments

WORDS = ["ab", "qwertyuiopas", "mnbv", "zxcvbnmlk", "e", "poiuy", "lkjhgfdsaqw", "rt"]
HELD_OUT = ["ty", "plmoknijbuhv", "wsxe", "dcrfvtgby", "u"]  # completions of 2 to 12 tokens: batch means would differ
ARGS = ["--max_steps", "1", "--generate_samples", "0", "--generate_eval_samples", "0", "--save_strategy", "no"]


@pytest.fixture(scope="module")
def rows_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("uneven_rows")
    for name, words in (("train", WORDS * 4), ("eval", HELD_OUT)):
        lines = [json.dumps({"prompt": f"reverse: {w}", "completion": w[::-1]}) for w in words]
        (directory / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return directory


@pytest.fixture(
    scope="module",
    params=[(2, 1, 2), (4, 2, 2), (1, 1, 3)],
    ids=["2-ranks-batches-of-2", "4-ranks-rows-split-over-2-batches-of-2", "one-process-batches-of-3"],
)
def run(request, rows_dir, tmp_path_factory):
    """(ranks, sequence_parallel_size, per_device_eval_batch_size): 16 training rows a step in each."""
    ranks, split, batch = request.param
    output_dir = tmp_path_factory.mktemp(f"eval_loss_{ranks}")
    overrides = ["--dataset", str(rows_dir), "--per_device_train_batch_size", str(16 * split // ranks)]
    overrides += ["--sequence_parallel_size", str(split), "--per_device_eval_batch_size", str(batch)]
    launch_recipe("llama_lora", *overrides, "--output_dir", str(output_dir), *ARGS, processes=ranks)
    return output_dir


def _reference(adapter, model_dir, rows_dir) -> float:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter).eval()
    path = rows_dir / "eval.jsonl"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = tokenized_dataset(read_examples(path), tokenizer, RecipeArguments(max_seq_length=64), path)
    labelled = sum(sum(label != IGNORE_INDEX for label in row["labels"]) for row in rows)
    assert labelled == sum(map(len, HELD_OUT)) + len(HELD_OUT)  # each reversed word and its end of turn
    return held_out_token_loss(model, rows)


@pytest.mark.slow
def test_the_eval_loss_is_the_held_out_tokens_mean_loss(run, rows_dir, tiny_model_dir):
    results = read_json(run / "results.json")
    reference = _reference(run / "adapter", tiny_model_dir, rows_dir)
    print(f"{run.name}: eval loss {results['eval_loss']:.7f}, plain peft row by row {reference:.7f}")
    assert abs(results["eval_loss"] - reference) <= 1e-5 * reference, (results["eval_loss"], reference)


def _row(index: int) -> dict:
    return {"input_ids": [index] * (1 + index % 3), "labels": [index] * (1 + index % 3)}  # each token names its row


def _padded(features: list[dict]) -> dict:
    width = max(len(f["labels"]) for f in features)
    return {k: torch.tensor([f[k] + [IGNORE_INDEX] * (width - len(f[k])) for f in features]) for k in features[0]}


def _joined(features: list[dict]) -> dict:
    return {k: torch.tensor([[v for f in features for v in f[k]]]) for k in features[0]}


@pytest.mark.parametrize("collate", [_padded, _joined], ids=["rows", "joined-rows"])
def test_the_ranks_keep_every_held_out_row_once_and_no_fill(collate):
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from fsdp_peft.procedures.eval_loss import HeldOutLoss

    for length in range(1, 12):
        rows = [_row(i) for i in range(length)]
        for ranks in (1, 2, 3, 4):
            for per_rank, split in [(b, False) for b in (1, 2, 3)] + [(b, True) for b in (1, 2)]:
                batch = per_rank * ranks if split else per_rank
                kept, steps = [], set()
                for rank in range(ranks):
                    loader = DataLoader(rows, batch_size=batch, collate_fn=collate)
                    loader = prepare_data_loader(loader, None, ranks, rank, split_batches=split, put_on_device=False)
                    held_out = HeldOutLoss(loader, drops_fill=True)
                    batches = [held_out.without_fill(inputs)["labels"] for inputs in loader]
                    kept += [t for labels in batches for t in labels.flatten().tolist() if t != IGNORE_INDEX]
                    steps.add(len(batches))
                case = (length, ranks, per_rank, split)
                assert len(steps) == 1, case  # every rank forwards as often
                assert sorted(kept) == sorted(t for row in rows for t in row["labels"]), case
