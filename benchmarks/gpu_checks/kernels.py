"""4-bit kernels (``kernels``, first: seconds, one child process, `kernel_check`): bitsandbytes' CUDA kernels against
``tests/four_bit_reference.py``, a decoder of the 4-bit formats written from their definition (the oracle of the
4-bit tests, which found bitsandbytes' CPU kernel wrong), every comparison made with the same packed bytes and quant
state moved to CPU:

- ``dequantize_4bit``: ``quantize_4bit`` of random bf16 tensors ``[5, w]`` and ``[2, 3, w]``, ``w`` in
  `KERNEL_WIDTHS` (whole 64-value blocks and not), blocks of 64 to 4096, NF4 and FP4, double quantization on and
  off, quant storage uint8, bf16 and fp32; ``dequantize_4bit`` asked for the tensor's shape and for a flat one must
  equal the reference's decode exactly (largest absolute difference 0.0);
- ``linear4bit``: ``Linear4bit`` as the QLoRA recipes build it (NF4, double quantization, bf16 weights and storage),
  compute dtype fp32 and bf16, input widths 96, 128, 200, 4096, 1, 6 and 64 rows (bitsandbytes' forward picks a fused
  4-bit matmul or dequantize + matmul by rows): the forward against ``x @ decode(W, compute).T`` and the input
  gradient against ``g @ decode(W).to(compute)`` (bitsandbytes' backward decodes in the weights' dtype, then casts),
  relative error within `LINEAR_BOUNDS` (fp32 1e-5: summation order; bf16 2**-7: two roundings);
- ``expert_rows``: `fsdp_peft.model.moe_quantization`'s rows of a ``[8, 768, 2048]`` bf16 weight (NF4 and FP4, double
  quantization on and off) dequantized must equal the reference's reading of the documented layout exactly.

``matches_reference``: all three hold. The dry run runs the same cases on CPU, ``dequantize_4bit`` on the widths up to
768 (`KERNEL_DRY_WIDTHS`: CI's time; tests/model/test_four_bit.py checks the CPU kernel against the same reference).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import subprocess
import sys

from gpu_checks.common import DRIVER, REPO, last_line, scratch_directory

# The 4-bit kernels against the reference decoder (``kernels``, first: seconds): last dimensions that are and are not
# whole blocks of 64 (96, 160, 200 as the CPU kernel got them wrong; the real models' 768 to 14336), every block size.
KERNEL_WIDTHS = (96, 160, 200, 768, 2048, 2880, 14336)


# the dry run (CPU, CI's time): tests/model/test_four_bit.py checks the CPU kernel
KERNEL_DRY_WIDTHS = KERNEL_WIDTHS[:4]


KERNEL_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)


KERNEL_EXPERTS = (8, 768, 2048)  # 8 experts of the MoE runs' 768 x 2048 weights


# Linear4bit against matmuls with the reference's weights, relative error: fp32, summation order alone (a sequential
# sum of 4096 products against BLAS: 1.2e-6; a misplaced block scale: 0.25); bf16, one unit in the last place: each
# side rounds its own output (H200, 2026-12-04: 4.3e-3 from bitsandbytes' fused few-row kernel, widths of whole blocks).
LINEAR_BOUNDS = {"float32": 1e-5, "bfloat16": 2**-7}


def kernel_check() -> dict:
    """bitsandbytes' 4-bit kernels (CUDA; the dry run: CPU) against `four_bit_reference`'s decoder of the format's
    definition: comparing a kernel with itself cannot see a wrong one (the CPU kernel was, `fsdp_peft.core._compat`)."""
    # isort: off
    import fsdp_peft  # noqa: F401  first: its import hook (on CPU, the dry run: the fixed dequantization kernel)

    # isort: on
    import torch

    # The reference decoder is the test suite's oracle, kept in tests/ (plain modules, not installed): appended last,
    # so that none of tests/' modules shadows benchmarks/' own.
    sys.path.append(str(REPO / "tests"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    parts = {"dequantize_4bit": dequantize_cases, "linear4bit": linear4bit_cases, "expert_rows": expert_rows_cases}
    result: dict = {"device": device.type}
    for name, part in parts.items():
        try:
            result[name] = part(device)
        except Exception as error:  # one part's failure, not the other parts'
            result[name] = {"failed": f"{type(error).__name__}: {error}"[:500], "passed": False}
    result["matches_reference"] = all(result[name]["passed"] for name in parts)
    return result


def dequantize_cases(device) -> dict:
    """``dequantize_4bit`` on ``device``, asked for the tensor's shape and for a flat one, against the reference decode
    of the same bytes and state on CPU: every setting a recipe can choose, widths that are and are not whole blocks."""
    import bitsandbytes.functional as bnb_functional
    import torch
    from four_bit_reference import decode

    storages, settings = (torch.uint8, torch.bfloat16, torch.float32), 0
    compared, unequal, largest = 0, [], 0.0
    widths = KERNEL_WIDTHS if device.type == "cuda" else KERNEL_DRY_WIDTHS
    for width, rows in itertools.product(widths, ((5,), (2, 3))):
        shape = (*rows, width)
        weight = torch.randn(shape, generator=torch.Generator().manual_seed(width + len(shape))).to(torch.bfloat16)
        for blocksize, quant_type, nested, storage in itertools.product(
            KERNEL_BLOCKSIZES, ("nf4", "fp4"), (False, True), storages
        ):
            if -(-weight.numel() // 2) % storage.itemsize:  # bitsandbytes drops bytes short of a storage element
                continue
            packed, state = bnb_functional.quantize_4bit(
                weight.to(device),
                blocksize=blocksize,
                compress_statistics=nested,
                quant_type=quant_type,
                quant_storage=storage,
            )
            flat = copy.copy(state)
            flat.shape = torch.Size([weight.numel()])
            got = (bnb_functional.dequantize_4bit(packed, state), bnb_functional.dequantize_4bit(packed, flat))
            state.to("cpu")  # in place (after the kernels' calls): the reference reads only CPU tensors
            want = decode(packed.cpu(), state)
            settings += 1
            for asked, tensor in zip(("shaped", "flat"), got):
                tensor, compared = tensor.cpu().view(shape), compared + 1
                largest = max(largest, (tensor.float() - want.float()).abs().max().item())
                if tensor.dtype != want.dtype or not torch.equal(tensor, want):
                    unequal.append(f"{list(shape)} {quant_type} blocks {blocksize} nested {nested} {storage} {asked}")
    return {
        "settings": settings,
        "dequantizations": compared,
        "unequal": len(unequal),
        "first_unequal": unequal[:10],
        "max_abs_difference": largest,
        "passed": compared > 0 and not unequal,
    }


def linear4bit_cases(device) -> dict:
    """``Linear4bit`` as the QLoRA recipes build it (nf4, double quantization, bf16 weights and storage) on ``device``:
    forward and input gradient against matmuls with the reference's weights. bitsandbytes picks its forward kernel
    by rows (a fused 4-bit matmul for few, dequantize + matmul for many): 1, 6 and 64 rows."""
    import bitsandbytes
    import torch
    from four_bit_reference import decode, relative_error

    from fsdp_peft.core._compat.bitsandbytes_patches import cpu_weight_repacking_disabled

    cases = []
    for compute, in_features in itertools.product((torch.float32, torch.bfloat16), (96, 128, 200, 4096)):
        generator = torch.Generator().manual_seed(in_features)
        weight = torch.randn(96, in_features, generator=generator).to(torch.bfloat16)
        layer = bitsandbytes.nn.Linear4bit(
            in_features, 96, bias=False, compute_dtype=compute, quant_type="nf4", quant_storage=torch.bfloat16
        )
        layer.weight = bitsandbytes.nn.Params4bit(
            weight, requires_grad=False, quant_type="nf4", quant_storage=torch.bfloat16
        )
        cpu_weight_repacking_disabled(layer.to(device))  # quantized by the move; on CPU, as the recipes run it
        state = copy.deepcopy(layer.weight.quant_state)
        state.to("cpu")
        packed = layer.weight.data.cpu()
        # As bitsandbytes computes: the forward decodes into the compute dtype, the backward into the weights', casts.
        forward_weight = decode(packed, state, compute).to(device)
        backward_weight = decode(packed, state).to(compute).to(device)
        for rows in (1, 6, 64):
            x = torch.randn(rows, in_features, generator=generator).to(compute).to(device).requires_grad_()
            out = layer(x)
            grad = torch.randn(out.shape, generator=generator).to(compute).to(device)
            out.backward(grad)
            with torch.no_grad():
                errors = (relative_error(out, x @ forward_weight.T), relative_error(x.grad, grad @ backward_weight))
            dtype = str(compute).removeprefix("torch.")
            case = {"compute": dtype, "in_features": in_features, "rows": rows}
            within = all(error <= LINEAR_BOUNDS[dtype] for error in errors)  # NaN: not within
            cases.append({**case, "forward": errors[0], "input_gradient": errors[1], "within_bound": within})
    passed = all(case["within_bound"] for case in cases)
    nan_first = lambda error: math.inf if math.isnan(error) else error  # noqa: E731
    largest = {
        d: max((c[k] for c in cases if c["compute"] == d for k in ("forward", "input_gradient")), key=nan_first)
        for d in LINEAR_BOUNDS
    }
    return {"cases": cases, "max_relative_error": largest, "bounds": LINEAR_BOUNDS, "passed": passed}


def expert_rows_cases(device) -> dict:
    """`fsdp_peft.model.moe_quantization`'s 4-bit expert rows (its layout around bitsandbytes' kernels) quantized and
    dequantized on ``device`` against the reference's reading of the rows as the layout is documented."""
    import torch
    from four_bit_reference import decode_expert_rows

    from fsdp_peft.model.moe_quantization import dequantize_expert_rows, layout_for, quantize_expert_rows
    from fsdp_peft.settings.four_bit import FourBit

    weight = torch.randn(KERNEL_EXPERTS, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(device)
    cases = []
    for quant_type, nested in itertools.product(("nf4", "fp4"), (True, False)):
        layout = layout_for(weight.shape, FourBit(quant_type, nested, storage_dtype="bfloat16"))
        rows = quantize_expert_rows(weight, layout)
        got = dequantize_expert_rows(rows, layout, torch.bfloat16).cpu()
        want = decode_expert_rows(rows.cpu(), weight.shape, quant_type, nested, torch.bfloat16)
        difference = (got.float() - want.float()).abs().max().item()
        cases.append({"quant_type": quant_type, "double_quant": nested, "max_abs_difference": difference})
        cases[-1]["equal"] = got.dtype == want.dtype and torch.equal(got, want)
    return {"shape": list(KERNEL_EXPERTS), "cases": cases, "passed": all(case["equal"] for case in cases)}


def kernel_run(left: float) -> dict:
    """`kernel_check` in a child process: a kernel's fault (a sticky CUDA error) stays out of the later runs."""
    out = scratch_directory("gpu_check_kernels_") / "kernels.json"
    command = [sys.executable, str(DRIVER), "--kernels", "--result", str(out)]
    child = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=left)
    if child.returncode != 0:
        return {"failed": last_line(child.stderr)}
    return json.loads(out.read_text())


