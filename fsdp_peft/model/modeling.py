"""The model build: tokenizer, base model (optionally 4-bit), grown vocabulary and LoRA adapters, ready for FSDP.

`build_model` is the whole procedure, top to bottom; what it decides that later steps read (low-memory
loading, 4-bit settings, an initial adapter, new tokens) is one record, `fsdp_peft.model.model_record.ModelRecord`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from peft import LoraConfig, set_peft_model_state_dict
from transformers import (
    AutoConfig,
    AutoTokenizer,
    BitsAndBytesConfig,
    PretrainedConfig,
    PreTrainedModel,
    TrainingArguments,
    set_seed,
)

from fsdp_peft.core._compat.bitsandbytes_patches import cpu_weight_repacking_disabled
from fsdp_peft.core._compat.peft_patches import (
    adapters_created_off_meta,
    dora_lora_weight_without_graph,
    peft_wrapped,
    trainable_tokens_through_the_base_layer,
)
from fsdp_peft.core._compat.torch_patches import FP32_FROM_ROWS, cpu_bf16_products_in_fp32
from fsdp_peft.core.dtypes import trainable_dtypes_kept
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import logger
from fsdp_peft.model.adapter_files import find_adapter
from fsdp_peft.model.attention import architecture_problem, chosen_attention
from fsdp_peft.model.loading import low_memory_loading_requested, model_skeleton, pending_checkpoint
from fsdp_peft.model.model_record import record_of
from fsdp_peft.model.moe import configure_router_aux_loss, lora_target_parameters, router_modules
from fsdp_peft.model.moe_quantization import dequantize_in_forward, quantize_experts, quantized_share
from fsdp_peft.model.new_tokens import add_new_tokens, grow_vocabulary, trained_token_indices
from fsdp_peft.model.paths import resolve_model_path
from fsdp_peft.model.residual import (
    init_computed_before_loading,
    lora_linear_targets,
    prepared_initialisation,
    start_from_initial_adapter,
)
from fsdp_peft.model.variants import (
    lora_config_arguments,
    remember_initial_adapter,
    trained_copies_compute_in_the_model_dtype,
)
from fsdp_peft.model.vision import (
    auto_model_class,
    lora_target_regex,
    projector_to_save,
    quantization_skip_modules,
    vision_runs_on_every_rank,
    vision_weights_kept,
)
from fsdp_peft.settings.config import RecipeArguments
from fsdp_peft.settings.families import family_for, family_of_model, lora_targets, pad_token_for
from fsdp_peft.settings.four_bit import FourBit
from fsdp_peft.settings.fsdp_settings import mixed_precision_dtype


def build_model(recipe: RecipeArguments, training: TrainingArguments, tokenizer):
    """The model a run trains: a `PeftModel` on this rank's device (or a low-memory skeleton FSDP fills).

    1. the initialisation that needs the base weights (PiSSA/OLoRA/LoftQ on a 4-bit or low-memory base: a residual
       checkpoint and its initial adapter, computed once; `fsdp_peft.model.residual`) and 2. the base model, loaded or a
       weightless skeleton, with its attention kernel (`load_base_model`);
    the router's auxiliary loss of a mixture of experts set as ``router_aux_loss_coef`` says (`fsdp_peft.model.moe`);
    3. the vocabulary grown to the tokenizer's new tokens (``tokenizer``: `load_tokenizer`;
    `fsdp_peft.model.new_tokens`);
    4. the adapters, 5. the compat patches that keep them FSDP-safe, 6. the initial adapter, 7. the trainable
       parameters' dtypes (`attach_lora`).
    """
    set_seed(training.seed)  # before the adapters exist: every rank must draw the same LoRA init
    base = load_base_model(recipe, training)
    configure_router_aux_loss(base, recipe.router_aux_loss_coef)  # a mixture of experts' load-balancing loss
    grow_vocabulary(base, tokenizer, recipe)
    model = attach_lora(base, recipe, training)
    if recipe.adapter_name_or_path:
        start_from_trained_adapter(model, Path(recipe.adapter_name_or_path))
    if family_of_model(model).vision is not None:  # a rank without images still runs the tower (fsdp_peft.model.vision)
        vision_runs_on_every_rank(model)
    return model


def start_from_trained_adapter(peft_model, source: Path) -> None:
    """8. the weights of a trained adapter (``adapter_name_or_path``: SFT -> DPO/GRPO) in place of the fresh ones;
    every LoRA tensor of the model must come from it, in the dtype the model keeps them in."""
    adapter = find_adapter(source)
    config = peft_model.peft_config[peft_model.active_adapter]
    # peft's name for each setting, and the recipe key that sets it
    for key, recipe_key in (("r", "lora_r"), ("lora_alpha", "lora_alpha"), ("use_dora", "use_dora")):
        ours = getattr(config, key)
        if adapter.config.get(key, ours) != ours:
            raise ConfigError(
                f"adapter_name_or_path: {adapter.origin} was trained with {recipe_key} {adapter.config.get(key)}, "
                f"this recipe has {ours}; set {recipe_key}: {adapter.config.get(key)} to continue from it"
            )
    with trainable_dtypes_kept(peft_model):  # the adapter's tensors take the dtypes the recipe chose
        loaded = set_peft_model_state_dict(peft_model, adapter.tensors)
    missing = [key for key in loaded.missing_keys if "lora_" in key]
    if missing or loaded.unexpected_keys:
        names = (missing or loaded.unexpected_keys)[:2]
        raise ConfigError(
            f"adapter_name_or_path: {adapter.origin} does not fit this recipe's LoRA modules "
            f"({'missing' if missing else 'unexpected'}: {', '.join(names)}); use the lora_target_modules it had"
        )


def local_device() -> torch.device:
    """This rank's device: its own GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def load_tokenizer(recipe: RecipeArguments):
    """The model's tokenizer, with a pad token (the family's choice, else EOS, when the model defines none)."""
    path = resolve_model_path(recipe.model_name_or_path)
    remote = recipe.trust_remote_code
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=remote)
    family = family_for(AutoConfig.from_pretrained(path, trust_remote_code=remote).model_type)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = pad_token_for(tokenizer, family)
    if recipe.new_special_tokens:  # the model grows to match (`fsdp_peft.model.new_tokens.grow_vocabulary`)
        add_new_tokens(tokenizer, list(recipe.new_special_tokens))
    if recipe.use_chat_template and not tokenizer.chat_template:
        raise ConfigError(
            f"use_chat_template: the tokenizer of {recipe.model_name_or_path} has no chat template; "
            f"{family.chat_template_hint}, or set use_chat_template: false"
        )
    return tokenizer


