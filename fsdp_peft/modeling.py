"""Model loading: tokenizer, base model (optionally 4-bit), and LoRA adapters, ready for FSDP."""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, PreTrainedModel, TrainingArguments

from fsdp_peft.config import RecipeArguments
from fsdp_peft.tiny import TINY_MODEL_NAME, tiny_model_path
from fsdp_peft.validation import mixed_precision_dtype


def resolve_model_path(name: str) -> str:
    """The embedded model's cache directory for ``tiny-llama``; any other name is passed through."""
    return str(tiny_model_path()) if name == TINY_MODEL_NAME else name


def local_device() -> torch.device:
    """This rank's device: its own GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def load_tokenizer(recipe: RecipeArguments):
    """The model's tokenizer, with a pad token (the EOS token when the model defines none)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(recipe.model_name_or_path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def quantization_config(recipe: RecipeArguments) -> BitsAndBytesConfig | None:
    """QLoRA's 4-bit config; the storage dtype is the FSDP gather dtype so shards hold whole bytes."""
    if not recipe.load_in_4bit:
        return None
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=recipe.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=recipe.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=getattr(torch, recipe.bnb_4bit_compute_dtype),
        bnb_4bit_quant_storage=getattr(torch, recipe.bnb_4bit_quant_storage),
    )


def load_base_model(recipe: RecipeArguments) -> PreTrainedModel:
    """Load the base model on this rank's device through the ordinary ``from_pretrained`` path."""
    device = local_device()
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(recipe.model_name_or_path),
        dtype=getattr(torch, recipe.torch_dtype),
        quantization_config=quantization_config(recipe),
        device_map={"": device},
    )
    if device.type == "cpu":
        disable_cpu_weight_repacking(model)
    return model


def disable_cpu_weight_repacking(model: torch.nn.Module) -> int:
    """Stop bitsandbytes from repacking 4-bit weights in place on CPU (returns the modules changed).

    On CPUs with AVX512-BF16, ``Linear4bit.forward`` in eval mode rewrites ``weight.data`` into a kernel
    layout and flags the shared ``quant_state``; under FSDP that rewrite hits the gathered copy and every
    later forward computes with the wrong layout. GPU runs never take that path.
    """
    changed = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            changed += 1
    return changed


def attach_lora(model: PreTrainedModel, recipe: RecipeArguments, training: TrainingArguments):
    """Wrap ``model`` in LoRA adapters (all linear layers by default) and return the `PeftModel`.

    Adapter weights stay in fp32 (master weights) when a bf16/fp16 mixed-precision policy casts them for
    compute; without one they take the base dtype, so an FSDP unit never mixes parameter dtypes.
    """
    from peft import LoraConfig, get_peft_model

    targets = recipe.lora_target_modules
    config = LoraConfig(
        r=recipe.lora_r,
        lora_alpha=recipe.lora_alpha,
        lora_dropout=recipe.lora_dropout,
        target_modules=targets[0] if targets == ["all-linear"] else targets,
        task_type="CAUSAL_LM",
    )
    keep_fp32 = mixed_precision_dtype({"bf16": training.bf16, "fp16": training.fp16}) is not None
    peft_model = get_peft_model(model, config, autocast_adapter_dtype=keep_fp32)
    if not keep_fp32:
        for parameter in peft_model.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.to(getattr(torch, recipe.torch_dtype))
    return peft_model
