"""4-bit experts (`fsdp_peft.model.moe_quantization`) in one process: bitsandbytes' own values, the forward of the model
with its experts dequantized, and the bytes, on the families with an entry and on generic-path MoEs (OLMoE,
Qwen2-MoE)."""

from __future__ import annotations

import copy

import bitsandbytes.functional as bnb_functional
import pytest
import torch
from four_bit_reference import decode, decode_expert_rows, relative_error

from fsdp_peft.model.moe import expert_parameters
from fsdp_peft.model.moe_quantization import (
    SUFFIX,
    dequantize_expert_rows,
    dequantize_in_forward,
    layout_for,
    quantize_expert_rows,
    quantize_experts,
    quantized_share,
)
from fsdp_peft.settings.four_bit import FourBit

SIZES = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MOES = {
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    ),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


def tiny_moe(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **SIZES, **MOES[model_type], vocab_size=128, eos_token_id=1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("shape", [(4, 96, 64), (4, 128, 96)], ids=str)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
def test_each_experts_row_decodes_by_the_reference_to_its_own_quantization(double_quant, quant_type, shape):
    """The stored rows read by the reference decoder (from the documented layout, not `ExpertLayout.offsets`) equal
    the rows `dequantize_expert_rows` gives, which equal bitsandbytes' quantization of each expert alone, decoded by
    the reference: exactly (0.0), for widths that are (64) and are not (96) a multiple of the 64-value block, where
    bitsandbytes' own CPU kernel is wrong unpatched (`fsdp_peft.core._compat`)."""
    weight = torch.randn(*shape, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    layout = layout_for(weight.shape, FourBit(quant_type, double_quant, storage_dtype="bfloat16"))
    rows = quantize_expert_rows(weight, layout)
    assert rows.shape == (4, layout.row_bytes // 2) and rows.dtype == torch.bfloat16
    stacked = dequantize_expert_rows(rows, layout, torch.float32)
    assert torch.equal(stacked, decode_expert_rows(rows, shape, quant_type, double_quant, torch.float32))
    for expert in range(4):
        packed, state = bnb_functional.quantize_4bit(
            weight[expert], blocksize=64, compress_statistics=double_quant, quant_type=quant_type
        )
        assert torch.equal(stacked[expert], decode(packed, state, torch.float32))
        assert relative_error(stacked[expert], weight[expert]) <= (0.1 if quant_type == "nf4" else 0.13)  # FP4: 0.12


@pytest.mark.parametrize("model_type", sorted(MOES))
def test_a_model_with_4bit_experts_computes_what_it_computes_with_their_dequantized_values(model_type):
    """Every expert parameter becomes 4-bit rows (generic-path MoEs included); the forward, which dequantizes them in
    each MoE block, equals the same model holding the dequantized values as ordinary parameters: 0.0 difference."""
    model = tiny_moe(model_type)
    names = expert_parameters(model)
    assert names == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    reference = copy.deepcopy(model)
    four_bit = FourBit("nf4", True, compute_dtype="float32", storage_dtype="bfloat16")
    blocks = quantize_experts(model, four_bit, torch.device("cpu"))
    dequantize_in_forward(blocks)
    assert len(blocks) == 2 and all(len(block.parameters) == 2 for block in blocks)
    stored = [name for name, _ in model.named_parameters() if name.endswith(SUFFIX)]
    assert len(stored) == 4 and not [n for n, _ in model.named_parameters() if n.endswith(tuple(names))]
    with torch.no_grad():
        for block in blocks:
            for entry in block.parameters:
                held = reference.get_submodule(_name_of(model, entry.module))
                getattr(held, entry.name).copy_(entry.dequantized())
        ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(0))
        got, want = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert torch.equal(got, want)
    assert (got - tiny_moe(model_type)(input_ids=ids).logits).abs().max() > 0  # and the 4 bits did change them
    quantized, total = quantized_share(model)
    experts = sum(p.numel() for n, p in reference.named_parameters() if n.endswith(tuple(names)))
    assert quantized == experts and total == sum(p.numel() for p in reference.parameters())


def _name_of(model, module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)


def test_a_real_experts_row_is_a_quarter_of_its_bf16_bytes_plus_under_one_percent_of_constants():
    """Qwen3-30B-A3B's gate_up expert (1536 x 2048) and Mixtral's (28672 x 4096): 4-bit values, uint8 block scales,
    fp32 second-level scales and offset."""
    for shape in ((128, 1536, 2048), (8, 28672, 4096)):
        layout = layout_for(shape, FourBit("nf4", True, storage_dtype="bfloat16"))
        ratio = layout.row_bytes / (shape[1] * shape[2] * 2)
        assert 0.25 < ratio < 0.26, (shape, ratio)
    with pytest.raises(ValueError, match="not a whole number of 64-value blocks"):
        layout_for((2, 3, 10), FourBit("nf4", True, storage_dtype="bfloat16"))
