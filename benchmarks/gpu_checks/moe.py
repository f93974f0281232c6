"""MoE runs (``moe`` in ``--shapes``): the ``fsdp-peft`` SFT run (`gpu_checks.sft.run_one`) on a random-weight Qwen3-MoE
(`models.QWEN3_MOE_SHAPES`: Qwen3-30B-A3B's layer with 8 layers of 64 experts 768 wide, 8 per token, vocab 32k;
2.70B parameters, 2.42B of them in the experts), 4 rows of 2048 tokens per step, LoRA r=16 on attention (``auto``)
and on every expert (``lora_target_parameters: [auto]``), dropout 0 (none on expert parameters). QLoRA first
(``load_in_4bit``: the linear layers through bitsandbytes, the experts by `fsdp_peft.model.moe_quantization`), then LoRA
on the bf16 base; no plain Trainer + peft runs (peft cannot quantize the experts). Measured besides the SFT
figures (peak memory next to the plan, tokens/s, losses finite):

- the experts' bytes as this rank stores them (4-bit: the local bytes of the ``*_4bit`` parameters; bf16: the expert
  parameters) next to the plan's ``counts.expert_bytes`` and to the same experts in bf16; QLoRA must keep them at
  most `EXPERT_BYTES_BOUND` (0.3) of bf16 (the layout gives 0.258): ``expert_bytes_within_bound``;
- ``dequantization`` (QLoRA): `fsdp_peft.model.moe_quantization.dequantize_expert_rows` of the first MoE layer's experts
  (all its expert parameters) against that decoder layer's forward as training runs it (autograd on, bf16 autocast,
  the run's rows x tokens of random hidden states; the forward includes its hook's dequantization), median of 5.

The dry run keeps to the QLoRA run (`MOE_DRY_RUNS`), 3 steps, on the embedded ``tiny-qwen3-moe``.
"""

from __future__ import annotations

from gpu_checks.common import LORA, median_seconds

# MoE runs: LoRA on attention and on every expert (peft's target_parameters), no dropout (none on expert parameters)
MOE_LORA = {**LORA, "lora_dropout": 0.0, "lora_target_modules": ["auto"], "lora_target_parameters": ["auto"]}


MOE_RUNS = ("qlora", "lora")  # most important first: the experts quantized by fsdp_peft.model.moe_quantization


# The dry run (CI) keeps to the QLoRA run (~20 s on 2 cores): the bf16 run differs from it only in load_in_4bit.
MOE_DRY_RUNS = ("qlora",)


EXPERT_BYTES_BOUND = 0.3  # 4-bit experts: at most this share of their bf16 bytes (0.258 expected)


def expert_storage(model) -> dict:
    """This rank's expert bytes as stored (4-bit: the local bytes of the ``*_4bit`` parameters; else the 3D expert
    parameters themselves) against the same experts in bf16."""
    from fsdp_peft.model.moe_quantization import expert_bytes

    stored, bf16 = expert_bytes(model)
    if not stored:  # 16-bit experts
        local = [p.to_local() if hasattr(p, "to_local") else p for n, p in model.named_parameters() if ".experts." in n]
        stored = sum(p.numel() * p.element_size() for p in local if p.ndim == 3)
        bf16 = sum(p.numel() * 2 for p in local if p.ndim == 3)
    quantized = stored < bf16
    return {
        "expert_bytes": stored,
        "expert_bf16_bytes": bf16,
        "expert_bytes_over_bf16": stored / bf16,
        "expert_bytes_within_bound": stored <= EXPERT_BYTES_BOUND * bf16 if quantized else None,
    }


def dequantization_cost(model, batch: int, seq: int) -> dict | None:
    """4-bit experts: `fsdp_peft.model.moe_quantization.dequantize_expert_rows` of the first MoE layer's experts (every
    expert parameter) against that decoder layer's forward as training runs it (autograd on, bf16 autocast, ``batch``
    x ``seq`` random hidden states; its hook's dequantization included), median of 5 each. ``None`` for 16-bit
    experts."""
    import torch

    from fsdp_peft.model.model_record import record_of
    from fsdp_peft.model.modeling import local_device
    from fsdp_peft.model.moe_quantization import dequantize_expert_rows

    blocks = record_of(model).quantized_experts
    if not blocks:
        return None
    moe, base, device = blocks[0], model.get_base_model(), local_device()
    layer = next(module for module in base.modules() if any(child is moe.block for child in module.children()))
    index = next((i for i, module in enumerate(base.model.layers) if module is layer), None)
    hidden = torch.randn(batch, seq, base.config.hidden_size, dtype=torch.bfloat16, device=device)
    positions = torch.arange(seq, device=device).expand(batch, -1)
    rotary = base.model.rotary_emb(hidden, positions)

    def dequantize():
        for entry in moe.parameters:
            dequantize_expert_rows(getattr(entry.module, entry.stored_name), entry.layout, entry.dtype)

    def forward():
        layer(hidden, position_embeddings=rotary, position_ids=positions)

    model.eval()  # no recomputation wrapper: one plain forward
    with torch.autocast(device.type, dtype=torch.bfloat16):
        dequantize_seconds, forward_seconds = median_seconds(dequantize), median_seconds(forward)
    return {
        "layer": index,
        "tokens": batch * seq,
        "experts": moe.parameters[0].experts,
        "parameters": [entry.name for entry in moe.parameters],
        "dequantize_seconds": dequantize_seconds,
        "layer_forward_seconds": forward_seconds,
        "dequantize_over_forward": dequantize_seconds / forward_seconds,
    }
