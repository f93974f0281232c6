"""Exact per-rank accounting (`fsdp_peft.procedures.memory`): bytes of parameters, gradients and optimizer states."""

from __future__ import annotations

import torch

from fsdp_peft.procedures.memory import gradient_bytes, optimizer_state_bytes, parameter_bytes


def test_accounting_counts_parameters_gradients_and_adam_states_after_a_step():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2, bias=False).to(torch.bfloat16))
    model[1].weight.requires_grad_(False)  # frozen: stored, but no gradient and no optimizer state
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    assert optimizer_state_bytes(optimizer) == 0  # states appear at the first step
    model[0](torch.ones(5, 3)).sum().backward()
    optimizer.step()
    trainable = (3 * 4 + 4) * 4  # fp32 weight and bias of the first layer
    assert parameter_bytes(model) == trainable + 4 * 2 * 2  # plus the frozen bf16 weight
    assert gradient_bytes(model) == trainable
    assert optimizer_state_bytes(optimizer) == 2 * trainable + 2 * 4  # two moments, one fp32 step per tensor
