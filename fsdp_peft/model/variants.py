"""LoRA variants: DoRA, rsLoRA, initialisation from the base weights, rank/alpha patterns, trained copies
of whole modules (``lora_modules_to_save``), trainable token rows and LoRA on the embedding layer.

One place turns the recipe keys into peft's ``LoraConfig`` arguments (`lora_config_arguments`) and holds
the rules that refuse what peft or FSDP cannot do, before any process group starts (registered in
`fsdp_peft.tools.validation.RULES`). What each variant costs and where it runs: docs/variants.md.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import torch

from fsdp_peft.model.loading import low_memory_loading_requested
from fsdp_peft.model.merge import init_reads_base_weights
from fsdp_peft.model.model_record import record_of
from fsdp_peft.model.paths import local_model_config, resolve_model_path
from fsdp_peft.settings.fsdp_settings import RuleContext
from fsdp_peft.settings.keys import unknown_choice

INIT_CHOICES = ("default", "gaussian", "pissa", "pissa_niter_N", "olora", "loftq", "eva")
LOFTQ_BITS = (2, 4, 8)
EMBEDDING_NAMES = ("embed_tokens", "wte", "word_embeddings")


def init_lora_weights(value: str) -> bool | str:
    """peft's ``init_lora_weights`` for the recipe value: ``default`` is peft's own default (``True``)."""
    return True if value == "default" else value


def parse_pattern(value, key: str) -> dict:
    """``lora_rank_pattern``/``lora_alpha_pattern``: a YAML mapping, or its JSON text on the command line."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, dict):
        raise ValueError(f"{key}: expected a mapping of module name (or regex) to a number, e.g. '{{\"q_proj\": 8}}'")
    return value


def lora_config_arguments(recipe, shapes_only: bool = False) -> dict:
    """The variant arguments of peft's ``LoraConfig`` (r, alpha, dropout and targets are set by the caller);
    ``shapes_only`` (a model on the meta device) skips initialisations that read the base weights."""
    init = "default" if shapes_only else recipe.init_lora_weights
    arguments = {
        "use_dora": recipe.use_dora,
        "use_rslora": recipe.use_rslora,
        "init_lora_weights": init_lora_weights(init),
        "rank_pattern": parse_pattern(recipe.lora_rank_pattern, "lora_rank_pattern"),
        "alpha_pattern": parse_pattern(recipe.lora_alpha_pattern, "lora_alpha_pattern"),
        "modules_to_save": list(recipe.lora_modules_to_save) or None,
        "trainable_token_indices": list(recipe.trainable_token_indices) or None,
    }
    if init == "eva":
        from peft import EvaConfig  # lazy: only EVA needs it

        arguments["eva_config"] = EvaConfig(rho=recipe.eva_rho, tau=recipe.eva_tau)
    if init == "loftq":
        from peft import LoftQConfig  # lazy: only LoftQ needs it (and scipy behind it)

        arguments["loftq_config"] = LoftQConfig(loftq_bits=recipe.loftq_bits, loftq_iter=recipe.loftq_iter)
    return arguments


def peft_name(name: str, adapter: str) -> str:
    """A trainable parameter's name as peft's ``save_pretrained`` writes it (``get_peft_model_state_dict``):
    the adapter name dropped, ``lora_magnitude_vector`` for DoRA's ``lora_magnitude_vector.<adapter>.weight``,
    ``<module>.weight`` for a ``modules_to_save`` copy. Done on names, since peft's own function reads the
    modules of the model, which under FSDP1 are wrapped (and gathering them there is collective)."""
    name = name.replace(f".modules_to_save.{adapter}.", ".")
    name = re.sub(rf"\.lora_magnitude_vector\.{re.escape(adapter)}\.weight$", ".lora_magnitude_vector", name)
    return re.sub(rf"\.{re.escape(adapter)}(?=\.|$)", "", name)


