"""QLoRA on a mixture of experts: the experts' 3D weights stored in 4 bits, dequantized in the forward.

``load_in_4bit`` (bitsandbytes through transformers) quantizes ``nn.Linear`` weights only, and a MoE layer's
experts are 3D parameters (`fsdp_peft.model.moe`): 90-95 % of a real MoE's weights would stay 16-bit. Here each expert
weight ``[out, in]`` is quantized on its own with bitsandbytes (``bnb_4bit_quant_type``, blocks of 64, double
quantization as for the linear layers), and everything one expert needs to be rebuilt — its packed 4-bit values,
its quantized block scales, their scales and offset — is one row of bytes. The rows of all experts of a parameter
form one 2D parameter ``<name>_4bit`` ``[experts, bytes]`` viewed in ``bnb_4bit_quant_storage`` (the FSDP gather
dtype), so FSDP2 shards it by expert like any other weight and gathers it whole in the unit's forward.

In the forward, a hook on the MoE block puts the dequantized ``[experts, out, in]`` tensor (compute dtype) under the
parameter's original name for the duration of the block, where the experts' own code and peft's LoRA on
parameters (`fsdp_peft.model.moe`) read it exactly as they read a 16-bit weight; outside the forward the name holds a
weightless placeholder of that shape (what peft sizes its adapters by). Autograd keeps the dequantized weight of
each layer for backward (peft folds LoRA into it), as for a 16-bit base: activation checkpointing frees it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fsdp_peft.model.moe import EXPERTS_MODULE
from fsdp_peft.settings.four_bit import BLOCKSIZE, NESTED_BLOCKSIZE, FourBit

SUFFIX = "_4bit"
BLOCK = BLOCKSIZE  # values per block scale, as transformers' 4-bit linear layers
NESTED_BLOCK = NESTED_BLOCKSIZE  # block scales per scale of the double quantization
ALIGN = 4  # every piece of a row starts on a 4-byte boundary (the fp32 pieces are read in place)


def _aligned(count: int) -> int:
    return -(-count // ALIGN) * ALIGN


@dataclass(frozen=True)
class ExpertLayout:
    """How one expert's ``[rows, columns]`` weight is laid out in its row of bytes."""

    rows: int
    columns: int
    quant_type: str
    double_quant: bool
    storage: torch.dtype

    @property
    def values(self) -> int:
        return self.rows * self.columns

    @property
    def blocks(self) -> int:
        return self.values // BLOCK

    @property
    def nested_blocks(self) -> int:
        return -(-self.blocks // NESTED_BLOCK)

    def offsets(self) -> tuple[int, int, int, int]:
        """Byte offsets of the block scales, their scales, the offset, and the row's end (padded)."""
        scales = _aligned(self.values // 2)
        nested = scales + _aligned(self.blocks * (1 if self.double_quant else 4))
        offset = nested + (4 * self.nested_blocks if self.double_quant else 0)
        end = offset + (4 if self.double_quant else 0)
        return scales, nested, offset, -(-end // self.storage.itemsize) * self.storage.itemsize

    @property
    def row_bytes(self) -> int:
        return self.offsets()[3]


def layout_for(shape: torch.Size | tuple, four_bit: FourBit) -> ExpertLayout:
    """The layout of one expert of a ``[experts, rows, columns]`` parameter; refused when blocks would straddle
    experts (a row not a whole number of 64-value blocks)."""
    _, rows, columns = shape
    if (rows * columns) % BLOCK:
        raise ValueError(f"an expert of {rows} x {columns} values is not a whole number of {BLOCK}-value blocks")
    return ExpertLayout(rows, columns, four_bit.quant_type, four_bit.double_quant, four_bit.storage)


def quantize_expert_rows(weight: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """``weight`` ``[experts, rows, columns]`` as ``[experts, row_bytes / itemsize]`` in the storage dtype."""
    import bitsandbytes.functional as bnb_functional  # lazy: only 4-bit experts need bitsandbytes

    experts = weight.shape[0]
    rows = torch.zeros(experts, layout.row_bytes, dtype=torch.uint8, device=weight.device)
    scales, nested, offset, _ = layout.offsets()
    for expert in range(experts):
        packed, state = bnb_functional.quantize_4bit(
            weight[expert].contiguous(),
            blocksize=BLOCK,
            compress_statistics=layout.double_quant,
            quant_type=layout.quant_type,
            quant_storage=torch.uint8,
        )
        row = rows[expert]
        row[: layout.values // 2] = packed.view(-1)
        if layout.double_quant:
            row[scales : scales + layout.blocks] = state.absmax.view(torch.uint8)
            row[nested : nested + 4 * layout.nested_blocks] = state.state2.absmax.float().view(torch.uint8)
            row[offset : offset + 4] = state.offset.float().reshape(1).view(torch.uint8)
        else:
            row[scales : scales + 4 * layout.blocks] = state.absmax.float().view(torch.uint8)
    return rows.view(layout.storage)


_CODES: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _codes(quant_type: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' 4-bit value table and the 8-bit table its double quantization uses, per device (built once)."""
    key = (quant_type, str(device))
    if key not in _CODES:
        import bitsandbytes.functional as bnb_functional  # lazy: as in quantize_expert_rows

        values = bnb_functional.get_4bit_type(quant_type, device=device)
        _CODES[key] = (values, bnb_functional.create_dynamic_map(signed=True).to(device))
    return _CODES[key]


def dequantize_expert_rows(rows: torch.Tensor, layout: ExpertLayout, dtype: torch.dtype) -> torch.Tensor:
    """``[experts, rows, columns]`` in ``dtype`` from the rows of `quantize_expert_rows`: bitsandbytes'
    ``dequantize_4bit`` of every expert at once (bit for bit what it gives one expert at a time)."""
    import bitsandbytes.functional as bnb_functional  # lazy: as in quantize_expert_rows

    experts = rows.shape[0]
    raw = rows.contiguous().view(torch.uint8)
    scales, nested, offset, _ = layout.offsets()
    values, nested_code = _codes(layout.quant_type, raw.device)
    if layout.double_quant:
        quantized = raw[:, scales : scales + layout.blocks].long()
        nested_scales = raw[:, nested : nested + 4 * layout.nested_blocks].contiguous().view(torch.float32)
        offsets = raw[:, offset : offset + 4].contiguous().view(torch.float32)
        spread = nested_scales.repeat_interleave(NESTED_BLOCK, dim=1)[:, : layout.blocks]
        absmax = nested_code[quantized] * spread + offsets
    else:
        absmax = raw[:, scales : scales + 4 * layout.blocks].contiguous().view(torch.float32)
    state = bnb_functional.QuantState(
        absmax=absmax.reshape(-1),
        shape=torch.Size((experts, layout.rows, layout.columns)),
        code=values,
        blocksize=BLOCK,
        quant_type=layout.quant_type,
        dtype=dtype,
    )
    return bnb_functional.dequantize_4bit(raw[:, : layout.values // 2].reshape(-1), state)


@dataclass
class QuantizedExpertParameter:
    """One quantized expert parameter: the module that held it, its name, layout and compute dtype."""

    module: torch.nn.Module
    name: str
    layout: ExpertLayout
    dtype: torch.dtype  # compute: what the forward reads
    experts: int
    load_dtype: torch.dtype  # what the 16-bit weights are cast to before quantizing (``torch_dtype``)

    @property
    def stored_name(self) -> str:
        return self.name + SUFFIX

    def placeholder(self, device: torch.device | None = None) -> torch.Tensor:
        """A weightless tensor of the parameter's shape and dtype (no storage beyond one element), on ``device`` or
        where the 4-bit rows are."""
        device = device or getattr(self.module, self.stored_name).device
        one = torch.zeros((), dtype=self.dtype, device=device)
        return one.expand(self.experts, self.layout.rows, self.layout.columns)

    def dequantized(self) -> torch.Tensor:
        return dequantize_expert_rows(getattr(self.module, self.stored_name), self.layout, self.dtype)


@dataclass
class QuantizedMoeBlock:
    """A MoE block (router and experts) whose experts' parameters are stored in 4 bits."""

    block: torch.nn.Module
    parameters: list[QuantizedExpertParameter]


def quantize_experts(model: torch.nn.Module, four_bit: FourBit, device: torch.device) -> list[QuantizedMoeBlock]:
    """Replace every expert parameter of ``model`` (3D, in a module called ``experts``) by its 4-bit rows (empty, on
    meta, for a weightless skeleton: the weights are quantized as they load, `fsdp_peft.model.loading`). Its name holds
    a weightless placeholder Parameter on ``device``, for peft to size its adapters by; `dequantize_in_forward` then
    makes it a buffer filled in the forward."""
    quantized = []
    for block in list(model.modules()):
        experts = getattr(block, EXPERTS_MODULE, None)
        if not isinstance(experts, torch.nn.Module):
            continue
        entries = []
        for name, parameter in list(experts.named_parameters(recurse=False)):
            if parameter.ndim != 3:
                continue
            layout = layout_for(parameter.shape, four_bit)
            if parameter.is_meta:
                width = layout.row_bytes // layout.storage.itemsize
                rows = torch.empty(parameter.shape[0], width, dtype=layout.storage, device="meta")
            else:
                rows = quantize_expert_rows(parameter.detach(), layout)
            del experts._parameters[name]
            experts.register_parameter(name + SUFFIX, torch.nn.Parameter(rows, requires_grad=False))
            entry = QuantizedExpertParameter(
                experts, name, layout, four_bit.compute, parameter.shape[0], parameter.dtype
            )
            experts.register_parameter(name, torch.nn.Parameter(entry.placeholder(device), requires_grad=False))
            entries.append(entry)
        if entries:
            quantized.append(QuantizedMoeBlock(block, entries))
    return quantized


def quantized_expert_parameter(
    blocks: list[QuantizedMoeBlock], module: torch.nn.Module, stored_name: str
) -> QuantizedExpertParameter | None:
    """The quantized expert parameter stored as ``module.<stored_name>``, if it is one."""
    for quantized in blocks:
        for entry in quantized.parameters:
            if entry.module is module and entry.stored_name == stored_name:
                return entry
    return None


def dequantize_in_forward(blocks: list[QuantizedMoeBlock]) -> None:
    """After peft has sized its adapters: each placeholder becomes a buffer (FSDP shards parameters only), and around
    each MoE block's forward its experts' weights are the dequantized ones."""
    for quantized in blocks:
        for entry in quantized.parameters:
            placeholder = entry.module._parameters.pop(entry.name)
            entry.module.register_buffer(entry.name, placeholder.data, persistent=False)
        _install_hooks(quantized.block, quantized.parameters)


def _install_hooks(block: torch.nn.Module, entries: list[QuantizedExpertParameter]) -> None:
    """Forward hooks of ``block``: dequantize before (inside FSDP2's unit, after its all-gather), release after."""

    def dequantize(module, args):
        for entry in entries:
            entry.module._buffers[entry.name] = entry.dequantized()

    def release(module, args, output):
        for entry in entries:
            entry.module._buffers[entry.name] = entry.placeholder()

    block.register_forward_pre_hook(dequantize)
    block.register_forward_hook(release)


def expert_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """``(4-bit expert bytes stored, the same experts' bf16 bytes)`` of this rank's (possibly sharded) model."""
    stored = bf16 = 0
    for name, parameter in model.named_parameters():
        if name.endswith(SUFFIX) and f".{EXPERTS_MODULE}." in f".{name}":
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
            stored += local.numel() * local.element_size()
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if hasattr(module, name + SUFFIX):
                bf16 += math.prod(buffer.shape) * 2
    return stored, bf16


def quantized_share(model: torch.nn.Module) -> tuple[int, int]:
    """``(weights stored in 4 bits, all weights)`` of a loaded 4-bit base, counted in values: bitsandbytes' linear
    layers and 4-bit experts against everything else (embeddings, head, norms, routers, experts left 16-bit)."""
    quantized = total = 0
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            state = getattr(parameter, "quant_state", None) or (
                getattr(module, "quant_state", None) if name == "weight" else None
            )
            if state is not None:  # bitsandbytes packs its values: the quant state knows the weight's shape
                count = math.prod(state.shape)
                quantized += count
            elif name.endswith(SUFFIX) and hasattr(module, name.removesuffix(SUFFIX)):
                count = math.prod(getattr(module, name.removesuffix(SUFFIX)).shape)
                quantized += count
            elif hasattr(module, name + SUFFIX):
                continue  # the placeholder of a 4-bit expert parameter
            else:
                count = parameter.numel()
            total += count
    return quantized, total
