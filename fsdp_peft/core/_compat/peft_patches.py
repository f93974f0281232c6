"""peft's adapters: created off meta, DoRA without autograd, trainable tokens through the base layer, wrapping."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch

from fsdp_peft.core._compat.registry import _source_of, patch
from fsdp_peft.core._compat.transformers_patches import checkpointing_alias_quiet


@patch("peft")
@contextlib.contextmanager
def adapters_created_off_meta():
    """Replaces peft's ``BaseTunerLayer._move_adapter_to_device_of_base_layer`` and ``LoraModel._replace_module``
    while adapters are attached to a low-memory skeleton (meta base weights), so LoRA weights stay on the CPU.

    Why: peft moves new adapter weights to the base layer's device, for a skeleton the meta device, which drops
    their initial values. Creation, initialisation and dtype casts are unchanged, so they draw the same random
    numbers and give the same values as on a loaded model; only the final moves to meta are undone. Trainable
    tokens copy their rows out of the (meta) base weight: they become empty CPU tensors, filled by the loader.
    Only entered for skeleton models (`fsdp_peft.model.modeling.attach_lora`); a loaded model never sees it.
    Remove when: peft keeps the adapters of meta base layers materialised.
    """
    from peft.tuners.lora.model import LoraModel  # lazy: patch target, resolved when patched
    from peft.tuners.tuners_utils import BaseTunerLayer  # lazy: patch target, resolved when patched

    original_move = BaseTunerLayer._move_adapter_to_device_of_base_layer
    original_replace = LoraModel._replace_module

    def move(self, adapter_name, device=None):
        base_device, _ = self._get_base_layer_device_and_dtype(self.get_base_layer())
        if device is None and base_device is not None and base_device.type == "meta":
            device = torch.device("cpu")
            _adapter_tensors_off_meta(self, adapter_name)
        return original_move(self, adapter_name, device=device)

    def replace(self, parent, child_name, new_module, child):
        kept = [(m, n, p) for m in new_module.modules() for n, p in m.named_parameters(recurse=False) if not p.is_meta]
        original_replace(self, parent, child_name, new_module, child)
        for module, name, parameter in kept:
            if getattr(module, name).is_meta:
                module._parameters[name] = parameter

    BaseTunerLayer._move_adapter_to_device_of_base_layer = move
    LoraModel._replace_module = replace
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = original_move
        LoraModel._replace_module = original_replace


def _adapter_tensors_off_meta(layer, adapter_name: str) -> None:
    """Adapter tensors peft copied out of meta base weights (trainable tokens: the base rows) become empty CPU
    tensors of their shape; the low-memory loader fills them (`fsdp_peft.model.loading.load_sharded_weights`)."""
    for attribute in (*layer.adapter_layer_names, *layer.other_param_names):
        container = getattr(layer, attribute, None)
        if not isinstance(container, torch.nn.Module) or adapter_name not in container:
            continue
        value = container[adapter_name]
        if isinstance(value, torch.Tensor) and value.is_meta:
            empty = torch.empty_like(value, device="cpu")
            trainable = isinstance(value, torch.nn.Parameter)
            container[adapter_name] = torch.nn.Parameter(empty, value.requires_grad) if trainable else empty


@patch("peft")
def dora_lora_weight_without_graph(model: torch.nn.Module) -> int:
    """Replaces ``get_lora_weight`` of every DoRA linear layer of ``model`` (on the instance) by the same
    computation under ``torch.no_grad()``; returns how many.

    Why: DoRA's forward computes ``B @ A`` by calling the ``lora_A``/``lora_B`` modules on an identity matrix,
    only to take the weight norm of ``W + scale * B @ A`` detached. Under FSDP1 those modules are units of their
    own, so each is run twice per forward with autograd on; with bf16/fp16 mixed precision FSDP1 then hands
    AdamW unreduced, full-size low-precision gradients (docs/compat.md#the-measurements). Without autograd the second
    call builds no graph and registers no backward hooks; every value is the same (the result is used detached).
    Upstream: peft 0.21 ``DoraLinearLayer.get_lora_weight`` / ``forward`` (``lora_weight.detach()``).
    Remove when: peft computes DoRA's detached LoRA weight without autograd.
    """
    from peft.tuners.lora.dora import DoraLinearLayer  # lazy: patch target, resolved when patched

    patched = 0
    for module in model.modules():
        if type(module) is DoraLinearLayer:  # not the embedding/conv subclasses, whose weight may carry grad
            module.get_lora_weight = _without_grad(module.get_lora_weight)
            patched += 1
    return patched


@patch("peft")
def trainable_tokens_through_the_base_layer(model: torch.nn.Module) -> int:
    """Replaces ``forward_adapters`` of every trainable-token layer of ``model`` (on the instance) by one that
    calls the frozen embedding (or untied output head) and puts the trained rows over its output; returns how many.

    Why: peft's forward reads ``base_layer.weight`` directly (``index_copy`` of the trained rows into it, then
    ``F.embedding``, or ``F.linear`` for a head) and never calls the base layer. Under FSDP1 (flat parameters)
    the trained rows and the frozen weight cannot share a unit, and a unit whose module is not called is never
    gathered, so the read found a freed shard. Here the base layer is called (its unit gathers) and the trained
    tokens' rows come from the delta: the same values (rows copied, in the weight's dtype; a head's trained
    columns of the output are ``x @ delta.T``) and the same gradients (each trained row gets the sum over its
    positions). peft's own path still serves a disabled or merged layer, a ``max_norm``/``scale_grad_by_freq``/
    ``sparse`` embedding and a head with a bias (peft's ``F.linear`` leaves the bias out).
    Upstream: peft 0.21 ``TrainableTokensLayer.forward_adapters`` / ``get_merged_weights``.
    Remove when: peft's trainable tokens call the base layer.
    """
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer  # lazy: patch target, resolved when patched

    patched = 0
    for module in model.modules():
        if type(module) is TrainableTokensLayer and isinstance(module.base_layer, torch.nn.Embedding):
            module.forward_adapters = functools.partial(_trained_rows_over_the_base_output, module)
            patched += 1
        elif type(module) is TrainableTokensLayer and isinstance(module.base_layer, torch.nn.Linear):
            module.forward_adapters = functools.partial(_trained_columns_over_the_head_output, module)
            patched += 1
    return patched


def _peft_path_serves(layer, active_adapters, head: bool) -> bool:
    base = layer.base_layer  # under FSDP1 the unit around the embedding or head: attributes are the module's
    if layer.disable_adapters or not active_adapters or layer.merged:
        return True
    if head:
        return base.bias is not None
    return base.max_norm is not None or base.scale_grad_by_freq or base.sparse


def _trained_rows_over_the_base_output(layer, x: torch.Tensor, active_adapters, *args, **kwargs) -> torch.Tensor:
    base = layer.base_layer
    if _peft_path_serves(layer, active_adapters, head=False):
        return type(layer).forward_adapters(layer, x, active_adapters, *args, **kwargs)
    layer._check_overlapping_tokens(active_adapters)
    result = base(x)  # called: FSDP1 gathers the frozen embedding's unit
    embed_scale = layer._get_embed_scale()
    for adapter in active_adapters:
        indices = torch.tensor(layer.token_indices[adapter], device=x.device)
        slots = torch.full((base.num_embeddings,), -1, dtype=torch.long, device=x.device)
        slots[indices] = torch.arange(len(indices), device=x.device)  # trained row of each token id, or -1
        slot = slots[x]
        padding = base.padding_idx
        padding_slot = int(slots[padding]) if padding is not None and int(slots[padding]) >= 0 else None
        rows = torch.nn.functional.embedding(
            slot.clamp(min=0), layer.trainable_tokens_delta[adapter].to(result), padding_idx=padding_slot
        )
        if embed_scale is not None:
            rows = rows * embed_scale.to(rows.dtype)
        result = torch.where((slot >= 0).unsqueeze(-1), rows, result)
    return result


def _trained_columns_over_the_head_output(layer, x: torch.Tensor, active_adapters, *args, **kwargs) -> torch.Tensor:
    if _peft_path_serves(layer, active_adapters, head=True):
        return type(layer).forward_adapters(layer, x, active_adapters, *args, **kwargs)
    layer._check_overlapping_tokens(active_adapters)
    result = layer.base_layer(x)  # called: FSDP1 gathers the frozen head's unit
    for adapter in active_adapters:
        indices = torch.tensor(layer.token_indices[adapter], device=x.device)
        columns = torch.nn.functional.linear(x, layer.trainable_tokens_delta[adapter].to(result.dtype))
        result = result.index_copy(-1, indices, columns)
    return result


def _without_grad(function: Callable) -> Callable:
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with torch.no_grad():
            return function(*args, **kwargs)

    return wrapper


@patch(
    "peft",
    still_needed=lambda: "is_gradient_checkpointing" in _source_of("peft.peft_model:PeftModel.__init__"),
)
def peft_wrapped(model: torch.nn.Module, config, **kwargs):
    """peft's ``get_peft_model(model, config, **kwargs)`` without the one FutureWarning it raises on every run.

    Why: transformers 5.24 renamed ``is_gradient_checkpointing`` to ``is_activation_checkpointing`` and warns
    on the old name; peft 0.21's ``PeftModel.__init__`` reads the old one, so every run printed
    "`is_gradient_checkpointing` is deprecated" once per rank, a warning no user can act on.
    Only that warning is silenced, only here; `UPSTREAM` checks that peft still reads the old name.
    Remove when: peft reads ``is_activation_checkpointing``.
    """
    from peft import get_peft_model  # lazy: every command imports _compat; peft (and bitsandbytes) only model builders

    with checkpointing_alias_quiet():
        return get_peft_model(model, config, **kwargs)