def peft_adapter_tensors(peft_model, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gathered trainable tensors under peft's names (`peft_name`, what ``PeftModel.from_pretrained``
    reads); for PiSSA/OLoRA, converted onto the original base (`remember_initial_adapter`)."""
    adapter = peft_model.active_adapter
    tensors = {peft_name(name, adapter): tensor for name, tensor in state_dict.items()}
    initial = record_of(peft_model).initial_adapter
    if initial is not None:  # PiSSA/OLoRA changed the base: save the update relative to the original base
        for name, start in initial.items():
            name = peft_name(name, adapter)
            if ".lora_A" in name or ".lora_embedding_A" in name:
                tensors[name] = torch.cat([tensors[name], start], dim=0)
            elif ".lora_B" in name or ".lora_embedding_B" in name:
                tensors[name] = torch.cat([tensors[name], -start], dim=1)
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def remember_initial_adapter(peft_model, recipe) -> None:
    """PiSSA and OLoRA move ``scale * B0 @ A0`` out of the base weights (LoftQ: the 4-bit base is about
    ``W - scale * B0 @ A0``): keep the initial A0, B0 (adapter-sized) so the saved adapter can be peft's own
    conversion to a plain LoRA of rank 2r on the original base."""
    if init_reads_base_weights(recipe.init_lora_weights):
        initial = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad and ".lora_" in n}
        record_of(peft_model).initial_adapter = initial


def converted_adapter_config(peft_model):
    """The adapter config to save: for PiSSA/OLoRA, peft's conversion (``save_pretrained(...,
    path_initial_model_for_weight_conversion=...)``): rank and patterns doubled, the scale kept."""
    config = peft_model.peft_config[peft_model.active_adapter]
    if record_of(peft_model).initial_adapter is None:
        return config
    config = copy.deepcopy(config)
    config.init_lora_weights = True
    config.r *= 2
    config.lora_alpha *= 2**0.5 if config.use_rslora else 2
    config.rank_pattern = {key: 2 * value for key, value in (config.rank_pattern or {}).items()}
    config.alpha_pattern = {key: 2 * value for key, value in (config.alpha_pattern or {}).items()}
    return config


def targets_embedding(recipe) -> bool:
    """LoRA on the input embedding: an embedding module name among ``lora_target_modules``."""
    return any(name in EMBEDDING_NAMES for name in recipe.lora_target_modules)


def variant_keys_are_known(context: RuleContext) -> str | None:
    recipe = context.recipe
    init = recipe.init_lora_weights
    if init not in INIT_CHOICES and not re.fullmatch(r"pissa_niter_[1-9]\d*", init):
        return unknown_choice("init_lora_weights", init, INIT_CHOICES).replace(
            "pissa_niter_N", "pissa_niter_N (N: subspace iterations, e.g. pissa_niter_16)"
        )
    if recipe.loftq_bits not in LOFTQ_BITS:
        return f"loftq_bits: must be one of {', '.join(map(str, LOFTQ_BITS))}, got {recipe.loftq_bits}"
    if recipe.loftq_iter < 1:
        return f"loftq_iter: must be at least 1, got {recipe.loftq_iter} (alternating LoftQ steps; 1 is peft's default)"
    for key in ("lora_rank_pattern", "lora_alpha_pattern"):
        try:
            pattern = parse_pattern(getattr(recipe, key), key)
        except ValueError as error:
            return str(error)
        bad = {
            name: v for name, v in pattern.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0
        }
        if bad or (key == "lora_rank_pattern" and any(not isinstance(v, int) for v in pattern.values())):
            kind = "a positive whole number (a rank)" if key == "lora_rank_pattern" else "a positive number"
            return f"{key}: every value must be {kind}, got {bad or pattern}"
    if recipe.eva_batches < 1:
        return f"eva_batches: must be at least 1, got {recipe.eva_batches} (global training batches EVA's SVD reads)"
    if not 0 < recipe.eva_tau <= 1:
        return (
            f"eva_tau: must be in (0, 1], got {recipe.eva_tau} (cosine similarity at which EVA stops; peft's is 0.99)"
        )
    if any(index < 0 for index in recipe.trainable_token_indices):
        return f"trainable_token_indices: token ids are 0 or more, got {recipe.trainable_token_indices}"
    return None


def eva_keeps_the_configured_ranks(context: RuleContext) -> str | None:
    recipe = context.recipe
    if recipe.init_lora_weights == "eva" and recipe.eva_rho != 1:
        return (
            f"eva_rho: {recipe.eva_rho} redistributes LoRA ranks between layers by the data pass, so neither "
            "fsdp-peft plan nor a resumed run (which skips the pass) can know the adapter shapes beforehand; "
            "set eva_rho: 1 (each layer keeps lora_r or its lora_rank_pattern rank)"
        )
    return None


def eva_initialises_linear_layers_only(context: RuleContext) -> str | None:
    recipe = context.recipe
    if recipe.init_lora_weights == "eva" and targets_embedding(recipe):
        return (
            "init_lora_weights: eva with LoRA on the embedding layer: peft's EVA initialises linear layers only and "
            "re-creates the embedding's adapter with its default init; remove the embedding from "
            "lora_target_modules, or use another init_lora_weights"
        )
    return None


def eva_forwards_the_loaded_model_before_sharding(context: RuleContext) -> str | None:
    recipe, training = context.recipe, context.training
    if recipe.init_lora_weights == "eva" and low_memory_loading_requested(training):
        return (
            "init_lora_weights: eva runs forward passes before FSDP shards the model, and under "
            "fsdp_cpu_ram_efficient_loading the ranks hold no weights until after sharding; "
            "set fsdp_cpu_ram_efficient_loading: false, or use another init_lora_weights"
        )
    return None


def init_from_base_weights_needs_the_full_precision_base(context: RuleContext) -> str | None:
    recipe = context.recipe
    init = recipe.init_lora_weights
    if not init_reads_base_weights(init):
        return None
    if init == "loftq" and not recipe.load_in_4bit:
        return (
            "init_lora_weights: loftq fits the adapter to the 4-bit quantization error of each base weight, and "
            "load_in_4bit is false (on a 16-bit base no export or reload reproduces it); set load_in_4bit: true, "
            "or use pissa or olora"
        )
    if init == "loftq" and recipe.loftq_bits != 4:
        return (
            f"loftq_bits: {recipe.loftq_bits} with load_in_4bit: the base is loaded in 4 bits, and LoftQ must fit "
            "the quantization the run trains on; set loftq_bits: 4"
        )
    if recipe.use_dora:
        return (
            f"init_lora_weights: {init} with use_dora: peft's conversion of the trained adapter back onto the original "
            "base covers LoRA's A and B, not DoRA's magnitude; set use_dora: false, or init_lora_weights: default"
        )
    return None


def trainable_tokens_and_their_embedding_copy_exclude_each_other(context: RuleContext) -> str | None:
    recipe = context.recipe
    saved = [name for name in recipe.lora_modules_to_save if name in EMBEDDING_NAMES]
    if recipe.trainable_token_indices and saved:
        return (
            f"trainable_token_indices: trains rows of the embedding that lora_modules_to_save ({saved[0]}) already "
            f"trains whole; drop {saved[0]} from lora_modules_to_save, or drop trainable_token_indices"
        )
    if recipe.trainable_token_indices and targets_embedding(recipe):
        return (
            "trainable_token_indices: peft cannot put trainable tokens and LoRA on the same embedding layer; "
            "remove the embedding from lora_target_modules, or drop trainable_token_indices"
        )
    return None


def _ties_embeddings(recipe) -> bool:
    """Whether the model's config (on this machine) ties the input embedding and the output head."""
    try:
        config = local_model_config(recipe.model_name_or_path, recipe.trust_remote_code)
    except (OSError, ValueError):
        return False  # not on this machine yet, or refused by another rule
    return bool(getattr(config, "tie_word_embeddings", False))


