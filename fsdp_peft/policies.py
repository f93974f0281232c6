"""FSDP settings adapted to PEFT models: the mixed-precision policy for adapters and 4-bit storage.

Accelerate's default FSDP2 policy for ``bf16`` reduces gradients in bf16 and casts every root output,
the loss included, to bf16 (so logged losses move in steps of 1/32 around 5). For adapters with fp32
master weights that throws precision away for nothing: here parameters are gathered and computed in
the mixed-precision dtype (which, for QLoRA, equals ``bnb_4bit_quant_storage``), gradients are reduced
in fp32, and outputs keep the dtype they were computed in.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator

MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def peft_mixed_precision_policy(mixed_precision: str, reduce_dtype: torch.dtype = torch.float32):
    """FSDP2 policy: gather and compute in the mixed-precision dtype, reduce in ``reduce_dtype``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=MIXED_PRECISION_DTYPES[mixed_precision], reduce_dtype=reduce_dtype)


def configure_fsdp_for_peft(accelerator: Accelerator) -> None:
    """Replace accelerate's FSDP2 mixed-precision policy by the PEFT one; no-op without FSDP2 or bf16/fp16."""
    state = accelerator.state
    plugin = getattr(state, "fsdp_plugin", None)
    if plugin is None or plugin.fsdp_version != 2 or state.mixed_precision not in MIXED_PRECISION_DTYPES:
        return
    plugin.mixed_precision_policy = peft_mixed_precision_policy(state.mixed_precision)
