"""Vision-language models under FSDP: which parts LoRA adapts, which stay 16-bit, and every rank runs the tower.

A family with a `fsdp_peft.settings.families.VisionLayout` is a vision-language model (``...ForConditionalGeneration``,
loaded with ``AutoModelForImageTextToText``): a vision encoder (the tower), a projector from its features to the
text embeddings, and a language model. By default LoRA adapts the language model only (peft would otherwise match
the same names inside the tower: `lora_target_regex`), the tower and projector are frozen and, under QLoRA, kept in
16 bits (`quantization_skip_modules`; transformers matches skip names from the start of the full module name or as
a suffix, so a bare ``visual`` matches nothing). ``lora_vision_tower`` adds LoRA to the tower's linear layers,
``train_projector`` trains the projector as a full copy.

A batch without images on one rank and with images on another would call different FSDP units there (the tower's
blocks gather on one rank only): gloo aborts, NCCL hangs. `vision_runs_on_every_rank` makes a forward without
images run the tower on one fixed blank image and add zero times its features to the text embeddings: the same
units gather and reduce on every rank, and the loss and gradients are those of the forward without it.
"""

from __future__ import annotations

import re
import types

import torch

from fsdp_peft.settings.families import Family, VisionLayout, family_for

ALL_LINEAR = "all-linear"


def is_vision_config(config) -> bool:
    """Whether a model config is a vision-language model's (it has a vision encoder's config)."""
    return getattr(config, "vision_config", None) is not None


def auto_model_class_name(config) -> str:
    """The name of the transformers auto class that builds ``config``'s model: ``AutoModelForImageTextToText`` for
    a vision-language model, else ``AutoModelForCausalLM`` (by name: the export's model card needs no transformers)."""
    return "AutoModelForImageTextToText" if is_vision_config(config) else "AutoModelForCausalLM"


def auto_model_class(config):
    """The transformers auto class that builds ``config``'s model (`auto_model_class_name`)."""
    import transformers  # lazy: model code

    return getattr(transformers, auto_model_class_name(config))


def names_as_loaded(base, keys) -> dict[str, str]:
    """``{stored key: the model's parameter name}`` for the tensors of checkpoint directory ``base`` whose stored
    names differ from the model's: a vision-language checkpoint in the hub's older layout (Qwen2.5-VL's
    ``model.layers.*`` and ``visual.*``, Gemma 3's ``language_model.model.*``), renamed as transformers renames them
    while loading (its conversion mapping for the model, applied to a model built on the meta device). Empty for a
    checkpoint stored under the model's own names, and for text-only models (their names are never renamed here)."""
    from transformers import AutoConfig  # lazy: model code
    from transformers.conversion_mapping import get_model_conversion_mapping  # lazy: as above
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key  # lazy: as above

    config = AutoConfig.from_pretrained(base)
    if not is_vision_config(config):
        return {}
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    names = model.state_dict()
    mapping = get_model_conversion_mapping(model)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    loaded = {}
    for key in keys:
        if key in names:
            continue
        renamed, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, names)
        loaded[key] = renamed
    return loaded


def _linear_leaves(model: torch.nn.Module, prefix: str) -> list[str]:
    """The last name part of every linear layer (4-bit ones too) under module path ``prefix`` (sorted, each once)."""
    inside = f"{prefix}."
    return sorted(
        {
            n.rsplit(".", 1)[-1]
            for n, m in model.named_modules()
            if n.startswith(inside) and isinstance(m, torch.nn.Linear)
        }
    )


def _under(prefix: str, names: list[str]) -> str:
    return rf"{re.escape(prefix)}\.(?:.*\.)?(?:{'|'.join(map(re.escape, names))})"


def lora_target_regex(model: torch.nn.Module, layout: VisionLayout, names: list[str], vision_tower: bool) -> str:
    """peft's ``target_modules`` (a regex peft matches against whole module names) for ``names`` (module names, or
    ``all-linear``) inside the language model only; with ``vision_tower`` every linear layer of the tower's blocks
    too (not the projector: it trains whole with ``train_projector``)."""
    language = _linear_leaves(model, layout.language_model) if names == [ALL_LINEAR] else names
    parts = [_under(layout.language_model, language)]
    if vision_tower:
        blocks = [n for n, m in model.named_modules() if type(m).__name__ == layout.block]
        parent = blocks[0].rsplit(".", 1)[0] if blocks else layout.tower
        parts.append(_under(parent, _linear_leaves(model, parent)))
    return "|".join(parts)


