"""FSDP settings for PEFT models, for both FSDP versions: wrap policy, mixed precision, ``generate``.

`Trainer` adapts FSDP to PEFT only on the FSDP1 path, and then with bf16 gradient reduction;
accelerate ignores peft's wrap policy under FSDP2. `configure_fsdp_for_peft` is the one place that
decides, before the model is prepared:

- **units**: every decoder layer (the config's ``transformer_layer_cls_to_wrap``, else the family's
  decoder layer class, else ``_no_split_modules``) is a unit, whatever wrap policy was configured;
  ``SIZE_BASED_WRAP`` is refused in `fsdp_peft.tools.validation` under both versions. FSDP1 also gives every
  trainable adapter leaf a unit
  of its own, so no flat parameter mixes trainable and frozen (or fp32 and bf16) tensors, and gives
  untied embeddings and head units of their own; tied ones stay together in the root. Embedding LoRA and
  trainable tokens, whose peft layer reads its trainable rows itself, get that layer as a unit holding only
  the rows and its frozen base embedding as another. FSDP2 shards
  per parameter, and accelerate already carves the untied embeddings and the final norm + head.
- **mixed precision**: parameters are gathered and computed in the mixed-precision dtype (for QLoRA
  this equals ``bnb_4bit_quant_storage``, checked in `fsdp_peft.tools.validation`), gradients are reduced
  in ``fsdp_reduce_dtype`` (fp32 by default), buffers and outputs keep their dtype (accelerate's default
  rounds the FSDP2 loss to bf16).
- **generate**: FSDP2's ``generate`` is registered as a forward method (by `Trainer`); for FSDP1,
  `register_generate` gathers the root unit around ``generate`` so nested units gather as they run.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.fsdp.wrap import (
    _or_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from fsdp_peft.model.variants import stored_weight
from fsdp_peft.settings.families import family_of_model

MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def decoder_layer_classes(model: torch.nn.Module, configured: list[str] | None = None) -> set[type]:
    """The decoder layer classes that become units: the ``configured`` names, else the family's decoder
    layer (and a vision-language model's vision encoder layer: `fsdp_peft.settings.families`), else the model's
    ``_no_split_modules`` (the generic path)."""
    family = family_of_model(model)
    family_layers = [family.decoder_layer] if family.decoder_layer else []
    if family.vision is not None:  # a vision-language model: its vision encoder's layers too
        family_layers.append(family.vision.block)
    names = configured or family_layers or list(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    missing = set(names) - {c.__name__ for c in classes}
    if missing:
        raise ValueError(f"transformer_layer_cls_to_wrap: no module of class {sorted(missing)} in the model")
    return classes


def embeddings_and_head(model: torch.nn.Module) -> tuple[list[torch.nn.Module], bool]:
    """The input embeddings and output head, and whether they share one weight (tied)."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = embed is not None and head is not None and stored_weight(embed) is stored_weight(head)
    return [m for m in (embed, head) if m is not None], tied


def reads_its_trainable_tensors(module: torch.nn.Module) -> bool:
    """A peft layer that reads trainable tensors held in a ``ParameterDict`` inside its own forward (LoRA's
    ``lora_embedding_A/B``, trainable tokens' ``trainable_tokens_delta``): the module FSDP1 must gather them in."""
    return any(
        isinstance(child, torch.nn.ParameterDict) and any(p.requires_grad for p in child.parameters())
        for child in module.children()
    )


def fsdp1_wrap_policy(model: torch.nn.Module, layer_classes: set[type], head_in_root: bool = False):
    """FSDP1 policy: decoder layers, each trainable adapter leaf, and untied embeddings / head.

    A peft layer that reads its trainable tensors itself (`reads_its_trainable_tensors`) is a unit holding only
    those, and its frozen ``base_layer`` (which it calls) a unit of its own; a wrapper around such a layer is
    no unit itself (nothing would be left in it). ``head_in_root``: the output head stays in the root unit, whose
    parameters are gathered for the whole forward, for code that reads its weight without calling it (TRL's
    fused log-prob head: its own unit would hand it the empty shard)."""
    modules, tied = embeddings_and_head(model)
    if head_in_root:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        modules = [m for m in modules if m is not head]
    readers = [m for m in model.modules() if reads_its_trainable_tensors(m)]
    own_units = {id(m) for m in readers} | {id(m.base_layer) for m in readers if hasattr(m, "base_layer")}
    if not tied:
        own_units |= {id(m) for m in modules if not any(map(reads_its_trainable_tensors, m.modules()))}

    def is_own_unit(module: torch.nn.Module) -> bool:
        if id(module) in own_units:
            return True
        weight = module._parameters.get("weight")  # not getattr: peft's token wrapper computes a merged weight
        return next(module.children(), None) is None and weight is not None and weight.requires_grad

    return functools.partial(
        _or_policy,
        policies=[
            functools.partial(lambda_auto_wrap_policy, lambda_fn=is_own_unit),
            functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_classes),
        ],
    )


def mixed_precision_policy(fsdp_version: int, mixed_precision: str, reduce_dtype: torch.dtype):
    """Gather and compute in the mixed-precision dtype, reduce in ``reduce_dtype``, leave buffers alone."""
    dtype = MIXED_PRECISION_DTYPES[mixed_precision]
    if fsdp_version == 2:
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    return MixedPrecision(param_dtype=dtype, reduce_dtype=reduce_dtype, buffer_dtype=None, cast_forward_inputs=True)


def configure_fsdp_for_peft(
    model: torch.nn.Module, accelerator: Accelerator, reduce_dtype: torch.dtype, head_in_root: bool = False
) -> None:
    """Set the FSDP plugin's wrap and mixed-precision policies for ``model`` (a PEFT model); ``head_in_root``: see
    `fsdp1_wrap_policy`."""
    state = accelerator.state
    plugin = state.fsdp_plugin
    layer_classes = decoder_layer_classes(model, plugin.transformer_cls_names_to_wrap)
    if plugin.fsdp_version == 1:
        plugin.auto_wrap_policy = fsdp1_wrap_policy(model, layer_classes, head_in_root)
    elif getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy) is not size_based_auto_wrap_policy:
        # accelerate's FSDP2 path only understands a transformer (or size) policy
        plugin.transformer_cls_names_to_wrap = sorted(c.__name__ for c in layer_classes)
        plugin.auto_wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_classes)
    if state.mixed_precision in MIXED_PRECISION_DTYPES:
        plugin.mixed_precision_policy = mixed_precision_policy(plugin.fsdp_version, state.mixed_precision, reduce_dtype)


def register_generate(model: torch.nn.Module) -> None:
    """Make ``model.generate`` work on an FSDP1 root: its own (unit-less) parameters are gathered around it.

    Under FSDP2 `Trainer` registers ``generate`` as an FSDP forward method; nothing to do here.
    """
    root = getattr(model, "_orig_mod", model)  # under torch_compile, FSDP1 wraps the compiled module's original
    if not isinstance(root, FSDP) or "generate" in vars(root):
        return
    inner_generate = root.module.generate

    @functools.wraps(inner_generate)
    def generate(*args, **kwargs):
        with FSDP.summon_full_params(root, recurse=False, writeback=False):
            return inner_generate(*args, **kwargs)

    root.generate = generate


def shard_for_generation(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Shard an inference model with FSDP2 over all ranks: one unit per decoder layer, then the root.

    ``generate`` is registered as an FSDP forward method, as `Trainer` does after preparing a model.
    """
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layer_classes = tuple(decoder_layer_classes(model))
    for module in list(model.modules()):
        if isinstance(module, layer_classes):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model, "generate")
    return model
