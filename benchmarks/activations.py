"""Activation memory of one training step, chunked loss vs the model's own loss, measured against the planner.

A Llama-architecture model with a 128k vocabulary (Llama 3's 128,256), random weights built here (hidden
512, 2 layers, GQA 8/2 heads, untied head; fp32), LoRA r=16 on all linear layers, one 2048-token sequence,
every token labelled. Each case runs in its own process (so peak RSS is its own): the model's own loss or
the chunked loss (`fsdp_peft.model.loss`, 512-token chunks, the recipes' default), with and without gradient
checkpointing (transformers' default, reentrant). Per case:

- **saved bytes**: what autograd saves for backward during the forward (``saved_tensors_hooks``; tensors
  counted once; the frozen weights it keeps for the input gradient are parameters, not activations, and
  are left out), split into the decoder body and the head + loss. With checkpointing, the layer a backward
  recomputes saves its own again: one layer's saved bytes, measured on a forward of the first layer
  outside checkpointing (its input excluded, already counted), are added (one is recomputed at a time).
- **planned**: `fsdp_peft.tools.plan.activation_bytes` for the same model, tokens and dtype; **err** = planned /
  measured - 1.
- **peak RSS growth**: peak resident memory of the process over the step minus before it (MiB).
- **step s**: forward + backward, median of 3.

    python benchmarks/activations.py                       # about 4 minutes on 2 cores
    python benchmarks/activations.py --tokens 128 --vocab 4096  # seconds: the same code on a small shape

It prints a table and writes ``benchmarks/results/activations.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

TOKENS = 2048
CHUNK = 512
CASES = [("full", False), ("chunked", False), ("full", True), ("chunked", True)]
MODEL = dict(
    vocab_size=128256,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


def measure(loss: str, checkpointing: bool, tokens: int, vocab: int) -> dict:
    """One case, in this process."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_peft.model.loss import head_computes_loss
    from fsdp_peft.settings.checkpointing import NONE, every
    from fsdp_peft.settings.config import RecipeArguments
    from fsdp_peft.tools.plan import activation_bytes

    torch.manual_seed(0)
    config = LlamaConfig(**{**MODEL, "vocab_size": vocab})
    model = LlamaForCausalLM(config)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model.train()
    input_ids = torch.randint(0, config.vocab_size, (1, tokens))
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    base = model.get_base_model()
    phase = ["body"]
    seen: dict[str, dict[int, int]] = {"body": {}, "head + loss": {}, "backward": {}}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[phase[0]][storage.data_ptr()] = storage.nbytes()
        return tensor

    base.lm_head.register_forward_pre_hook(lambda *args: phase.__setitem__(0, "head + loss"))

    def one_layer_saved_bytes() -> int:
        """What a decoder layer saves for backward: what its recomputation holds under checkpointing."""
        sizes = {}
        hidden = torch.randn(1, tokens, config.hidden_size, requires_grad=True)
        positions = torch.arange(tokens)[None]
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: sizes.__setitem__(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) or t,
            lambda t: t,
        ):
            base.model.layers[0].gradient_checkpointing = False
            base.model.layers[0](
                hidden, position_ids=positions, position_embeddings=base.model.rotary_emb(hidden, positions)
            )
        return sum(
            n for ptr, n in sizes.items() if ptr not in parameters and ptr != hidden.untyped_storage().data_ptr()
        )

    def step() -> float:
        for bucket in seen.values():
            bucket.clear()
        phase[0] = "body"
        started = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if loss == "chunked":
                with head_computes_loss(base, input_ids, CHUNK):
                    value = model(input_ids=input_ids, labels=input_ids).loss
            else:
                value = model(input_ids=input_ids, labels=input_ids).loss
            phase[0] = "backward"
            value.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    before = rss_mib()
    times = [step() for _ in range(3)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    body, head = sum(seen["body"].values()), sum(seen["head + loss"].values())
    one_layer = one_layer_saved_bytes() if checkpointing else 0
    measured = body + head + one_layer
    recipe = RecipeArguments(lora_dropout=0.0, loss_chunk_tokens=CHUNK if loss == "chunked" else 0)
    planned = activation_bytes(config, recipe, tokens, 4, every(config.num_hidden_layers) if checkpointing else NONE)
    return {
        "loss": loss,
        "gradient_checkpointing": checkpointing,
        "saved_body_bytes": body,
        "saved_head_and_loss_bytes": head,
        "recomputed_layer_bytes": one_layer,
        "saved_bytes": int(measured),
        "head_and_loss_share": head / measured,
        "planned_bytes": planned,
        "planned_error": planned / measured - 1,
        "peak_rss_growth_mib": peak - before,
        "step_seconds": statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help=argparse.SUPPRESS)  # loss,checkpointing: run one case in this process
    parser.add_argument("--tokens", type=int, default=TOKENS, help="sequence length (one sequence)")
    parser.add_argument("--vocab", type=int, default=MODEL["vocab_size"], help="vocabulary size")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "activations.json")
    cli = parser.parse_args()
    if cli.case:
        loss, checkpointing = cli.case.split(",")
        print(json.dumps(measure(loss, checkpointing == "on", cli.tokens, cli.vocab)))
        return
    rows = []
    for loss, checkpointing in CASES:
        case = f"{loss},{'on' if checkpointing else 'off'}"
        command = [sys.executable, __file__, "--case", case, "--tokens", str(cli.tokens), "--vocab", str(cli.vocab)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.exit(f"case {case} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{cli.tokens} tokens, vocab {cli.vocab:,}, hidden {MODEL['hidden_size']}, fp32, chunk {CHUNK}")
    print(
        "| loss | ckpt | saved body MB | saved head+loss MB | saved total MB | head+loss share | planned MB | err "
        "| peak RSS growth MiB | step s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['loss']} | {'on' if r['gradient_checkpointing'] else 'off'} | {r['saved_body_bytes'] / 1e6:.1f} "
            f"| {r['saved_head_and_loss_bytes'] / 1e6:.1f} | {r['saved_bytes'] / 1e6:.1f} "
            f"| {r['head_and_loss_share']:.1%} | {r['planned_bytes'] / 1e6:.1f} | {r['planned_error']:+.1%} "
            f"| {r['peak_rss_growth_mib']:.0f} | {r['step_seconds']:.2f} |"
        )
    for checkpointing in (False, True):
        full, chunked = (
            next(r for r in rows if r["loss"] == loss and r["gradient_checkpointing"] == checkpointing)
            for loss in ("full", "chunked")
        )
        ratio = full["saved_head_and_loss_bytes"] / max(chunked["saved_head_and_loss_bytes"], 1)
        print(
            f"checkpointing {'on' if checkpointing else 'off'}: head+loss saved bytes {ratio:.1f}x lower chunked; "
            f"share {full['head_and_loss_share']:.1%} -> {chunked['head_and_loss_share']:.1%}; peak RSS growth "
            f"{full['peak_rss_growth_mib']:.0f} -> {chunked['peak_rss_growth_mib']:.0f} MiB"
        )
    within = all(abs(r["planned_error"]) <= 0.10 for r in rows)
    print(f"planner within 10% of the saved bytes in all {len(rows)} cases: {within}")
    cli.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "model": MODEL}
    meta["model"] = {**MODEL, "vocab_size": cli.vocab}
    cli.out.write_text(json.dumps({**meta, "tokens": cli.tokens, "chunk_tokens": CHUNK, "cases": rows}, indent=1))
    print(f"written {cli.out}")


if __name__ == "__main__":
    main()
