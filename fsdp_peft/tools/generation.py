"""Generation from the (possibly still sharded) model, with prompts spread over the ranks.

Every rank takes its own slice of the prompts; rank 0 gathers the completions back into prompt order.

Under FSDP2, `parameters_gathered` all-gathers the units once before ``generate`` and keeps them whole
until it returns, instead of once per new token: up to a memory budget, in module order, so a model
that does not fit whole keeps as many units as fit and the rest gather per forward as in training.
When every unit is kept, ``generate`` issues no collective at all and each rank runs only its own
prompts; otherwise every rank joins every forward (``synced_gpus``) and a rank without prompts of its
own runs a placeholder. FSDP1 roots gather per forward (see `fsdp_peft.parallel.fsdp_policies.register_generate`).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from peft.tuners.lora.layer import LoraLayer
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

from fsdp_peft.core._compat.torch_patches import fsdp_param_groups
from fsdp_peft.core.distributed import gathered_from_every_rank
from fsdp_peft.core.log import logger
from fsdp_peft.core.run_file_names import EVAL_SAMPLES_FILE
from fsdp_peft.core.safetensors_io import parse_size
from fsdp_peft.core.xla import on_xla
from fsdp_peft.data.formats import Example
from fsdp_peft.data.templates import render_example_prompt
from fsdp_peft.model.compiled import eager_layers, four_bit_weight
from fsdp_peft.parallel.fsdp_layout import is_sharded
from fsdp_peft.tools.decoding import compiles_here, decoding_for_call


@dataclass(frozen=True)
class GenerationSettings:
    """How to generate: length, greedy or sampled, prompts per call, and the FSDP2 gather budget."""

    max_new_tokens: int = 32
    batch_size: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    gather_budget: str = "auto"
    ignore_eos: bool = False  # always generate max_new_tokens (benchmarks)
    stop_strings: tuple[str, ...] = ()  # also stop a completion once its text ends in one of these
    merged_adapter: bool = True  # LoRA merged into the weights for each call (`adapters_merged`)
    compiled: str = "auto"  # the decode step compiled over a static cache (`fsdp_peft.tools.decoding`)

    @classmethod
    def from_recipe(cls, recipe) -> GenerationSettings:
        return cls(
            recipe.generate_max_new_tokens,
            recipe.generate_batch_size,
            gather_budget=recipe.generate_gather_budget,
            merged_adapter=recipe.generate_merged_adapter,
            compiled=recipe.generate_compiled,
        )

    def sampling_kwargs(self) -> dict:
        if not self.do_sample:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": None}


def parse_gather_budget(text: str) -> int | None:
    """Bytes of gathered units ``generate`` may keep: ``None`` for all, 0 for none, else a size."""
    value = str(text).strip().lower()
    if value == "all":
        return None
    if value == "none":
        return 0
    if value == "auto":
        return _free_memory() // 2
    return parse_size(text, "generate_gather_budget")


def _free_memory() -> int:
    """Free memory on this rank's device: the accelerator's, else the host's available RAM."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    return psutil.virtual_memory().available


def _fsdp2_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def gathered_bytes(unit: torch.nn.Module) -> int:
    """Bytes an FSDP2 unit's own parameters take when gathered (global size × gather dtype)."""
    state = unit._get_fsdp_state()
    param_dtype = state._mp_policy.param_dtype
    return sum(
        p.sharded_param.numel() * (param_dtype or p.sharded_param.dtype).itemsize
        for group in fsdp_param_groups(state)
        for p in group.fsdp_params
    )


def _budget_agreed_by_all_ranks(budget: int | None) -> int | None:
    """The smallest budget over the ranks: every rank must keep the same units, or collectives mismatch."""
    finite = [b for b in gathered_from_every_rank(budget) if b is not None]
    return min(finite) if finite else None


