"""Greedy generation from the (possibly still sharded) model, with prompts spread over the ranks.

Every rank runs the same number of ``generate`` calls (FSDP forwards are collectives), each on its own
slice of the prompts; rank 0 gathers the completions back into prompt order.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from fsdp_peft.data import Example, render_prompt
from fsdp_peft.fsdp import is_sharded


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@torch.no_grad()
def generate_completions(
    model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int, device: torch.device
) -> list[str] | None:
    """Greedy completions for ``prompts``: the full list on rank 0, ``None`` on other ranks."""
    rank, world = _rank_and_world()
    mine = list(range(rank, len(prompts), world))
    batches = math.ceil(math.ceil(len(prompts) / world) / batch_size) if prompts else 0
    synced = is_sharded(model) and world > 1
    was_training = model.training
    model.eval()
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    results: list[tuple[int, str]] = []
    try:
        for index in range(batches):
            chunk = mine[index * batch_size : (index + 1) * batch_size]
            texts = [prompts[i] for i in chunk] or [prompts[0]]  # a rank out of prompts still joins the forwards
            encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            output = model.generate(
                **encoded,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                synced_gpus=synced,
            )
            new_tokens = output[:, encoded["input_ids"].shape[1] :]
            decoded = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
            results.extend(zip(chunk, decoded))
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    if world == 1:
        return [text for _, text in sorted(results)]
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(results, gathered, dst=0)
    if rank != 0:
        return None
    return [text for _, text in sorted(pair for part in gathered for pair in part)]


def evaluate_exact_match(
    model, tokenizer, examples: list[Example], recipe, device: torch.device, samples_path: Path | None = None
) -> float | None:
    """Exact-match accuracy of greedy completions on ``examples`` (rank 0; ``None`` elsewhere).

    With ``samples_path``, rank 0 also writes one JSON line per example: prompt, expected, generated.
    """
    prompts = [render_prompt(tokenizer, e.prompt, recipe.use_chat_template) for e in examples]
    completions = generate_completions(
        model, tokenizer, prompts, recipe.generate_max_new_tokens, recipe.generate_batch_size, device
    )
    if completions is None:
        return None
    hits = [c.strip() == e.completion.strip() for c, e in zip(completions, examples)]
    if samples_path is not None:
        with open(samples_path, "w") as handle:
            for example, completion, hit in zip(examples, completions, hits):
                row = {"prompt": example.prompt, "expected": example.completion, "generated": completion, "exact": hit}
                handle.write(json.dumps(row) + "\n")
    return sum(hits) / len(hits)


class ExactMatchBeforeTraining(TrainerCallback):
    """Scores ``examples`` when training starts: on the prepared (sharded) model, before the first step.

    Scoring there rather than before ``Trainer.train`` means generation always runs on the model as FSDP
    holds it, also when ranks other than 0 start without weights. A resumed run is not scored again.
    """

    def __init__(self, tokenizer, examples: list[Example], recipe):
        self.tokenizer, self.examples, self.recipe = tokenizer, examples, recipe
        self.accuracy: float | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.examples and state.global_step == 0:
            self.accuracy = evaluate_exact_match(model, self.tokenizer, self.examples, self.recipe, args.device)
