"""bf16 products on CPU: aten's own kernel against the fp32 route of a CPU without native bf16 products.

For each linear layer shape of ``--model`` (SmolLM2-135M-Instruct by default, shapes read from its config) and each
row count, times ``x @ Wᵀ`` with bf16 ``x`` and ``W`` two ways (best of ``--repeats`` calls after one warm-up):

- ``aten``: aten's own CPU kernel (oneDNN's bf16 GEMM where the CPU has one, else a generic loop);
- ``fp32``: the operands copied to fp32, MKL's fp32 product, the result rounded to bf16 once: what
  `fsdp_peft.core._compat.torch_patches.cpu_bf16_products_in_fp32` runs, on CPUs without native bf16 products, for
  products of `FP32_FROM_ROWS` rows or more (fewer rows stay aten's: the weight's fp32 copy costs more there).

Prints GFLOP/s of each and fp32 / aten per shape and row count, and the smallest row count from which the fp32
route is faster for every shape; writes ``benchmarks/results/cpu_bf16_products.json``.

    python benchmarks/cpu_bf16_products.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROWS = (1, 4, 8, 16, 32, 96)


def best_seconds(call, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    from one_row_products import (  # lazy: a sibling script, importable when run from benchmarks/
        layer_shapes,
        write_report,
    )

    from fsdp_peft.core._compat.torch_patches import FP32_FROM_ROWS, aten_cpu_kernel, cpu_has_native_bf16_products

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    mm, keys = aten_cpu_kernel("mm"), torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    rows_out, faster_from = [], {}
    for (out_features, in_features), layers in sorted(layer_shapes(args.model).items()):
        weight = torch.randn(out_features, in_features).bfloat16()
        for rows in ROWS:
            x = torch.randn(rows, in_features).bfloat16()
            timed = {
                "aten": best_seconds(lambda: mm.call_boxed(keys, x, weight.T), args.repeats),
                "fp32": best_seconds(lambda: mm.call_boxed(keys, x.float(), weight.T.float()).bfloat16(), args.repeats),
            }
            flops = 2 * rows * in_features * out_features
            row = {
                "shape": [out_features, in_features],
                "layers": layers,
                "rows": rows,
                **{f"{name}_gflop_per_s": flops / seconds / 1e9 for name, seconds in timed.items()},
                "fp32_over_aten": timed["aten"] / timed["fp32"],
            }
            rows_out.append(row)
            if row["fp32_over_aten"] > 1 and (out_features, in_features) not in faster_from:
                faster_from[(out_features, in_features)] = rows
            print(
                f"{out_features:>6} x {in_features:<5} ({layers:>3} layers) {rows:>3} rows: aten "
                f"{row['aten_gflop_per_s']:6.1f} GFLOP/s, fp32 {row['fp32_gflop_per_s']:6.1f} GFLOP/s, "
                f"fp32 / aten {row['fp32_over_aten']:.2f}",
                flush=True,
            )
    shapes = {(r["shape"][0], r["shape"][1]) for r in rows_out}
    slowest = max((faster_from.get(shape, float("inf")) for shape in shapes), default=float("inf"))
    native = cpu_has_native_bf16_products()
    print(
        f"native bf16 products on this CPU: {native}; the fp32 route is faster for every shape from "
        f"{slowest} rows (the patch's threshold: {FP32_FROM_ROWS}{', unused here' if native else ''})"
    )
    write_report(
        "cpu_bf16_products",
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        native_bf16_products=native,
        model=args.model,
        fp32_faster_for_every_shape_from_rows=slowest if slowest != float("inf") else None,
        threshold_rows=FP32_FROM_ROWS,
        products=rows_out,
    )


if __name__ == "__main__":
    main()