def fsdp1_keeps_tied_embeddings_in_the_root(context: RuleContext) -> str | None:
    recipe = context.recipe
    if (
        context.fsdp is None
        or context.fsdp.version != 1
        or not (recipe.trainable_token_indices or targets_embedding(recipe))
    ):
        return None
    if not _ties_embeddings(recipe):
        return None
    what = "trainable_token_indices" if recipe.trainable_token_indices else "LoRA on the embedding layer"
    return (
        f"{what} under FSDP1 with tied embeddings ({recipe.model_name_or_path} ties the input embedding and the "
        "output head): FSDP1 keeps the tied weight in the root unit, and the embedding adapter's unit would hold a "
        "second copy of it (trainable tokens also share their rows with the head); use FSDP2 (fsdp_version: 2)"
    )


def new_special_tokens_are_new(context: RuleContext) -> str | None:
    recipe = context.recipe
    tokens = list(recipe.new_special_tokens)
    if not tokens:
        return None
    bad = [token for token in tokens if not isinstance(token, str) or not token.strip()]
    if bad:
        return f"new_special_tokens: every token must be a non-empty string, got {bad[0]!r}; e.g. ['<|tool_call|>']"
    repeated = sorted({token for token in tokens if tokens.count(token) > 1})
    if repeated:
        return f"new_special_tokens: {repeated[0]!r} is listed twice; list each new token once"
    try:
        from transformers import AutoTokenizer  # lazy: only new tokens need the tokenizer checked

        vocabulary = AutoTokenizer.from_pretrained(
            resolve_model_path(recipe.model_name_or_path),
            local_files_only=True,
            trust_remote_code=recipe.trust_remote_code,
        ).get_vocab()
    except (OSError, ValueError):
        return None  # not on this machine yet: adding the tokens checks it again
    present = [token for token in tokens if token in vocabulary]
    if present:
        return (
            f"new_special_tokens: {present[0]!r} is already in the tokenizer's vocabulary; drop it from "
            "new_special_tokens (train its existing row with trainable_token_indices)"
        )
    return None