def print_kernels(head: str, entry: dict) -> None:
    """The kernel check's verdict, then a line per part: its figures, or why it failed."""
    verdict = "MATCH" if entry["matches_reference"] else "DO NOT MATCH"
    print(f"{head} on {entry['device']}: the 4-bit kernels {verdict} the reference decoder", flush=True)
    parts = {}  # the entry's key: its line
    if "failed" not in (part := entry["dequantize_4bit"]):
        count, settings = part["dequantizations"], part["settings"]
        parts["dequantize_4bit"] = (
            f"{count - part['unequal']} of {count} equal ({settings} settings, shaped and flat),"
            f" largest |difference| {part['max_abs_difference']}"
        )
    if "failed" not in (part := entry["linear4bit"]):
        largest, bounds = part["max_relative_error"], part["bounds"]
        errors = ", ".join(f"{d} {largest[d]:.2e} (bound {bounds[d]:.2e})" for d in largest)
        parts["linear4bit"] = f"largest relative error of forward and input gradient: {errors}"
    if "failed" not in (part := entry["expert_rows"]):
        cases = part["cases"]
        largest = max(case["max_abs_difference"] for case in cases)
        equal = sum(case["equal"] for case in cases)
        parts["expert_rows"] = f"{part['shape']}: {equal} of {len(cases)} equal, largest |difference| {largest}"
    for key in ("dequantize_4bit", "linear4bit", "expert_rows"):  # as the JSON names them
        print(f"{'':<30}{key}: {parts.get(key) or 'failed: ' + entry[key]['failed']}", flush=True)
