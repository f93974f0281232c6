"""The one record of what building a model decided that later steps read (`fsdp_peft.model.modeling.build_model`).

It lives on the base model under one attribute, set only here (`record_of`), and is reached through a peft
wrapper too; the steps that write it: low-memory loading (`fsdp_peft.model.loading`), PiSSA/OLoRA/LoftQ computed
before loading (`fsdp_peft.model.residual`), new tokens (`fsdp_peft.model.new_tokens`), the initial adapter of an init
that moves the base weights (`fsdp_peft.model.variants`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

_ATTRIBUTE = "_fsdp_peft_record"


@dataclass
class NewTokens:
    """What growing the vocabulary did: the tokens, their ids, the base's rows and the grown rows, the trained
    modules (peft target names) and the grown tensors (checkpoint keys)."""

    tokens: list[str]
    ids: list[int]
    base_rows: int
    rows: int
    embedding: str
    head: str | None
    grown: list[str]
    tokenizer: object = field(default=None, repr=False, compare=False)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if k != "tokenizer"}, indent=1)


@dataclass
class ModelRecord:
    # low-memory loading: the checkpoint a weightless skeleton still has to receive (``None`` once loaded)
    pending_checkpoint: str | None = None
    # a 4-bit skeleton: per base layer (its name in the checkpoint), the settings and dtype rank 0 quantizes with
    quantize: dict[str, tuple[dict, torch.dtype]] = field(default_factory=dict)
    # PiSSA/OLoRA/LoftQ computed before loading: the adapter file the base's residual checkpoint pairs with
    initial_adapter_file: Path | None = None
    # new special tokens: how the vocabulary grew (`fsdp_peft.model.new_tokens.grow_vocabulary`)
    new_tokens: NewTokens | None = None
    # an init that moves the base weights: the initial A0, B0, for the saved conversion onto the original base
    initial_adapter: dict[str, torch.Tensor] | None = None
    # QLoRA on a mixture of experts: the MoE blocks whose experts are stored in 4 bits
    # (`fsdp_peft.model.moe_quantization`)
    quantized_experts: list = field(default_factory=list)


def record_of(model: torch.nn.Module) -> ModelRecord:
    """The record of ``model`` (a base model, or a peft model around it), created empty on first use."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    record = getattr(base, _ATTRIBUTE, None)
    if record is None:
        record = ModelRecord()
        setattr(base, _ATTRIBUTE, record)
    return record