def new_tokens_train_as_trainable_tokens(context: RuleContext) -> str | None:
    """New tokens' rows are trainable tokens (embedding, and an untied head): the trainable tokens' rules apply."""
    recipe = context.recipe
    if not recipe.new_special_tokens:
        return None
    if "lm_head" in recipe.lora_modules_to_save:
        return (
            "new_special_tokens: the new rows of the output head are trained as trainable tokens, which peft cannot "
            "put inside a trained copy of lm_head (lora_modules_to_save); drop lm_head from lora_modules_to_save"
        )
    probe = dataclasses.replace(recipe, trainable_token_indices=[*recipe.trainable_token_indices, 0])
    probe = dataclasses.replace(context, recipe=probe)
    rules = (
        trainable_tokens_and_their_embedding_copy_exclude_each_other,
        fsdp1_keeps_tied_embeddings_in_the_root,
    )
    for rule in rules:
        if problem := rule(probe):
            return f"new_special_tokens: its rows are trained as trainable tokens: {problem}"
    return None


def stored_weight(module: torch.nn.Module | None) -> torch.Tensor | None:
    """The weight a module (or the base layer peft wrapped it around) registers: peft's trainable-token
    wrapper computes ``weight`` on access, so ``module.weight`` is not the stored tensor there."""
    while module is not None:
        weight = module._parameters.get("weight")
        if weight is not None:
            return weight
        module = next(
            (
                getattr(module, name)
                for name in ("base_layer", "token_adapter", "original_module")
                if hasattr(module, name)
            ),
            None,
        )
    return None


def trained_copies_compute_in_the_model_dtype(peft_model, dtype: torch.dtype) -> None:
    """Trained ``modules_to_save`` copies are fp32 master weights like the adapters: cast their input to their
    own dtype and their output to the model's ``dtype``, as peft does around its LoRA layers, so that a forward
    outside autocast and mixed precision (unsharded ``generate``) runs; inside them both casts do nothing."""
    for module in peft_model.modules():
        copies = getattr(module, "modules_to_save", None)
        if not isinstance(copies, torch.nn.ModuleDict):
            continue
        for trained in copies.values():
            trained.register_forward_pre_hook(_inputs_to_own_dtype)
            trained.register_forward_hook(lambda _module, _inputs, output: _floating_to(output, dtype))


def _inputs_to_own_dtype(module: torch.nn.Module, inputs: tuple) -> tuple:
    own = next(module.parameters()).dtype
    return tuple(_floating_to(value, own) for value in inputs)


def _floating_to(value, dtype: torch.dtype):
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