def projector_to_save(layout: VisionLayout) -> str:
    """The projector's name as peft's ``modules_to_save`` matches it (a suffix of the module name)."""
    return layout.projector.rsplit(".", 1)[-1]


def quantization_skip_modules(family: Family) -> list[str] | None:
    """``llm_int8_skip_modules`` for a QLoRA base: the tower, the projector and the head stay 16-bit (a skip list
    replaces transformers' default, which is the head alone). ``None`` for a text model."""
    if family.vision is None:
        return None
    return [family.vision.tower, family.vision.projector, "lm_head"]


def vision_weights_kept(model: torch.nn.Module, layout: VisionLayout) -> int:
    """The vision tower's and projector's weights (elements), all unquantized; a 4-bit layer there is an error (a
    skip list that matched nothing: see the module docstring)."""
    parts = (f"{layout.tower}.", f"{layout.projector}.")
    quantized = [n for n, m in model.named_modules() if n.startswith(parts) and type(m).__name__ == "Linear4bit"]
    if quantized:
        raise RuntimeError(f"the vision tower was quantized ({quantized[0]}): llm_int8_skip_modules matched nothing")
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(parts))


def blank_image_inputs(config) -> dict:
    """Model inputs for one blank image at the smallest size the tower takes (what a processor would make of it)."""
    vision = config.vision_config
    if _patches_merged(config):
        merge, patch, temporal = vision.spatial_merge_size, vision.patch_size, vision.temporal_patch_size
        channels = getattr(vision, "in_channels", getattr(vision, "in_chans", 3))
        grid = torch.tensor([[1, merge, merge]])
        return {"pixel_values": torch.zeros(merge * merge, channels * temporal * patch * patch), "image_grid_thw": grid}
    return {"pixel_values": torch.zeros(1, vision.num_channels, vision.image_size, vision.image_size)}


def _patches_merged(config) -> bool:
    """Qwen's vision-language models (2.5 and 3): flattened patches with their grid, 3D rotary positions read from
    the input ids; else (Gemma 3) whole images."""
    return hasattr(config.vision_config, "spatial_merge_size")


def _features(inner: torch.nn.Module, blank: dict, device: torch.device) -> torch.Tensor:
    """The tower's features of the blank image, on ``device`` (the input ids': a parameter's shard may be offloaded),
    in the embeddings' dtype."""
    dtype = next(inner.get_input_embeddings().parameters()).dtype
    args = {k: (v.to(device, dtype) if k == "pixel_values" else v.to(device)) for k, v in blank.items()}
    output = inner.get_image_features(**args)
    features = getattr(output, "pooler_output", output)
    return torch.cat(list(features)) if isinstance(features, (tuple, list)) else features


def vision_runs_on_every_rank(model: torch.nn.Module) -> None:
    """A forward of ``model`` (a vision-language ``...ForConditionalGeneration``, or a PeftModel of one) without
    images runs the tower on a blank image and adds zero times its features to the text embeddings (see the module
    docstring). Generation's decoding steps (a filled cache) run no tower, on any rank, as without this."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = base.model
    if getattr(inner, "_vision_on_every_rank", False):
        return
    blank = blank_image_inputs(base.config)
    keeps_ids = _patches_merged(base.config)  # Qwen reads input_ids for its 3D rotary positions
    positions_here = family_for(base.config.model_type).vision.positions_from_ids
    original = inner.forward

    def forward(self, *args, input_ids=None, pixel_values=None, inputs_embeds=None, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.24 renames it to ``cache``
        prefill = cache is None or cache.get_seq_length() == 0
        if pixel_values is None and inputs_embeds is None and input_ids is not None and prefill:
            inputs_embeds = self.get_input_embeddings()(input_ids)
            features = _features(self, blank, input_ids.device)
            inputs_embeds = inputs_embeds + 0.0 * features.sum().to(inputs_embeds.dtype)
            if positions_here and kwargs.get("position_ids") is None:  # as the model computes them from the ids;
                kwargs["position_ids"], self.rope_deltas = self.get_rope_index(  # its decoding steps add the deltas
                    input_ids,
                    mm_token_type_ids=torch.zeros_like(input_ids),  # text only
                    attention_mask=kwargs.get("attention_mask"),
                )
            input_ids = input_ids if keeps_ids and not positions_here else None
        return original(*args, input_ids=input_ids, pixel_values=pixel_values, inputs_embeds=inputs_embeds, **kwargs)

    inner.forward = types.MethodType(forward, inner)
    inner._vision_on_every_rank = True