@contextlib.contextmanager
def parameters_gathered(
    model: torch.nn.Module, budget: int | None, merged: bool = False, dequantized: bool = False
) -> Iterator[bool]:
    """Keep FSDP2 units gathered for the whole block, up to ``budget`` bytes; yields whether all are.

    Units are taken in module order (root, then layers in order) while they fit. On exit every kept unit
    is resharded and its ``reshard_after_forward`` setting restored. Collective: every rank must enter.
    Not an FSDP2 model: yields True when unsharded (nothing to gather), False for FSDP1.
    Within what is left of ``budget``: with ``dequantized`` (the compiled decode step, which needs it:
    `fsdp_peft.tools.decoding.compiles_here`) 4-bit layers compute with their weights dequantized once for the block
    (`four_bit_dequantized`), and with ``merged`` the LoRA adapter is merged into the weights (`adapters_merged`).
    """
    units = _fsdp2_units(model)
    if not units:
        with eager_layers(), four_bit_dequantized(model, budget) if dequantized else contextlib.nullcontext(0) as dense:
            left = None if budget is None else budget - dense
            with adapters_merged(model, left) if merged else contextlib.nullcontext():
                yield not is_sharded(model)
        return
    budget = _budget_agreed_by_all_ranks(budget)
    kept, used = [], 0
    for unit in units:
        size = gathered_bytes(unit)
        if budget is None or used + size <= budget:
            kept.append(unit)
            used += size
    saved = [_reshard_setting(unit) for unit in kept]
    try:
        for unit in kept:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        dequantizing = four_bit_dequantized(model, None if budget is None else budget - used, kept)
        with eager_layers(), dequantizing if dequantized else contextlib.nullcontext(0) as dense:
            left = None if budget is None else budget - used - dense
            with adapters_merged(model, left, kept) if merged else contextlib.nullcontext():
                yield len(kept) == len(units)
    finally:
        for unit, setting in zip(kept, saved):
            unit.reshard()
            _restore_reshard_setting(unit, setting)


@contextlib.contextmanager
def adapters_merged(model: torch.nn.Module, budget: int | None, kept: list | None = None) -> Iterator[int]:
    """The LoRA adapter merged into the base weights for the block, where that changes no weight beyond it; yields
    how many layers are merged.

    A layer computes ``x @ (W + s B A)ᵀ`` for the block instead of ``x @ Wᵀ + s (x @ Aᵀ) @ Bᵀ``: one matmul
    instead of three, equal up to rounding. A LoRA linear layer is merged when its adapter is plain LoRA (one active
    adapter, no variant such as DoRA, no LoRA bias), its dropout is inactive (eval mode, or ``lora_dropout: 0``), and
    its base is a full-precision ``nn.Linear`` whose weight is whole here:
    - under FSDP2, a unit ``kept`` gathered for the block (`parameters_gathered`): merged in place into the gathered
      copy, which resharding at its end drops (nothing to undo, no memory); a unit gathered before the block and not
      kept (a root, or ``reshard_after_forward: false`` after a forward) stays unmerged: it is not resharded after;
    - a model without FSDP: merged into a new tensor that stands in for the weight for the block, while the copies
      fit in ``budget`` bytes (``None``: no limit); the weight itself is back at exit, bit for bit. A frozen model's
      copies (`is_frozen`) are kept for its next calls and used again while their weight (`MadeFrom`) and adapter
      (name, scale and values) are what they were made from; they count against ``budget`` in each call as new ones
      do (a kept copy that no longer fits is dropped), so that the copies held never pass it.
    Units not gathered, FSDP1 (its weights gather per forward), XLA (its FSDP swaps weights in at each forward), a
    weight shared with another module (tied embeddings) and 4-bit layers stay unmerged. For the block a merged layer
    steps aside, its base in its place in the parent (unless the LoRA layer is an FSDP unit itself): the forward runs
    no adapter code, and a compiled step traces and guards the modules of a plain model; it is back at exit.
    """
    in_place = bool(_fsdp2_units(model))
    if on_xla() or (is_sharded(model) and not in_place):  # XLA, FSDP1
        yield 0
        return
    owned = {id(module) for unit in kept or () for module in _owned_modules(unit)}
    shared = _shared_parameters(model)
    frozen = not in_place and is_frozen(model)
    merged, replaced, unwrapped, used = [], [], [], 0
    try:
        for parent, name, layer in _child_slots(model):
            if not isinstance(layer, LoraLayer) or (adapter := _plain_adapter(layer)) is None:
                continue
            weight = layer.get_base_layer().weight
            if (in_place and id(layer) not in owned) or id(weight) in shared:
                continue
            if in_place:
                _add_delta(layer, adapter, weight.data, in_place=True)
            elif budget is None or used + weight.nbytes <= budget:  # kept copies count too: all held at once
                used += weight.nbytes
                replaced.append((weight, weight.data))
                weight.data = _merged_weight(layer, adapter, weight, keep=frozen)
            else:
                continue
            layer.merged_adapters.append(adapter)
            merged.append(layer)
            # its base computes alone, no adapter code in the forward (not a unit, nor a wrapper of a wrapper)
            if not isinstance(layer, FSDPModule) and layer.base_layer is layer.get_base_layer():
                parent.register_module(name, layer.base_layer)
                unwrapped.append((parent, name, layer))
        yield len(merged)
    finally:
        _put_back(unwrapped)
        _forget_merged_copies(model, but=merged if frozen else ())
        for layer in merged:  # peft's own unmerge would subtract: the gathered copies go at reshard instead
            layer.merged_adapters.clear()
        for weight, original in reversed(replaced):
            weight.data = original


