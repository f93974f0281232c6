"""One-row products on CPU: MKL's ``x @ Wᵀ`` against the reduction the compiled decode step uses at one row.

For each linear layer shape of ``--model`` (SmolLM2-135M-Instruct by default, shapes read from its config), times with
the weights out of cache (enough distinct random weights of the shape to pass ``--megabytes``, each read once a
round, best of 3 rounds):

- ``mkl``: ``x @ W.T``, one row, as ``nn.Linear`` computes it eagerly (MKL's one-row product);
- ``reduction``: ``(W * x).sum(-1)`` compiled (`fsdp_peft.tools.decoding.row_reduction_product`, what a plain linear
  layer of the compiled step computes at one row on a CPU with 2 or more threads), one inductor kernel;
- ``sum``: ``W.sum()``, what reading the weight over all the threads costs (the bandwidth at hand).

Prints GB/s of weight read for each and reduction / mkl, and writes ``benchmarks/results/one_row_products.json``.

    python benchmarks/one_row_products.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def layer_shapes(model: str) -> dict[tuple[int, int], int]:
    """Each linear layer shape ``(out, in)`` of ``model`` and how many layers have it (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    from fsdp_peft.model.paths import known_model_config

    config = known_model_config(model)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    shapes: dict[tuple[int, int], int] = {}
    for module in built.modules():
        if isinstance(module, torch.nn.Linear):
            shape = tuple(module.weight.shape)
            shapes[shape] = shapes.get(shape, 0) + 1
    return shapes


def seconds_per_weight(call, x: torch.Tensor, weights: list[torch.Tensor], rounds: int = 3) -> float:
    call(x, weights[0])
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for weight in weights:
            call(x, weight)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def main() -> None:
    from fsdp_peft.tools.decoding import row_reduction_product

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--megabytes", type=int, default=256, help="weights a round reads, at least (out of cache)")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for (out_features, in_features), layers in sorted(layer_shapes(args.model).items()):
        size = out_features * in_features * 4
        weights = [torch.randn(out_features, in_features) for _ in range(max(1, args.megabytes * 2**20 // size))]
        x = torch.randn(1, in_features)
        torch._dynamo.reset()  # one shape a graph, each compiled afresh (dynamo's recompile limit)
        reduction = torch.compile(lambda x, w: row_reduction_product(x, w, None), dynamic=False)
        timed = {
            "mkl": seconds_per_weight(lambda x, w: x @ w.T, x, weights),
            "reduction": seconds_per_weight(reduction, x, weights),
            "sum": seconds_per_weight(lambda _x, w: w.sum(), x, weights),
        }
        worst = (reduction(x, weights[0]) - x @ weights[0].T).abs().max().item()
        row = {
            "shape": [out_features, in_features],
            "layers": layers,
            "weights_a_round": len(weights),
            **{f"{name}_us": seconds * 1e6 for name, seconds in timed.items()},
            **{f"{name}_gb_per_s": size / seconds / 1e9 for name, seconds in timed.items()},
            "reduction_over_mkl": timed["mkl"] / timed["reduction"],
            "largest_difference": worst,
        }
        rows.append(row)
        print(
            f"{out_features:>6} x {in_features:<5} ({layers:>3} layers): mkl {row['mkl_gb_per_s']:5.1f} GB/s, "
            f"reduction {row['reduction_gb_per_s']:5.1f} GB/s, sum {row['sum_gb_per_s']:5.1f} GB/s; "
            f"reduction / mkl {row['reduction_over_mkl']:.2f} (largest difference {worst:.1e})",
            flush=True,
        )
    write_report("one_row_products", model=args.model, shapes=rows)


def write_report(name: str, **figures) -> Path:
    """``benchmarks/results/<name>.json``: the date, the command, the machine, torch's threads and release, then
    ``figures``; says where it went."""
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "command": f"python benchmarks/{name}.py",
        "machine": f"{platform.machine()} {os.cpu_count()} CPU cores, {platform.processor() or platform.system()}",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **figures,
    }
    out = HERE / "results" / f"{name}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written to {out}")
    return out


if __name__ == "__main__":
    main()
