"""bitsandbytes' 4-bit formats decoded from their definition: the oracle of every 4-bit test (and of
``benchmarks/gpu_checks/kernels.py``'s CUDA check). Nothing here calls bitsandbytes.

The format (``bitsandbytes.functional.quantize_4bit``, as of 0.50): the tensor's values in row-major order, cut into
blocks of ``blocksize``; each value is stored as the index (4 bits) of the nearest entry of a 16-value code book
(NF4 or FP4) after dividing it by its block's absolute maximum ("absmax"); two indices a byte, the first value in the
high nibble; the bytes viewed in any ``quant_storage`` dtype. With double quantization (``compress_statistics``) the
absmaxes are stored as their mean ("offset", fp32) plus uint8 indices into the signed dynamic map of 8-bit
block-wise quantization, in blocks of 256 absmaxes, each block with its own fp32 scale.
"""

from __future__ import annotations

import math

import torch

# NF4 (Dettmers et al. 2023, QLoRA, Appendix E): 16 quantiles of N(0, 1), 8 on the positive side and 7 on the
# negative side plus an exact zero, normalised to [-1, 1].
NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
NF4_OFFSET = 0.9677083  # the outermost quantile's probability: (1 - 1/(2*15) + 1 - 1/(2*16)) / 2, as in the paper
# FP4 as bitsandbytes defines it: a sign bit, then 3 bits for 0, 0.0625 (subnormal) and the exponent/mantissa
# pairs 8, 12, 4, 6, 2, 3, normalised by the largest (12).
FP4 = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)
NESTED_BLOCK = 256  # absmaxes per scale of the double quantization


def code_book(quant_type: str) -> torch.Tensor:
    """The 16 values a 4-bit index stands for (fp32)."""
    values = torch.tensor(NF4 if quant_type == "nf4" else FP4, dtype=torch.float32)
    return values / values.abs().max()


def nf4_from_quantiles() -> torch.Tensor:
    """NF4 computed from its definition (for checking the table above, to fp32 rounding)."""
    positive = torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).sort().values
    return (values / values.abs().max()).float()


def dynamic_map() -> torch.Tensor:
    """The signed dynamic map of 8-bit block-wise quantization (Dettmers et al. 2022, "8-bit optimizers"): one sign
    bit, then for exponent i = 0..6 the midpoints of 2^i + 1 evenly spaced points in [0.1, 1], scaled by 10^(i-6);
    plus 0 and 1, padded with zeros to 256 entries, sorted (fp32)."""
    values: list[float] = []
    for exponent in range(7):
        bounds = torch.linspace(0.1, 1, 2**exponent + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        values += ((10 ** (exponent - 6)) * means).tolist()
        values += (-(10 ** (exponent - 6)) * means).tolist()
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    return torch.tensor(sorted(values), dtype=torch.float32)


def indices(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` 4-bit indices of ``packed`` (any dtype: its bytes), high nibble first."""
    raw = packed.contiguous().view(torch.uint8).reshape(-1).long()
    return torch.stack([raw >> 4, raw & 0xF], dim=1).reshape(-1)[:count]


def nested_absmax(quantized: torch.Tensor, scales: torch.Tensor, offset: torch.Tensor | float) -> torch.Tensor:
    """Double quantization undone: each block's absmax from its uint8 index, its group's scale and the offset."""
    group_scale = scales.float().repeat_interleave(NESTED_BLOCK)[: quantized.numel()]
    return dynamic_map()[quantized.reshape(-1).long()] * group_scale + torch.as_tensor(offset, dtype=torch.float32)


def decode_values(
    packed: torch.Tensor, absmax: torch.Tensor, shape, blocksize: int, quant_type: str, dtype: torch.dtype
) -> torch.Tensor:
    """The tensor of ``shape`` from its packed indices and its blocks' fp32 absmaxes: code value x absmax, in fp32,
    then cast to ``dtype``."""
    count = math.prod(shape)
    scale = absmax.float().reshape(-1).repeat_interleave(blocksize)[:count]
    return (code_book(quant_type)[indices(packed, count)] * scale).reshape(shape).to(dtype)


def decode(packed: torch.Tensor, state, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor a bitsandbytes ``QuantState`` describes (only its stored fields are read: shape, blocksize,
    quant_type, absmax, and for double quantization offset, state2.absmax and state2.blocksize)."""
    if state.nested:
        assert state.state2.blocksize == NESTED_BLOCK, state.state2.blocksize
        absmax = nested_absmax(state.absmax.view(torch.uint8), state.state2.absmax, state.offset)
    else:
        absmax = state.absmax
    return decode_values(packed, absmax, tuple(state.shape), state.blocksize, state.quant_type, dtype or state.dtype)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` (Frobenius norms, fp32)."""
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _aligned(count: int) -> int:
    return -(-count // 4) * 4


def decode_expert_rows(
    rows: torch.Tensor, shape, quant_type: str, double_quant: bool, dtype: torch.dtype, blocksize: int = 64
) -> torch.Tensor:
    """``[experts, out, in]`` from fsdp-peft's 4-bit expert rows (``fsdp_peft/model/moe_quantization.py``'s docstring),
    read from the layout as documented: per expert one row of bytes holding its packed values, then (each piece starting
    on a 4-byte boundary) its block absmaxes (fp32; with double quantization uint8 indices, then the fp32 scales of
    their groups of 256, then the fp32 offset)."""
    experts, out_features, in_features = shape
    values = out_features * in_features
    blocks = values // blocksize
    raw = rows.contiguous().view(torch.uint8).reshape(experts, -1)
    decoded = []
    for row in raw:
        packed, start = row[: values // 2], _aligned(values // 2)
        if double_quant:
            groups = -(-blocks // NESTED_BLOCK)
            quantized = row[start : start + blocks]
            start = _aligned(start + blocks)
            scales = row[start : start + 4 * groups].view(torch.float32)
            offset = row[start + 4 * groups : start + 4 * groups + 4].view(torch.float32)
            absmax = nested_absmax(quantized, scales, offset)
        else:
            absmax = row[start : start + 4 * blocks].view(torch.float32)
        decoded.append(decode_values(packed, absmax, (out_features, in_features), blocksize, quant_type, dtype))
    return torch.stack(decoded)