def is_frozen(model: torch.nn.Module) -> bool:
    """Whether nothing trains ``model``: no parameter requires grad (``fsdp-peft generate`` and ``eval`` load so).
    Its generation calls keep the merged weights they make for the next calls (`adapters_merged`); a model in
    training keeps none: they would stay allocated through its training steps."""
    return not any(parameter.requires_grad for parameter in model.parameters())


@dataclass(frozen=True)
class MadeFrom:
    """The weight a kept copy was made from, as it was, held weakly (a kept copy does not keep an old weight alive):
    the parameter, its storage (a storage at the same address later is another object), its view and its version
    counter (an in-place change through the parameter bumps it; a write through ``.data`` bypasses it, as it bypasses
    autograd's own checks)."""

    parameter: weakref.ref
    storage: weakref.ref
    view: tuple
    version: int

    @classmethod
    def of(cls, weight: torch.Tensor) -> MadeFrom:
        return cls(weakref.ref(weight), weakref.ref(weight.untyped_storage()), _view(weight), weight._version)

    def is_now(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` is still the one it was: the same parameter, storage, view and version."""
        return (
            self.parameter() is weight
            and self.storage() is weight.untyped_storage()
            and _view(weight) == self.view
            and weight._version == self.version
        )


def _view(weight: torch.Tensor) -> tuple:
    return weight.storage_offset(), tuple(weight.shape), weight.stride(), weight.dtype, weight.device


@dataclass(frozen=True)
class _MergedCopy:
    """A LoRA layer's weight with its adapter merged (`adapters_merged`), and what it was made from: the weight as
    it was (`MadeFrom`), the adapter's name and scale, and its tensors' values."""

    weight: MadeFrom
    adapter: tuple[str, float]
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    merged: torch.Tensor

    def still_equal(self, layer, adapter: str, weight: torch.Tensor) -> bool:
        a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        return (
            self.weight.is_now(weight)
            and self.adapter == (adapter, layer.scaling[adapter])
            and _equal(self.lora_a, a)
            and _equal(self.lora_b, b)
        )


def _equal(kept: torch.Tensor, now: torch.Tensor) -> bool:
    """The same values, dtype and device (``torch.equal`` alone would compare across dtypes, and fail across
    devices)."""
    return kept.dtype == now.dtype and kept.device == now.device and torch.equal(kept, now)


_MERGED_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # LoRA layer -> its kept `_MergedCopy`


def _merged_weight(layer, adapter: str, weight: torch.Tensor, keep: bool) -> torch.Tensor:
    """``weight + s B A``: the copy kept from an earlier call where it still equals what a merge would make now (a
    stale one is dropped), else a new tensor, kept for later calls where ``keep``."""
    kept = _MERGED_COPIES.pop(layer, None)
    if kept is None or not kept.still_equal(layer, adapter, weight):
        merged = _add_delta(layer, adapter, weight.data)
        if not keep:
            return merged
        a, b = (tensor.weight.detach().clone() for tensor in (layer.lora_A[adapter], layer.lora_B[adapter]))
        kept = _MergedCopy(MadeFrom.of(weight), (adapter, layer.scaling[adapter]), a, b, merged)
    if keep:
        _MERGED_COPIES[layer] = kept
    return kept.merged


def _forget_merged_copies(model: torch.nn.Module, but: list | tuple = ()) -> None:
    """Drop the merged copies kept for ``model``'s layers, ``but`` those of the given layers."""
    if _MERGED_COPIES:
        keep = {id(layer) for layer in but}
        for module in model.modules():
            if id(module) not in keep:
                _MERGED_COPIES.pop(module, None)


@torch.no_grad()  # GRPO's rollouts gather outside TRL's no_grad: no autograd graph over the trainable adapter
def _add_delta(layer, adapter: str, weight: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``weight + s B A``: ``layer``'s adapter update added to ``weight`` (in place, else into a new tensor). One fused
    multiply-add where the adapter has the weight's dtype; else peft's delta, made in the adapter's dtype."""
    a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    if a.dtype == b.dtype == weight.dtype and not layer.fan_in_fan_out:
        scale = layer.scaling[adapter]
        return weight.addmm_(b, a, alpha=scale) if in_place else torch.addmm(weight, b, a, alpha=scale)
    delta = layer.get_delta_weight(adapter).to(weight.dtype)
    return weight.add_(delta) if in_place else weight + delta


@contextlib.contextmanager
def four_bit_dequantized(model: torch.nn.Module, budget: int | None, kept: list | None = None) -> Iterator[int]:
    """Each bitsandbytes 4-bit linear layer whose weight is whole here replaced, for the block, by a
    `DequantizedLinear` (an ``nn.Linear``) holding that weight dequantized once, while the copies fit in ``budget``
    bytes (``None``: no limit); yields the bytes they take. The originals are back at exit.

    A token step then reads 16-bit weights with one matmul a layer (and a compiled step can trace it), instead of
    dequantizing or running bitsandbytes' 4-bit kernel in every layer at every token. Equal to bitsandbytes' own
    forward, which dequantizes in the stored dtype and multiplies in the compute dtype, up to the rounding of its
    one-row kernel. Where a layer is whole, and where not, as for `adapters_merged`: FSDP2 units ``kept`` gathered
    for the block and models without FSDP; not FSDP1 or XLA. A layer whose compute dtype is not the model's (the
    input embedding's) stays 4-bit: its forward casts, a plain layer would not; so does one bitsandbytes has
    repacked for its CPU kernel.
    """
    bitsandbytes = sys.modules.get("bitsandbytes")
    fsdp2 = bool(_fsdp2_units(model))
    if bitsandbytes is None or on_xla() or (is_sharded(model) and not fsdp2):
        yield 0
        return
    owned = {id(module) for unit in kept or () for module in _owned_modules(unit)}
    dtype = model.get_input_embeddings().weight.dtype
    swapped, used = [], 0
    try:
        for parent, name, layer in _child_slots(model):
            if not isinstance(layer, bitsandbytes.nn.Linear4bit) or (fsdp2 and id(layer) not in owned):
                continue
            states = [getattr(layer, "quant_state", None), getattr(layer.weight, "quant_state", None)]
            if isinstance(layer.weight, DTensor) or states == [None, None] or any(_repacked(s) for s in states):
                continue
            size = layer.in_features * layer.out_features * dtype.itemsize
            if (layer.compute_dtype or dtype) != dtype or (budget is not None and used + size > budget):
                continue
            parent.register_module(name, _dense_copy(layer, dtype))  # the child swapped for the block
            swapped.append((parent, name, layer))
            used += size
        yield used
    finally:
        _put_back(swapped)


def _child_slots(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """Every ``(parent, name, child)`` in ``model``, listed before any is swapped (the swaps leave the list as is)."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]


def _put_back(swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]]) -> None:
    """Each ``(parent, name, child)`` slot given its original child again, the last swapped first."""
    for parent, name, child in reversed(swapped):
        parent.register_module(name, child)


def _repacked(state) -> bool:
    """Whether bitsandbytes has repacked a 4-bit weight for its AVX512-BF16 CPU kernel (its first eval forward on
    such a CPU does, in place): not the layout `four_bit_weight` dequantizes."""
    return bool(getattr(state, "packing_format_for_cpu", False))


class DequantizedLinear(torch.nn.Linear):
    """A 4-bit layer's weight dequantized for one generation call (`four_bit_dequantized`). Its own class so that the
    adapter stays unmerged on it (`adapters_merged` merges into plain ``nn.Linear`` only): merging would round the
    adapter's update into the 16-bit weight, where QLoRA computes it apart, as training did."""


def _dense_copy(layer: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Linear:
    """A plain linear layer computing what 4-bit ``layer`` computes, its weight dequantized in ``dtype``."""
    dense = DequantizedLinear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    dense.weight = torch.nn.Parameter(four_bit_weight(layer, dtype), requires_grad=False)
    if layer.bias is not None:
        dense.bias = torch.nn.Parameter(layer.bias.detach().to(dtype), requires_grad=False)
    return dense.train(layer.training)


def _owned_modules(unit: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose parameters FSDP2 unit ``unit`` manages: its subtree less the units nested in it."""
    owned, stack = [], [unit]
    while stack:
        module = stack.pop()
        owned.append(module)
        stack.extend(child for child in module.children() if not isinstance(child, FSDPModule))
    return owned


def _shared_parameters(model: torch.nn.Module) -> set[int]:
    """The ids of the parameters more than one module holds (tied weights)."""
    seen = Counter(id(parameter) for _, parameter in model.named_parameters(remove_duplicate=False))
    return {key for key, count in seen.items() if count > 1}


def _plain_adapter(layer) -> str | None:
    """The name of ``layer``'s adapter when `adapters_merged` may merge it, else None."""
    if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    adapter = layer.active_adapters[0]
    if adapter not in layer.lora_A or adapter in layer.lora_variant or layer.lora_bias[adapter]:
        return None
    dropout = layer.lora_dropout[adapter]
    if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0 and dropout.training:
        return None
    base = layer.get_base_layer()
    if type(base) is not torch.nn.Linear:  # bitsandbytes' 4-bit and 8-bit layers subclass it
        return None
    tensors = (base.weight, layer.lora_A[adapter].weight, layer.lora_B[adapter].weight)
    if any(isinstance(tensor, DTensor) for tensor in tensors):  # a shard: its unit is not gathered
        return None
    return adapter


def _reshard_setting(unit) -> tuple:
    # FSDP2 keeps reshard-after-forward as per-group mesh info; the root also has an "auto" flag.
    state = unit._get_fsdp_state()
    return state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in fsdp_param_groups(state)]


def _restore_reshard_setting(unit, setting: tuple) -> None:
    state = unit._get_fsdp_state()
    state._auto_reshard_after_forward, infos = setting
    for group, info in zip(fsdp_param_groups(state), infos):
        group.post_forward_mesh_info = info


@torch.no_grad()
def generate_completions(
    model,
    tokenizer,
    prompts: list,
    settings: GenerationSettings,
    device: torch.device,
    streamer=None,
    encode: Callable[[list], dict] | None = None,
) -> list[str] | None:
    """Completions for ``prompts``: the full list on rank 0, ``None`` on other ranks.

    ``streamer`` (a transformers streamer) receives rank 0's tokens as they are generated; it needs
    batches of one prompt. ``encode``: a batch of prompts to model inputs (default: ``tokenizer`` on texts; a
    vision-language model's processor on texts with images).
    """
    # the process group's ranks, the ones the gathers run over (`fsdp_peft.core.distributed.ranks`: the launcher's)
    rank, world = group_ranks()
    mine = list(range(rank, len(prompts), world))
    budget, dequantized = parse_gather_budget(settings.gather_budget), compiles_here(model, settings.compiled)
    with parameters_gathered(model, budget, settings.merged_adapter, dequantized) as whole:
        synced = world > 1 and not whole
        # Ranks in step run the same number of calls (a rank out of prompts still joins the forwards).
        calls = math.ceil(math.ceil(len(prompts) / world) / settings.batch_size) if synced else None
        own = [prompts[i] for i in mine]
        texts = complete_on_this_rank(
            model, tokenizer, own, settings, device, calls, prompts[0], streamer, encode, whole=whole
        )
    results = list(zip(mine, texts))
    if world == 1:
        return [text for _, text in sorted(results)]
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(results, gathered, dst=0)
    if rank != 0:
        return None
    return [text for _, text in sorted(pair for part in gathered for pair in part)]


def group_ranks() -> tuple[int, int]:
    """This process's rank and the world size of its process group (``(0, 1)`` without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def evaluation_mode(model, tokenizer) -> Iterator[None]:
    """The model in eval mode and the tokenizer padding on the left for the block; both restored after."""
    was_training, padding_side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    try:
        yield
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)


@torch.no_grad()
def complete_on_this_rank(
    model,
    tokenizer,
    prompts: list[str],
    settings: GenerationSettings,
    device: torch.device,
    calls: int | None = None,
    placeholder=None,
    streamer=None,
    encode: Callable[[list], dict] | None = None,
    whole: bool = False,
) -> list[str]:
    """This rank's completions of its own ``prompts``, in order, ``settings.batch_size`` per ``generate`` call.

    Called inside `parameters_gathered`. ``calls`` set means the ranks are kept in step (``synced_gpus``): run
    exactly that many calls, completing ``placeholder`` once the own prompts run out (their output dropped).
    ``whole``: every weight is whole on this rank for the calls, so the decode step may be compiled
    (`fsdp_peft.tools.decoding`).
    """
    rank, _ = group_ranks()
    count = calls if calls is not None else math.ceil(len(prompts) / settings.batch_size)
    completions: list[str] = []
    stop = list(settings.stop_strings) or None
    with evaluation_mode(model, tokenizer):
        for index in range(count):
            texts = prompts[index * settings.batch_size : (index + 1) * settings.batch_size]
            batch = texts or [placeholder]
            if encode is None:
                encoded = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
            else:
                encoded = encode(batch)
            encoded = {key: value.to(device) for key, value in encoded.items()}
            length = encoded["input_ids"].shape[1]
            rows = encoded["input_ids"].shape[0]
            with decode_step(model, settings.compiled, whole, length, settings.max_new_tokens, rows) as decoding:
                output = model.generate(
                    **encoded,
                    max_new_tokens=settings.max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    min_new_tokens=settings.max_new_tokens if settings.ignore_eos else None,
                    synced_gpus=calls is not None,
                    streamer=streamer if rank == 0 else None,
                    stop_strings=stop,
                    tokenizer=tokenizer if stop else None,
                    **settings.sampling_kwargs(),
                    **decoding,
                )
            new_tokens = output[:, length:]
            completions += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)[: len(texts)]
    return completions


@contextlib.contextmanager
def decode_step(
    model, setting: str, whole: bool, prompt_length: int, max_new_tokens: int, rows: int = 1
) -> Iterator[dict]:
    """``generate``'s keyword arguments for the decode step of one call over ``rows`` prompts ``prompt_length``
    tokens long (padded), inside `parameters_gathered` (``whole``: what it yielded): compiled over a static cache
    where `fsdp_peft.tools.decoding` finds nothing against it, with the FSDP2 units' forward hooks set aside for the
    call; else none (eager). ``setting``: ``generate_compiled``."""
    decoding = decoding_for_call(model, setting, whole, prompt_length, max_new_tokens, rows)
    with decoding.around_the_call(model, _fsdp2_units(model)):
        yield decoding.kwargs


def evaluate_exact_match(
    model, tokenizer, examples: list[Example], recipe, device: torch.device, samples_path: Path | None = None
) -> float | None:
    """Exact-match accuracy of greedy completions on ``examples`` (rank 0; ``None`` elsewhere).

    With ``samples_path``, rank 0 also writes one JSON line per example: prompt, expected, generated.
    """
    completions = _complete(model, tokenizer, examples, recipe, device)
    if completions is None:
        return None
    records = [_sample_row(example, completion) for example, completion in zip(examples, completions)]
    return exact_match_of(records, samples_path)


def exact_match_of(records: list[dict], samples_path: Path | None = None) -> float:
    """The share of ``records`` (``expected`` and ``generated`` among their keys) whose completion is the expected
    one, stripped; with ``samples_path``, each record with its ``exact`` written there as a JSON line."""
    hits = [record["generated"].strip() == record["expected"].strip() for record in records]
    if samples_path is not None:
        with open(samples_path, "w") as handle:
            handle.writelines(json.dumps(record | {"exact": hit}) + "\n" for record, hit in zip(records, hits))
    return sum(hits) / len(hits)


def _complete(model, tokenizer, examples: list[Example], recipe, device: torch.device) -> list[str] | None:
    prompts = [render_example_prompt(tokenizer, e, recipe.use_chat_template) for e in examples]
    return generate_completions(model, tokenizer, prompts, GenerationSettings.from_recipe(recipe), device)


def _sample_row(example: Example, completion: str) -> dict:
    return {"prompt": example.prompt, "expected": example.completion, "generated": completion}


class SamplesAtEvaluation(TrainerCallback):
    """At each evaluation, completes ``examples`` on the sharded model and shows them (rank 0).

    They are printed and appended to ``output_dir/eval_samples.jsonl`` with the step, so a run's progress
    can be read as text, not only as a loss.
    """

    def __init__(self, tokenizer, examples: list[Example], recipe):
        self.tokenizer, self.examples, self.recipe = tokenizer, examples, recipe

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        if not self.examples:
            return
        completions = _complete(model, self.tokenizer, self.examples, self.recipe, args.device)
        if completions is None:
            return
        lines = [f"samples at step {state.global_step}:"]
        with open(Path(args.output_dir) / EVAL_SAMPLES_FILE, "a") as handle:
            for example, completion in zip(self.examples, completions):
                handle.write(json.dumps({"step": state.global_step, **_sample_row(example, completion)}) + "\n")
                lines.append(f"  {example.prompt!r} -> {completion!r} (expected {example.completion!r})")
        logger.info("\n".join(lines))
