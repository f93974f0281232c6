"""Activation memory per rank with the sequence split (``sequence_parallel_size: 2``) against the whole sequence.

A Llama-architecture model built here (hidden 512, 2 layers, GQA 8/2 heads, vocabulary 32,000, fp32, random
weights), LoRA r=16 on all linear layers, one row, every token labelled, the recipes' chunked loss (512-token
chunks). Measured: what autograd saves for backward during one forward (``saved_tensors_hooks``, each storage
once, parameters left out), on 2 gloo ranks that each hold half of the row (`fsdp_peft.parallel.sequence_parallel`), and
in one process on the whole row; planned: `fsdp_peft.tools.plan.activation_bytes` with and without the split.
Then the longest row whose saved bytes stay under one cap (what the whole row saves at ``--cap-tokens``), for
each: lengths in steps of 256.

    python benchmarks/sequence_parallel.py          # about a minute on 2 cores

It prints a table and writes ``benchmarks/results/sequence_parallel.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
from activations import MODEL as ACTIVATIONS_MODEL  # noqa: E402  (beside this script)

LENGTHS = (1024, 2048, 4096)
CHUNK = 512
# benchmarks/activations.py's model (hidden 512, 2 layers, GQA 8/2, untied head) with a 32,000-word vocabulary
MODEL = {**ACTIVATIONS_MODEL, "vocab_size": 32000, "max_position_embeddings": 16384}


def build():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, attn_implementation="sdpa")
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    return config, model.train()


def saved_bytes(model, group, tokens: int) -> int:
    """Bytes autograd saves in one forward of a ``tokens``-long row: split over ``group``, or whole."""
    import torch
    import torch.distributed as dist

    from fsdp_peft.model.loss import head_computes_loss
    from fsdp_peft.parallel.sequence_parallel import SequenceGroup, sequence_split, split_rows

    ids = torch.randint(0, MODEL["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(tokens))
    batch = {"input_ids": ids, "labels": ids}
    split = None
    if group is not None:
        split = SequenceGroup(group, dist.get_world_size(group), dist.get_rank(group), "sdpa")
        batch = split_rows(batch, split.rank, split.size, 0)
    else:
        batch = {**batch, "position_ids": torch.arange(tokens)[None]}
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    base = model.get_base_model()
    within = sequence_split(model, split) if split is not None else contextlib.nullcontext()
    with within, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with head_computes_loss(base, batch["labels"], CHUNK, None, batch.get("shift_labels")):
            loss = model(**batch).loss
    del loss
    return sum(seen.values())


def planned_bytes(config, tokens: int, sequence_parallel: int) -> int:
    from fsdp_peft.settings.checkpointing import NONE
    from fsdp_peft.settings.config import RecipeArguments
    from fsdp_peft.tools.plan import activation_bytes

    recipe = RecipeArguments(lora_dropout=0.0, loss_chunk_tokens=CHUNK, sequence_parallel_size=sequence_parallel)
    return activation_bytes(config, recipe, -(-tokens // sequence_parallel), 4, NONE)  # a rank's tokens


def longest_under(cap: int, measure, start: int) -> int:
    """The longest length (a multiple of 256) whose saved bytes stay under ``cap``, counting up from ``start``."""
    length = start
    while measure(length + 256) <= cap:
        length += 256
    return length


def ranks_main(lengths: list[int], cap_tokens: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config, model = build()
    rows = []
    for tokens in lengths:
        whole = saved_bytes(model, None, tokens) if rank == 0 else 0
        split = saved_bytes(model, dist.group.WORLD, tokens)
        rows.append(
            {
                "tokens": tokens,
                "whole_bytes": whole,
                "split_bytes_per_rank": split,
                "ratio": split / whole if whole else None,
                "planned_whole": planned_bytes(config, tokens, 1),
                "planned_split": planned_bytes(config, tokens, 2),
            }
        )
    cap = saved_bytes(model, None, cap_tokens) if rank == 0 else 0
    cap_tensor = torch.tensor([cap])
    dist.broadcast(cap_tensor, 0)
    cap = int(cap_tensor)
    longest_split = longest_under(cap, lambda n: saved_bytes(model, dist.group.WORLD, n), cap_tokens)
    longest_whole = longest_under(cap, lambda n: saved_bytes(model, None, n), cap_tokens - 256) if rank == 0 else 0
    if rank == 0:
        print(f"hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, heads 8/2, fp32, chunked loss")
        print("| tokens | whole MB | split MB per rank | split / whole | planned whole MB (err) ", end="")
        print("| planned split MB (err) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows:
            r["planned_whole_error"] = r["planned_whole"] / r["whole_bytes"] - 1
            r["planned_split_error"] = r["planned_split"] / r["split_bytes_per_rank"] - 1
            print(
                f"| {r['tokens']} | {r['whole_bytes'] / 1e6:.1f} | {r['split_bytes_per_rank'] / 1e6:.1f} "
                f"| {r['ratio']:.3f} | {r['planned_whole'] / 1e6:.1f} ({r['planned_whole_error']:+.1%}) "
                f"| {r['planned_split'] / 1e6:.1f} ({r['planned_split_error']:+.1%}) |"
            )
        print(
            f"under a cap of {cap / 1e6:.1f} MB saved per rank (the whole row at {cap_tokens} tokens): whole rows up "
            f"to {longest_whole} tokens, split rows up to {longest_split} ({longest_split / longest_whole:.2f}x)"
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "model": MODEL}
        result = {**meta, "chunk_tokens": CHUNK, "rows": rows, "cap_bytes": cap}
        result |= {"longest_whole": longest_whole, "longest_split": longest_split}
        out.write_text(json.dumps(result, indent=1))
        print(f"written {out}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="row lengths measured")
    parser.add_argument("--cap-tokens", type=int, default=2048, help="the whole row's length that sets the cap")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "sequence_parallel.json")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.rank:
        ranks_main(cli.lengths, cli.cap_tokens, cli.out)
        return
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    lengths = [str(n) for n in cli.lengths]
    command = [
        *torchrun,
        __file__,
        "--rank",
        "--lengths",
        *lengths,
        "--cap-tokens",
        str(cli.cap_tokens),
        "--out",
        str(cli.out),
    ]
    sys.exit(subprocess.run(command, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
