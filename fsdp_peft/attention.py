"""The attention kernel (``attn_implementation``): what is installed and runs on this device, and the default.

transformers picks the kernel when the model is built; a kernel whose package or device is missing fails
there, after the launch. `attention_problem` says so before anything starts. ``auto`` takes FlashAttention-2
on a CUDA GPU when flash-attn is installed (its variable-length kernel runs packed rows without padding
or mask, split by ``position_ids``) and PyTorch's SDPA everywhere else.
"""

from __future__ import annotations

import re

import torch
from transformers.utils import (
    is_flash_attn_2_available,
    is_flash_attn_3_available,
    is_kernels_available,
    is_torch_flex_attn_available,
)

AUTO = "auto"
IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
HUB_KERNEL = re.compile(r"^[\w.-]+/[\w.-]+(:[\w.-]+)?$")  # e.g. kernels-community/flash-attn (the `kernels` package)
NEEDS = {
    "flash_attention_2": ("the flash-attn package (pip install flash-attn)", is_flash_attn_2_available),
    "flash_attention_3": (
        "FlashAttention-3 (flash_attn_interface, built from flash-attention/hopper)",
        is_flash_attn_3_available,
    ),
    "flex_attention": ("torch >= 2.5 (flex attention)", is_torch_flex_attn_available),
}
GPU_ONLY = ("flash_attention_2", "flash_attention_3")


def default_attention() -> str:
    """``auto``: FlashAttention-2 on CUDA when installed, else SDPA."""
    if torch.cuda.is_available() and is_flash_attn_2_available():
        return "flash_attention_2"
    return "sdpa"


def resolved_attention(value: str) -> str:
    return default_attention() if value == AUTO else value


def attention_problem(value: str) -> str | None:
    """Why ``attn_implementation: value`` cannot run here (one line with the fix); ``None`` when it can."""
    if value == AUTO or value in ("sdpa", "eager"):
        return None
    fix = "or use sdpa (or auto)"
    if value in NEEDS:
        needed, available = NEEDS[value]
        if value in GPU_ONLY and not torch.cuda.is_available():
            return f"attn_implementation: {value} runs on CUDA GPUs only and this machine has none; {fix}"
        if not available():
            return f"attn_implementation: {value} needs {needed}, which is not installed; install it {fix}"
        return None
    if HUB_KERNEL.match(value):
        if not is_kernels_available():
            return (
                f"attn_implementation: {value} is a hub kernel and needs the kernels package; pip install kernels {fix}"
            )
        return None
    choices = ", ".join((AUTO, *IMPLEMENTATIONS))
    return f"attn_implementation: '{value}' is not one of {choices}, nor a hub kernel (org/name); {fix}"
