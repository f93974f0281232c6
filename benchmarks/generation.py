"""Generation benchmark: tokens/second of greedy decoding from the tiny model sharded over 2 CPU ranks.

Runs of the same weights (``--model``: the embedded tiny Llama, or smollm2-135m-instruct, with a seeded, random
LoRA adapter on every linear layer, fp32, frozen as ``fsdp-peft generate`` loads an adapter), each generating
``--new-tokens`` tokens greedily for each of ``--prompts`` prompts:

- ``unsharded``: one process, the whole model, all prompts in one batch, run with 1 thread and with
  all cores' threads; the faster one is the reference;
- ``sharded``: FSDP2 over 2 gloo ranks (`fsdp_peft.parallel.fsdp_policies.shard_for_generation`), prompts spread over
  the ranks, units gathered once per ``generate`` call (``generate_gather_budget: all``) and the adapter merged into
  them (``generate_merged_adapter: true``, the default);
- ``sharded_unmerged`` and ``unsharded_unmerged``: the same with the adapter unmerged (``generate_merged_adapter:
  false``, every LoRA layer's forward peft's): the eager path as it was before the adapter was merged and the decode
  step compiled;
- ``sharded_compiled`` and ``unsharded_compiled``: the adapter merged and the decode step compiled over a static,
  bucketed KV cache (``generate_compiled: true``, `fsdp_peft.tools.decoding`); the first call includes compiling;
- ``naive``: the same sharding, gathering every unit in every forward, i.e. once per new token
  (``generate_gather_budget: none``, what FSDP2 does by default);
- ``peer``: plain transformers' own fast path in one process: the adapter merged by peft (``merge_and_unload``), a
  static KV cache (``cache_implementation="static"``) and the forward compiled (``torch.compile``); its first call
  (the warm-up) includes the compilation, and the graphs dynamo made are counted.

Each run times ``--repeats`` calls after one warm-up call, counts FSDP all-gathers per call, and returns its
completions; all but the peer's must agree token for token (the peer's agreement is reported). Prints a table and
writes ``benchmarks/results/generation.json`` (``generation_<model>_<prompts>_prompts.json`` for another model).

    python benchmarks/generation.py
    python benchmarks/generation.py --prompts 8 --new-tokens 64 --repeats 5
    python benchmarks/generation.py --model smollm2-135m-instruct --prompts 16 --new-tokens 48
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MODES = {
    "unsharded": None,
    "unsharded_1_thread": None,
    "unsharded_unmerged": None,
    "unsharded_compiled": None,
    "sharded": "all",
    "sharded_unmerged": "all",
    "sharded_compiled": "all",
    "naive": "none",
    "peer": None,
}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from fsdp_peft.core.distributed import release_process_group, start_process_group
    from fsdp_peft.model.modeling import load_base_model, load_tokenizer
    from fsdp_peft.parallel.fsdp_policies import shard_for_generation
    from fsdp_peft.settings.config import RecipeArguments
    from fsdp_peft.tools.generation import GenerationSettings, generate_completions

    recipe = RecipeArguments(model_name_or_path=args.model, torch_dtype="float32")
    if args.worker == "unsharded_1_thread":
        torch.set_num_threads(1)
    sharded = MODES[args.worker] is not None
    if sharded:
        start_process_group()
    torch.manual_seed(0)  # the same random, non-zero adapter in every process
    tokenizer = load_tokenizer(recipe)
    model = get_peft_model(
        load_base_model(recipe), LoraConfig(r=32, target_modules="all-linear", init_lora_weights=False)
    ).requires_grad_(False)  # frozen, as `fsdp-peft generate` loads an adapter: one process keeps its merged weights
    if sharded:
        shard_for_generation(model, torch.device("cpu"))
    if args.worker == "peer":
        model = model.merge_and_unload()
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, dynamic=False)
    gathers = [0]
    original = _fsdp_param_group.foreach_all_gather

    def counting_all_gather(*a, **k):
        gathers[0] += 1
        return original(*a, **k)

    _fsdp_param_group.foreach_all_gather = counting_all_gather
    prompts = [
        f"<|user|>{word}<|assistant|>"
        for word in ("apple", "river", "cloud", "stone", "light", "grass", "tiger", "piano", "ocean", "maple")
    ]
    prompts = (prompts * args.prompts)[: args.prompts]
    settings = GenerationSettings(
        args.new_tokens,
        batch_size=args.prompts,
        gather_budget=MODES[args.worker] or "all",
        ignore_eos=True,
        merged_adapter=not args.worker.endswith("_unmerged"),
        compiled="true" if args.worker.endswith("_compiled") else "false",
    )
    warm_up = time.perf_counter()
    generate_completions(model, tokenizer, prompts, settings, torch.device("cpu"))
    warm_up = time.perf_counter() - warm_up
    gathers[0] = 0
    if sharded:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(args.repeats):
        completions = generate_completions(model, tokenizer, prompts, settings, torch.device("cpu"))
    seconds = (time.perf_counter() - start) / args.repeats
    if not sharded or dist.get_rank() == 0:
        from torch._dynamo.utils import counters

        tokens = args.prompts * args.new_tokens
        print(
            json.dumps(
                {
                    "mode": args.worker,
                    "seconds_per_call": seconds,
                    "tokens_per_call": tokens,
                    "tokens_per_second": tokens / seconds,
                    "first_call_seconds": warm_up,
                    "graphs_compiled": counters["stats"]["unique_graphs"],
                    "all_gathers_per_call_rank0": gathers[0] / args.repeats,
                    "processes": dist.get_world_size() if sharded else 1,
                    "threads_per_process": torch.get_num_threads(),
                    "completions": completions,
                }
            ),
            flush=True,
        )
    release_process_group()


def run(mode: str, args: argparse.Namespace) -> dict:
    script = [
        str(Path(__file__).resolve()),
        "--worker",
        mode,
        "--prompts",
        str(args.prompts),
        "--new-tokens",
        str(args.new_tokens),
        "--repeats",
        str(args.repeats),
        "--model",
        args.model,
    ]
    if MODES[mode] is None:
        command = [sys.executable, *script]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            *script,
        ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"{mode} run failed:\n{result.stderr[-4000:]}")
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="tiny-llama", help="tiny-llama (default) or smollm2-135m-instruct")
    parser.add_argument("--worker", choices=list(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    runs = {mode: run(mode, args) for mode in MODES}
    completions = {mode: r.pop("completions") for mode, r in runs.items()}
    reference = max(("unsharded", "unsharded_1_thread"), key=lambda mode: runs[mode]["tokens_per_second"])
    agree = all(c == completions["unsharded"] for mode, c in completions.items() if mode != "peer")
    peer_agrees = completions["peer"] == completions["unsharded"]
    for mode, r in runs.items():
        print(
            f"{mode:>18}: {r['tokens_per_second']:8.1f} tokens/s  ({r['seconds_per_call']:.3f} s per call, "
            f"{r['processes']} process(es) x {r['threads_per_process']} thread(s), "
            f"{r['all_gathers_per_call_rank0']:.0f} all-gathers per call; first call {r['first_call_seconds']:.1f} s, "
            f"{r['graphs_compiled']} graphs compiled)"
        )
    ratio = runs["sharded"]["tokens_per_second"] / runs[reference]["tokens_per_second"]
    naive_ratio = runs["naive"]["tokens_per_second"] / runs[reference]["tokens_per_second"]
    merged_ratio = runs["sharded"]["tokens_per_second"] / runs["sharded_unmerged"]["tokens_per_second"]
    print(
        f"reference: {reference}; sharded / unsharded: {ratio:.2f} (goal >= 0.8); naive / unsharded: {naive_ratio:.2f}"
    )
    peer_ratio = runs["sharded"]["tokens_per_second"] / runs["peer"]["tokens_per_second"]
    compiled = {
        layout: runs[f"{layout}_compiled"]["tokens_per_second"] / runs[eager]["tokens_per_second"]
        for layout, eager in (("sharded", "sharded_unmerged"), ("unsharded", "unsharded_unmerged"))
    }
    compiled_over_peer = runs["unsharded_compiled"]["tokens_per_second"] / runs["peer"]["tokens_per_second"]
    print(f"adapter merged / unmerged (sharded, all gathered): {merged_ratio:.2f}")
    print(f"sharded / peer (plain transformers, static cache, compiled): {peer_ratio:.2f}")
    print(
        f"compiled decode step: sharded / sharded_unmerged (the eager path before) {compiled['sharded']:.2f}; "
        f"unsharded / unsharded_unmerged {compiled['unsharded']:.2f}; unsharded / peer (one process each) "
        f"{compiled_over_peer:.2f}"
    )
    print(
        f"completions identical across the {len(runs) - 1} runs of fsdp-peft's code: {agree}; the peer's: {peer_agrees}"
    )
    import transformers

    report = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/generation.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} {os.cpu_count()} CPU cores, {platform.processor() or platform.system()}",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "runs": runs,
        "reference": reference,
        "model": args.model,
        "sharded_over_unsharded": ratio,
        "merged_over_unmerged": merged_ratio,
        "sharded_over_peer": peer_ratio,
        "sharded_compiled_over_sharded_unmerged": compiled["sharded"],
        "unsharded_compiled_over_unsharded_unmerged": compiled["unsharded"],
        "unsharded_compiled_over_unsharded": runs["unsharded_compiled"]["tokens_per_second"]
        / runs["unsharded"]["tokens_per_second"],
        "unsharded_compiled_over_peer": compiled_over_peer,
        "peer_completions_identical": peer_agrees,
        "naive_over_unsharded": naive_ratio,
        "completions_identical": agree,
    }
    name = "generation" if args.model == "tiny-llama" else f"generation_{args.model}_{args.prompts}_prompts"
    out = HERE / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written to {out}")
    if not agree:
        sys.exit("completions differ between the runs")


if __name__ == "__main__":
    main()