def quantization_config(recipe: RecipeArguments, config: PretrainedConfig) -> BitsAndBytesConfig | None:
    """QLoRA's 4-bit config for a model of ``config`` (a VLM's tower stays 16-bit); the storage dtype is the FSDP
    gather dtype so shards hold whole bytes."""
    four_bit = FourBit.of(recipe)
    if four_bit is None:
        return None
    return four_bit.bitsandbytes_config(quantization_skip_modules(family_for(config.model_type)))


def load_base_model(recipe: RecipeArguments, training: TrainingArguments | None = None) -> PreTrainedModel:
    """Load the base model on this rank's device through the ordinary ``from_pretrained`` path.

    Under FSDP2 with ``cpu_ram_efficient_loading`` it is a weightless skeleton instead: the weights
    arrive, shard by shard from rank 0, once FSDP has sharded it (`fsdp_peft.model.loading`). Attention runs
    the ``attn_implementation`` kernel, ``auto`` one the architecture supports (`fsdp_peft.model.attention`).
    """
    device = local_device()
    path, initial_adapter = resolve_model_path(recipe.model_name_or_path), None
    config = AutoConfig.from_pretrained(path, trust_remote_code=recipe.trust_remote_code)
    # PiSSA/OLoRA/LoftQ: load the residual (fsdp_peft.model.residual), a checkpoint of the same architecture
    if init_computed_before_loading(recipe, training):
        path, initial_adapter = initialisation_checkpoint(recipe, path, config, training, device)
    if low_memory_loading_requested(training):
        model = model_skeleton(
            path, getattr(torch, recipe.torch_dtype), quantization_config(recipe, config), recipe.trust_remote_code
        )
    else:
        model = auto_model_class(config).from_pretrained(
            path,
            dtype=getattr(torch, recipe.torch_dtype),
            quantization_config=quantization_config(recipe, config),
            device_map={"": device},
            trust_remote_code=recipe.trust_remote_code,
        )
    problem = architecture_problem(recipe.attn_implementation, type(model))  # remote code validation could not see
    if problem:
        raise ConfigError(problem)
    attention = chosen_attention(recipe.attn_implementation, type(model))
    if model.config._attn_implementation != attention:
        model.set_attn_implementation(attention)
    if device.type == "cpu":
        disable_cpu_weight_repacking(model)
        bf16_products_prepared(model, training)
    record_of(model).initial_adapter_file = initial_adapter
    if recipe.load_in_4bit:  # a mixture of experts: its experts too (transformers quantizes Linear layers only)
        record_of(model).quantized_experts = quantize_experts(model, FourBit.of(recipe), device)
    if recipe.load_in_4bit and pending_checkpoint(model) is None:  # a skeleton's 4-bit layers are not built yet
        quantized, total = quantized_share(model)
        logger.info(
            f"4-bit base: {quantized:,} of its {total:,} weights in 4 bits ({quantized / total:.1%}: linear layers"
            f"{' and experts' if record_of(model).quantized_experts else ''}); the rest (embeddings, head, norms"
            f"{', routers' if record_of(model).quantized_experts else ''}) in {recipe.torch_dtype}"
        )
        if (vision := family_of_model(model).vision) is not None:
            kept = vision_weights_kept(model, vision)
            logger.info(f"4-bit base: the vision tower and projector stay {recipe.torch_dtype}: {kept:,} weights")
    return model


