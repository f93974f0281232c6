"""Fused training kernels (``kernels: liger``): Liger-Kernel's RMSNorm, RoPE, SwiGLU/GeGLU and fused linear
cross-entropy, patched into the model the recipe builds.

The patch itself is the Trainer's (``use_liger_kernel``, which ``kernels: liger`` sets): at the start of ``train()``,
before accelerate wraps the model in FSDP, transformers hands the PEFT model's base to Liger's
``_apply_liger_kernel_to_instance``, which rebinds each norm's and MLP's ``forward``, the model's ``forward`` (its
fused linear cross-entropy, which takes the chunked loss's place: `fsdp_peft.model.loss`) and the modeling module's
rotary function. The LoRA layers stay as they are: the patched MLP still calls its projections.

Liger's kernels are Triton kernels for NVIDIA GPUs: on a machine without CUDA the patched forward raises "0 active
drivers" at the first step. `kernels_problem` refuses, in one line and before any weights, what cannot run: no
CUDA device, a model type Liger does not patch, Liger missing or not the tested release (``FSDP_PEFT_UNVERIFIED=1``
takes another, as for the patched libraries), and the combinations this project has not verified with it (its
compiled layers, the vision-language loss, a mixture of experts, whose experts' forward Liger replaces, TRL's
trainers, which swap in fused losses of their own for ``use_liger_kernel``).
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

import torch

from fsdp_peft.core._compat.registry import UNVERIFIED_VARIABLE
from fsdp_peft.model.moe import expert_count
from fsdp_peft.model.vision import is_vision_config
from fsdp_peft.settings.choices import KERNELS

LIGER = KERNELS[1]
LIGER_RELEASE = "0.8.5"  # pinned in pyproject.toml's kernels extra; the release the checks were made with
INSTALL = "pip install 'fsdp-peft[kernels]'"


def liger_requested(recipe, training: dict) -> bool:
    """``kernels: liger``, or the Trainer's own ``use_liger_kernel: true`` (the same patch)."""
    return recipe.kernels == LIGER or bool(training.get("use_liger_kernel"))


def kernel_training_values(recipe) -> dict:
    """The ``TrainingArguments`` values ``kernels`` sets: the Trainer applies Liger's patch itself."""
    return {"use_liger_kernel": True} if recipe.kernels == LIGER else {}


def liger_chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk of Liger's fused linear cross-entropy (liger_kernel.ops.fused_linear_cross_entropy, its
    default ``chunk_mem_const`` 1): a chunk's logits about as large as the hidden states of all ``tokens``."""
    factor = -(-vocab // hidden)
    return min(1 << (-(-tokens // factor) - 1).bit_length(), tokens)


def liger_model_types() -> frozenset[str]:
    """The model types Liger patches (its own table), empty when Liger is not installed."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN  # lazy: an optional extra
    except ImportError:
        return frozenset()
    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def installed_liger() -> str | None:
    try:
        return version("liger-kernel")
    except PackageNotFoundError:
        return None


def kernels_problem(recipe, training: dict, through_trl: bool, model_config) -> str | None:
    """Why Liger's kernels cannot run this config here (one line with the fix); ``None`` when they can or are not
    asked for. ``model_config``: the model's transformers config, ``None`` when it cannot be read without weights
    (another rule says so). What no machine changes comes first, then the machine (CUDA), then the installation."""
    if not liger_requested(recipe, training):
        return None
    key = "kernels: liger" if recipe.kernels == LIGER else "use_liger_kernel: true"
    if through_trl:
        return (
            f"{key} with a TRL recipe: TRL replaces its preference and GRPO losses with Liger's fused ones for "
            "use_liger_kernel, which fsdp-peft has not verified; remove it (the SFT recipes take it)"
        )
    if recipe.compile:
        return f"{key} with compile: true: Liger's Triton kernels inside the compiled layers are not verified; keep one"
    if is_vision_config(model_config):
        return (
            f"{key} with the vision-language model {recipe.model_name_or_path}: Liger's forward replaces the "
            "loss this project gives every rank's token count (docs/vision.md); remove it"
        )
    if model_config is not None and expert_count(model_config.get_text_config()):
        return (
            f"{key} with the mixture of experts {recipe.model_name_or_path}: Liger replaces the experts' forward, "
            "which this project's 4-bit experts and expert adapters are not verified with; remove it"
        )
    if not torch.cuda.is_available():
        return (
            f"{key} runs Triton kernels on NVIDIA GPUs and this machine has no CUDA device (its first step would "
            "fail with '0 active drivers'); remove it here, keep it for GPU runs"
        )
    found = installed_liger()
    if found is None or (found != LIGER_RELEASE and os.environ.get(UNVERIFIED_VARIABLE) != "1"):
        status = f"found {found}" if found else "it is not installed"
        return f"{key} needs liger-kernel {LIGER_RELEASE} ({status}); {INSTALL}"
    model_type = getattr(model_config, "model_type", None)
    if model_type is not None and model_type not in liger_model_types():
        return (
            f"{key}: Liger patches no {model_type} model ({recipe.model_name_or_path}); it patches Llama, Mistral, "
            "Qwen2/3, Gemma and more (liger_kernel's MODEL_TYPE_TO_APPLY_LIGER_FN); remove it"
        )
    return None
