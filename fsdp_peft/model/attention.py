"""The attention kernel (``attn_implementation``): installed, runnable here, the architecture's; and the default.

transformers picks the kernel when the model is built; a kernel whose package or device is missing, or that the
model's architecture lacks (Gemma-2 has no SDPA), fails there, after the launch. `attention_problem` and
`architecture_problem` say so before anything starts. ``auto`` (`chosen_attention`) takes FlashAttention-2 on a
CUDA GPU when flash-attn is installed and the architecture supports it (its variable-length kernel runs packed
rows without padding or mask, split by ``position_ids``), else PyTorch's SDPA where the architecture supports
it, else eager: transformers' own fallback when no kernel is asked for.
"""

from __future__ import annotations

import re

import torch
import transformers
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.utils import (
    is_flash_attn_2_available,
    is_flash_attn_3_available,
    is_kernels_available,
    is_torch_flex_attn_available,
)

from fsdp_peft.model.paths import local_model_config
from fsdp_peft.model.vision import auto_model_class

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
# the model class's flag that says it has the kernel (transformers' `PreTrainedModel._supports_*`), and its name
SUPPORT_FLAGS = {
    "sdpa": ("_supports_sdpa", "SDPA"),
    "flash_attention_2": ("_supports_flash_attn", "FlashAttention"),
    "flash_attention_3": ("_supports_flash_attn", "FlashAttention"),
    "flex_attention": ("_supports_flex_attn", "flex"),
}


def supports(model_class: type, kernel: str) -> bool:
    """Whether transformers lets a model of ``model_class`` run ``kernel`` (eager: every model)."""
    return kernel not in SUPPORT_FLAGS or bool(getattr(model_class, SUPPORT_FLAGS[kernel][0], False))


def chosen_attention(value: str, model_class: type | None) -> str:
    """The kernel a model of ``model_class`` runs for ``attn_implementation: value``; an explicit kernel as given.

    ``auto``: FlashAttention-2 on CUDA when flash-attn is installed and the class supports it, else SDPA when it
    does, else eager (as transformers' ``get_correct_attn_implementation(None)``). ``model_class`` ``None`` (not
    known offline): FlashAttention-2 or SDPA, and the model's own choice once it is loaded (`modeling`).
    """
    if value != AUTO:
        return value
    known = model_class is not None
    if torch.cuda.is_available() and is_flash_attn_2_available():
        if not known or supports(model_class, "flash_attention_2"):
            return "flash_attention_2"
    return "sdpa" if not known or supports(model_class, "sdpa") else "eager"


def causal_lm_class(config, trust_remote_code: bool = False) -> type | None:
    """The class ``AutoModelForCausalLM`` (``AutoModelForImageTextToText`` for a vision-language model:
    `fsdp_peft.model.vision.auto_model_class`) builds for ``config``, found without weights; ``None`` when unknown
    here (remote code not trusted or not on this machine, or no causal LM)."""
    reference = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if reference and trust_remote_code:
        try:
            return get_class_from_dynamic_module(reference, config.name_or_path, local_files_only=True)
        except (OSError, ValueError, ImportError):
            return None
    return auto_model_class(config)._model_mapping.get(type(config), None)


def model_class_named(name: str, trust_remote_code: bool = False) -> type | None:
    """`causal_lm_class` of model ``name``, from its config on this machine; ``None`` when it is not here."""
    try:
        return causal_lm_class(local_model_config(name, trust_remote_code), trust_remote_code)
    except (OSError, ValueError):
        return None


def architecture_problem(value: str, model_class: type | None) -> str | None:
    """Why a model of ``model_class`` cannot run ``attn_implementation: value`` (one line with the fix); ``None``
    when it can, for ``auto``, or when the class is not known."""
    if model_class is None or value not in SUPPORT_FLAGS or supports(model_class, value):
        return None
    flag, kernel = SUPPORT_FLAGS[value]
    others = ", ".join(k for k in ("eager", *SUPPORT_FLAGS) if k != value and supports(model_class, k))
    return (
        f"attn_implementation: {value}: {model_class.__name__} has no {kernel} attention in transformers "
        f"{transformers.__version__} ({flag} is False); use auto ({chosen_attention(AUTO, model_class)} for it here) "
        f"or a kernel it supports: {others}"
    )


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