def initialisation_checkpoint(
    recipe: RecipeArguments, path: str, config: PretrainedConfig, training, device: torch.device
):
    """The residual checkpoint and initial adapter of PiSSA/OLoRA/LoftQ, targets read from a weightless model of
    ``config``."""
    skeleton = model_skeleton(
        path, getattr(torch, recipe.torch_dtype), quantization_config(recipe, config), recipe.trust_remote_code
    )
    with adapters_created_off_meta():
        targets = lora_linear_targets(peft_wrapped(skeleton, lora_config(recipe, skeleton, shapes_only=True)))
    return prepared_initialisation(recipe, path, targets, training.seed, device)


def lora_config(recipe: RecipeArguments, model: PreTrainedModel, shapes_only: bool = False) -> LoraConfig:
    """peft's ``LoraConfig`` for the recipe (``shapes_only``: no initialisation from the base weights); the rows of
    new tokens (`fsdp_peft.model.new_tokens`) join the trainable tokens."""
    arguments = lora_config_arguments(recipe, shapes_only)
    arguments["trainable_token_indices"] = trained_token_indices(model, recipe.trainable_token_indices)
    arguments["target_parameters"] = lora_target_parameters(recipe.lora_target_parameters, model)
    family = family_of_model(model)
    targets = lora_targets(recipe.lora_target_modules, family)
    if family.vision is not None:  # the language model's layers (and the tower's with lora_vision_tower) only
        names = [targets] if isinstance(targets, str) else targets
        targets = lora_target_regex(model, family.vision, names, recipe.lora_vision_tower)
        if recipe.train_projector:
            arguments["modules_to_save"] = [*(arguments["modules_to_save"] or []), projector_to_save(family.vision)]
    if recipe.train_router:  # a full trained copy of every MoE layer's router
        routers = router_modules(model, family.router_module) if family.router_module else []
        if not routers:
            raise ConfigError(
                f"train_router: {recipe.model_name_or_path} has no router of a known family next to its experts; "
                "name it in lora_modules_to_save instead, or set train_router: false"
            )
        arguments["modules_to_save"] = [*(arguments["modules_to_save"] or []), *routers]
    return LoraConfig(
        r=recipe.lora_r,
        lora_alpha=recipe.lora_alpha,
        lora_dropout=recipe.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
        **arguments,
    )


disable_cpu_weight_repacking = cpu_weight_repacking_disabled  # the patch lives in the compat layer


def bf16_products_prepared(model: torch.nn.Module, training: TrainingArguments | None = None) -> None:
    """For ``model`` on CPU computing in bf16 (bf16 weights, a 4-bit compute dtype of bf16, or bf16 mixed
    precision): its products computed in fp32 and rounded once where the CPU has no native bf16 products
    (`fsdp_peft.core._compat.torch_patches.cpu_bf16_products_in_fp32`), said in one line the first time."""
    mixed = {"bf16": training.bf16, "fp16": training.fp16} if training is not None else {}
    bf16 = mixed_precision_dtype(mixed) == "bfloat16"  # the recipe's bf16, or the launcher's mixed_precision
    bf16 = bf16 or any(p.dtype == torch.bfloat16 for p in model.parameters())
    bf16 = bf16 or any(getattr(m, "compute_dtype", None) == torch.bfloat16 for m in model.modules())
    if bf16 and cpu_bf16_products_in_fp32():
        logger.info(
            "CPU without native bf16 matrix products (oneDNN's AVX512/AMX bf16 GEMM): bf16 products of "
            f"{FP32_FROM_ROWS} rows and columns or more run as fp32 products of the same values, rounded once, as a "
            "GPU's bf16 GEMM accumulates (7-8x faster here at a training step's shapes)"
        )


def attach_lora(model: PreTrainedModel, recipe: RecipeArguments, training: TrainingArguments):
    """Wrap ``model`` in LoRA adapters (``[auto]``: the family's default modules) and return the `PeftModel`.

    Adapter weights stay in fp32 (master weights) when a bf16/fp16 mixed-precision policy casts them for
    compute; without one they take the base dtype, so an FSDP unit never mixes parameter dtypes.
    """
    initial_adapter = record_of(model).initial_adapter_file  # computed before loading: set after creation
    config = lora_config(recipe, model, shapes_only=initial_adapter is not None)
    keep_fp32 = mixed_precision_dtype({"bf16": training.bf16, "fp16": training.fp16}) is not None
    skeleton = pending_checkpoint(model) is not None  # low-memory loading: its adapters must be real all the same
    with adapters_created_off_meta() if skeleton else contextlib.nullcontext():
        peft_model = peft_wrapped(model, config, autocast_adapter_dtype=keep_fp32)
    dequantize_in_forward(record_of(model).quantized_experts)  # 4-bit experts, adapters sized: dequantized per forward
    if recipe.use_dora:  # the same values, without FSDP1's second graph through the LoRA units (_compat)
        dora_lora_weight_without_graph(peft_model)
    # trainable tokens (and new tokens' rows): the same values, the frozen embedding / head called (FSDP1 gathers it)
    trainable_tokens_through_the_base_layer(peft_model)
    if initial_adapter is not None:
        base = resolve_model_path(recipe.model_name_or_path)
        start_from_initial_adapter(peft_model, initial_adapter, recipe.init_lora_weights, base)
    remember_initial_adapter(peft_model, recipe)
    # peft keeps only lora_* layers in fp32: trained copies (modules_to_save) and token rows follow the same rule
    trainable_dtype = torch.float32 if keep_fp32 else getattr(torch, recipe.torch_dtype)
    for parameter in peft_model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.to(trainable_dtype)
    trained_copies_compute_in_the_model_dtype(peft_model, getattr(torch, recipe.torch_dtype))
    return peft_model
