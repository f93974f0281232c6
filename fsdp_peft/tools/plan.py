"""Memory plan of a recipe config: per-GPU and host bytes, from the model config alone (no weights).

`plan_memory` builds the model on the meta device from its config, attaches the recipe's LoRA adapters
there, and counts, for the largest rank:

- **exact from the config** (checked against `fsdp_peft.procedures.memory`'s measured ``memory.json``): the base
  weight shard in its storage dtype (QLoRA: decoder-layer linears packed 4 bits per value into
  ``bnb_4bit_quant_storage`` elements, embeddings, norms and head in ``torch_dtype``), the adapter shard
  (fp32 master weights under bf16/fp16 mixed precision, else ``torch_dtype``), gradients (trainable
  only) and optimizer states, all sharded by FSDP on dim 0 (ceil division: rank 0 holds the largest
  chunk); plus the 4-bit quantization constants, which stay whole on every rank.
- **estimates**: FSDP units gathered at the peak, activations (formula in `activation_bytes`), CUDA
  context, and host RAM while loading.

The verdict names the switches that would make a config fit and what each saves.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig

from fsdp_peft.core import distributed
from fsdp_peft.core._compat.peft_patches import peft_wrapped
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.safetensors_io import parse_size
from fsdp_peft.core.xla import DEVICE_VARIABLE, on_xla, xla_assumed, xla_plan
from fsdp_peft.model.attention import chosen_attention
from fsdp_peft.model.kernels import liger_chunk_tokens, liger_requested
from fsdp_peft.model.loss import ON_XLA, chunked_loss_unavailable
from fsdp_peft.model.modeling import load_tokenizer, lora_config
from fsdp_peft.model.moe import EXPERTS_MODULE, expert_count, expert_width, experts_per_token
from fsdp_peft.model.moe_quantization import layout_for
from fsdp_peft.model.new_tokens import grow_vocabulary
from fsdp_peft.model.paths import known_model_config, resolve_model_path
from fsdp_peft.model.variants import stored_weight
from fsdp_peft.model.vision import auto_model_class, is_vision_config, quantization_skip_modules
from fsdp_peft.parallel.fsdp_policies import decoder_layer_classes, fsdp1_wrap_policy
from fsdp_peft.settings.checkpointing import (
    AUTO,
    CHECKPOINTING_KEYS,
    KWARGS_KEYS,
    MARGIN,
    NONE,
    Checkpointing,
    CheckpointingChoice,
    candidates,
    checkpoint_kwargs,
    every,
    requested,
)
from fsdp_peft.settings.config import resolve_recipe_config
from fsdp_peft.settings.families import family_of_model
from fsdp_peft.settings.four_bit import BLOCKSIZE, NESTED_BLOCKSIZE, FourBit
from fsdp_peft.settings.fsdp_settings import asks_for_xla, fsdp_settings, mixed_precision_dtype, trainer_fsdp_arguments
from fsdp_peft.settings.keys import check_keys

GIB = 2**30
# text model types whose attention norms q and k per head (q_norm, k_norm) before the rotary embedding
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_vl_text", "qwen3_vl_moe_text", "gemma3_text")
# text model types with a norm after attention and after the MLP too: four a layer, each keeping its fp32 input
FOUR_NORM_MODEL_TYPES = ("gemma2", "gemma3_text")
# TRL 1.16's fused log-prob head, which its DPO and KTO trainers use: one projection tile of at most this many
# tokens x vocabulary columns in the compute dtype (trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE and
# trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE; tests/tools/test_plan.py checks them against the installed TRL).
TRL_TOKEN_TILE = 4096
TRL_VOCAB_TILE = 32768
CUDA_CONTEXT_BYTES = GIB  # estimate: CUDA context, cuBLAS workspaces, allocator slack (not in torch's count)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_LIKE = ("adamw", "adam", "lamb", "adan", "ademamix")
RESIDENT_ROWS = ("base weights (shard)", "adapter weights (shard)", "gradients (shard)", "optimizer states (shard)")


@dataclass
class ModelCounts:
    """Per-rank (largest rank) storage of the model's parameters, from a meta-device copy."""

    base_parameters: int = 0  # elements in the full model
    adapter_parameters: int = 0
    adapter_tensors: int = 0
    base_bytes: int = 0  # this rank's shard
    adapter_bytes: int = 0
    quantization_constant_bytes: int = 0  # QLoRA: not sharded
    layer_gathered_bytes: int = 0  # one decoder layer as FSDP gathers it
    largest_other_unit_gathered_bytes: int = 0  # embeddings or head
    largest_linear_numel: int = 0
    linear_weight_bytes: int = 0  # this rank's shard of the decoder-layer linear weights, unquantized
    quantized_linear_parameters: int = 0  # QLoRA: elements of the 4-bit linear weights in the full model
    expert_bytes: int = 0  # a mixture of experts: this rank's shard of the expert weights (4-bit rows for QLoRA)
    largest_expert_numel: int = 0  # one expert parameter of one layer, all experts ([experts, out, in])
    expert_parameters: int = 0  # elements of every expert weight in the full model
    layer_adapter_ranks: int = 0  # one decoder layer's LoRA ranks added up (each adapter saves x·Aᵀ for backward)


@dataclass
class MemoryPlan:
    """The plan: inputs, per-GPU components (bytes), host RAM, verdict and suggestions."""

    config: str
    model: str
    world_size: int
    gpu_memory_bytes: int
    fsdp: str
    mixed_precision: str | None
    load_in_4bit: bool
    tokens_per_rank: int
    checkpointing: Checkpointing  # what the config asks for, or under auto what the plan chose
    offload_params: bool
    optimizer: str
    counts: ModelCounts
    preference: bool = False  # DPO/KTO/GRPO: log-probs from TRL's fused head, not the SFT loss
    gpu: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    suggestions: list[dict] = field(default_factory=list)
    longest_sequence: int | None = None  # SFT: the longest max_seq_length that fits, all else as planned
    gpu_loading: int = 0  # ordinary loading: each GPU holds the whole model before FSDP shards it (`loading_bytes`)
    low_memory_loading: bool = False  # fsdp_cpu_ram_efficient_loading: rank 0 reads, each GPU receives its shards
    checkpointable_layers: int = 0  # the decoder layers activation checkpointing chooses among
    checkpointing_choices: list[dict] = field(default_factory=list)  # under auto: each candidate and its peak
    checkpointing_reason: str = ""  # why these layers: the config, or the plan's choice under auto
    rollouts_dequantized: bool | None = None  # QLoRA rollouts: 4-bit layers dequantized for each call (None: no such)
    rollouts_reason: str = ""  # why: generate_compiled, or the plan's choice under auto

    @property
    def activation_checkpointing(self) -> bool:
        return self.checkpointing.count > 0

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def gpu_peak(self) -> int:
        """The most a GPU holds: while training, or while loading where that is more."""
        return max(self.gpu_total, self.gpu_loading)

    @property
    def parameter_gradient_optimizer_bytes(self) -> int:
        """Exact part: what `fsdp_peft.procedures.memory.MemoryReport` measures as parameters + gradients +
        optimizer."""
        return sum(self.gpu[row] for row in RESIDENT_ROWS)

    @property
    def fits(self) -> bool:
        return self.gpu_peak <= self.gpu_memory_bytes

    def to_json(self) -> dict:
        values = asdict(self)
        values.update(
            gpu_total=self.gpu_total,
            gpu_peak=self.gpu_peak,
            fits=self.fits,
            parameter_gradient_optimizer_bytes=self.parameter_gradient_optimizer_bytes,
            activation_checkpointing=self.activation_checkpointing,
            checkpointed_layers=self.checkpointing.count,
            verdict=verdict(self),
        )
        return values


def storage_dtype_bytes(recipe, mixed_precision: str | None) -> tuple[int, int]:
    """Bytes per element of frozen base weights and of trainable adapter weights."""
    base = DTYPE_BYTES[recipe.torch_dtype]
    adapter = 4 if mixed_precision else base  # `fsdp_peft.model.modeling.attach_lora`: fp32 masters under autocast
    return base, adapter


def shard_numel(shape: tuple[int, ...], world_size: int) -> int:
    """Elements of the largest FSDP2 shard: dim 0 split in chunks of ceil(dim0 / world size)."""
    if not shape:
        return 1
    rows = math.ceil(shape[0] / world_size)
    return rows * math.prod(shape[1:])


def packed_4bit_shape(numel: int, storage_bytes: int) -> tuple[int, int]:
    """Shape bitsandbytes gives a 4-bit weight: two values per byte, packed into ``storage_bytes`` elements."""
    return (math.ceil((numel + 1) // 2 / storage_bytes), 1)


def expert_rows_shape(parameter, four_bit: FourBit | None) -> tuple[int, ...]:
    """How an expert parameter ``[experts, out, in]`` is stored: as is, or (QLoRA) as one row of 4-bit bytes and
    quantization constants per expert (`fsdp_peft.model.moe_quantization.ExpertLayout`)."""
    if four_bit is None:
        return tuple(parameter.shape)
    return (parameter.shape[0], layout_for(parameter.shape, four_bit).row_bytes // four_bit.storage.itemsize)


def estimated_quantization_constant_bytes(numel: int, four_bit: FourBit) -> int:
    """bitsandbytes ``quant_state`` of one 4-bit weight: absmax per block (+ nested constants), code, offset."""
    blocks = math.ceil(numel / BLOCKSIZE)
    code = 16 * 4  # the 16 values of the nf4 or fp4 code, in fp32
    if not four_bit.double_quant:
        return blocks * 4 + code
    nested_blocks = math.ceil(blocks / NESTED_BLOCKSIZE)
    return blocks + nested_blocks * 4 + code + 256 * 4 + 4  # uint8 absmax, fp32 nested absmax, nested code, offset


def meta_peft_model(model_config, recipe):
    """The model with the recipe's LoRA adapters, on the meta device: shapes without memory."""
    with torch.device("meta"):
        model = auto_model_class(model_config).from_config(model_config, trust_remote_code=recipe.trust_remote_code)
        if recipe.new_special_tokens:  # the grown embedding and head (and logits), their new rows trained
            grow_vocabulary(model, load_tokenizer(recipe), recipe)
            model_config.get_text_config().vocab_size = model.get_input_embeddings().weight.shape[0]
        return peft_wrapped(model, lora_config(recipe, model, shapes_only=True))


def fsdp1_flat_parameters(
    peft_model, layer_classes: set[type], head_in_root: bool = False
) -> list[list[torch.nn.Parameter]]:
    """The tensors FSDP1 flattens together, one list per unit (`fsdp_peft.parallel.fsdp_policies.fsdp1_wrap_policy`, the
    root unit holding what no other unit does): each tensor belongs to the smallest unit around it."""
    policy = fsdp1_wrap_policy(peft_model, layer_classes, head_in_root)
    units = [peft_model] + [
        m for m in peft_model.modules() if m is not peft_model and policy(module=m, recurse=False, nonwrapped_numel=0)
    ]
    held = [{id(p): p for p in unit.parameters()} for unit in units]  # nested units hold subsets
    flat: dict[int, list] = {}
    for parameter in peft_model.parameters():
        owner = min((i for i, tensors in enumerate(held) if id(parameter) in tensors), key=lambda i: len(held[i]))
        flat.setdefault(owner, []).append(parameter)
    return list(flat.values())


def adapter_ranks(layer: torch.nn.Module) -> int:
    """The ranks of the LoRA adapters on ``layer``'s linear modules, added up."""
    return sum(
        adapter.out_features
        for module in layer.modules()
        if isinstance(getattr(module, "base_layer", None), torch.nn.Linear)
        for adapter in getattr(module, "lora_A", {}).values()
    )


def count_model(
    peft_model,
    recipe,
    world_size: int,
    mixed_precision: str | None,
    gather_bytes: int,
    fsdp_version: int = 2,
    head_in_root: bool = False,  # FSDP1 under TRL's trainers (fsdp_peft.parallel.fsdp_policies.fsdp1_wrap_policy)
) -> ModelCounts:
    """Per-rank bytes of every parameter of ``peft_model`` (meta), as the recipe would store them: FSDP2 splits
    each tensor's dim 0 (`shard_numel`), FSDP1 each unit's flat parameter evenly (`fsdp1_flat_parameters`)."""
    base_bytes, adapter_bytes = storage_dtype_bytes(recipe, mixed_precision)
    four_bit = FourBit.of(recipe)
    storage_bytes = four_bit.storage.itemsize if four_bit else 1
    inner = peft_model.get_base_model()
    head = inner.get_output_embeddings()
    head_weight = stored_weight(head)
    layer_classes = tuple(decoder_layer_classes(inner))  # once: it walks the whole model
    layers = [m for m in inner.modules() if isinstance(m, layer_classes)]
    counts = ModelCounts()
    counts.layer_adapter_ranks = max((adapter_ranks(layer) for layer in layers), default=0)
    linear: set[int] = set()  # transformers' bnb quantizer converts every nn.Linear except the output head
    kept = tuple(f"{name}." for name in quantization_skip_modules(family_of_model(inner)) or ())  # a VLM's tower
    for name, module in inner.named_modules():
        if isinstance(module, torch.nn.Linear) and module.weight is not head_weight and not module.weight.requires_grad:
            if f"{name}.".startswith(kept):
                continue  # 16-bit under QLoRA (`fsdp_peft.model.vision`)
            linear.add(id(module.weight))
            counts.largest_linear_numel = max(counts.largest_linear_numel, module.weight.numel())
            counts.linear_weight_bytes += shard_numel(tuple(module.weight.shape), world_size) * base_bytes
    quantized = linear if four_bit else set()
    # a mixture of experts' 3D expert weights; QLoRA stores them as rows of 4-bit bytes
    # (fsdp_peft.model.moe_quantization)
    experts = {id(p): p for n, p in peft_model.named_parameters() if p.ndim == 3 and f".{EXPERTS_MODULE}." in n}
    stored_shape = {key: expert_rows_shape(p, four_bit) for key, p in experts.items()}
    for parameter in peft_model.parameters():
        if id(parameter) in experts:
            counts.base_parameters += parameter.numel()
            counts.largest_expert_numel = max(counts.largest_expert_numel, parameter.numel())
            counts.expert_parameters += parameter.numel()
            element = storage_bytes if four_bit else base_bytes
            counts.expert_bytes += shard_numel(stored_shape[id(parameter)], world_size) * element
            counts.base_bytes += shard_numel(stored_shape[id(parameter)], world_size) * element
        elif parameter.requires_grad:
            counts.adapter_parameters += parameter.numel()
            counts.adapter_tensors += 1
            counts.adapter_bytes += shard_numel(tuple(parameter.shape), world_size) * adapter_bytes
        elif id(parameter) in quantized:
            counts.base_parameters += parameter.numel()
            counts.quantized_linear_parameters += parameter.numel()
            shape = packed_4bit_shape(parameter.numel(), storage_bytes)
            counts.base_bytes += shard_numel(shape, world_size) * storage_bytes
            counts.quantization_constant_bytes += estimated_quantization_constant_bytes(parameter.numel(), four_bit)
        else:
            counts.base_parameters += parameter.numel()
            counts.base_bytes += shard_numel(tuple(parameter.shape), world_size) * base_bytes
    if fsdp_version == 1 and world_size > 1:  # one flat parameter per unit, padded to a multiple of the ranks
        counts.adapter_bytes = counts.base_bytes = counts.adapter_tensors = 0
        for tensors in fsdp1_flat_parameters(peft_model, set(decoder_layer_classes(inner)), head_in_root):
            numel = sum(
                math.prod(packed_4bit_shape(p.numel(), storage_bytes))
                if id(p) in quantized
                else math.prod(stored_shape.get(id(p), p.shape))
                for p in tensors
            )
            if tensors[0].requires_grad:  # the policy keeps trainable and frozen tensors in separate units
                counts.adapter_bytes += math.ceil(numel / world_size) * adapter_bytes
                counts.adapter_tensors += 1
            else:
                counts.base_bytes += math.ceil(numel / world_size) * base_bytes
    if layers:
        counts.layer_gathered_bytes = sum(
            math.ceil(p.numel() / 2)
            if id(p) in quantized
            else math.prod(stored_shape[id(p)]) * storage_bytes
            if id(p) in experts and recipe.load_in_4bit
            else p.numel() * gather_bytes
            for p in layers[0].parameters()
        )
    others = [m for m in (inner.get_input_embeddings(), head) if m is not None]
    counts.largest_other_unit_gathered_bytes = max((stored_weight(m).numel() * gather_bytes for m in others), default=0)
    return counts


def estimated_optimizer_state_bytes(
    optim: str, adapter_shard_bytes: int, adapter_tensors: int
) -> tuple[int, str | None]:
    """Optimizer states for the trainable shard, and a note when the figure is only an estimate."""
    name = optim.lower()
    if name.startswith("sgd"):
        return 0, None  # Trainer's SGD has no momentum: no state tensors
    if "8bit" in name:
        return adapter_shard_bytes // 2, f"optim: {optim}: 8-bit states estimated at 2 bytes per fp32 value"
    if "lion" in name:
        return adapter_shard_bytes + adapter_tensors * 4, None
    if "adafactor" in name:
        return adapter_shard_bytes // 4, f"optim: {optim}: factored states estimated at a quarter of the weights"
    note = None if any(name.startswith(a) for a in ADAM_LIKE) else f"optim: {optim}: assumed Adam-like (two states)"
    return 2 * adapter_shard_bytes + adapter_tensors * 4, note  # two moments + a 4-byte step per tensor


def activation_bytes(
    model_config,
    recipe,
    tokens: int,
    compute_bytes: int,
    checkpointing: Checkpointing,
    chunk_tokens: int | None = None,
    adapter_ranks: int = 0,
) -> int:
    """The activations row: their peak on one rank (`activation_peak_and_saved`)."""
    figures = activation_peak_and_saved(
        model_config, recipe, tokens, compute_bytes, checkpointing, chunk_tokens, adapter_ranks
    )
    return figures[0]


def activation_peak_and_saved(
    model_config,
    recipe,
    tokens: int,
    compute_bytes: int,
    checkpointing: Checkpointing,
    chunk_tokens: int | None = None,
    adapter_ranks: int = 0,
) -> tuple[int, int]:
    """Estimated activations saved for backward on one rank (memory-efficient attention, no seq² term).

    Per decoder layer per token (Llama-style: RMSNorm, attention with ``kv`` = KV width, SwiGLU MLP of
    width ``i``, LoRA on the linear layers): ``c·(4h + 2kv + 4i) + 8h`` bytes (``c`` = compute dtype bytes: q, the
    attention output, o_proj's and the MLP's inputs, k and v, the MLP's gate, up, activation and product, and both
    norms' inputs in fp32, their upcasts; a mixture of experts, top-``k`` of ``E`` experts of width ``I``:
    ``c·(k·(3I + h) + 4E)`` in place of ``c·4i``, plus ``c·k·(I + h)`` when its experts are adapted; q and k normed
    per head (Qwen3, Gemma 3): ``4·(q + kv)`` more; four norms a layer (Gemma 2 and 3): ``8h`` more), plus ``c·d`` +
    ``d`` bytes per adapted input of width ``d`` when lora_dropout > 0 (a mixture of experts: attention's four), plus
    ``c·r`` per adapter of rank ``r`` (its ``x·Aᵀ``; ``adapter_ranks``: a layer's ranks added up, `ModelCounts`);
    and ``c·h`` for the final norm's input; with ``sequence_parallel_size`` > 1 (``tokens``: the rank's 1/N of each
    row), ``c·h`` more per layer (`benchmarks/sequence_parallel.py`: within 1%). `benchmarks/activations.py`
    measures these against autograd's saved tensors (body within 1%, fp32), and `tests/tools/test_plan.py` every
    embedded family in bf16, 16- and 4-bit (Gemma 3 9% below: its attention's mask and two more head-shaped copies
    are not counted). A checkpointed layer (``checkpointing``: k
    of the n decoder layers, every m-th from layer 0) keeps only its input (``c·h``; nothing on the device when
    offloaded). Returns ``(peak, saved)``: ``saved`` is what the forward leaves for backward; backward frees each
    layer's activations as it passes it, so the peak is the larger of ``saved`` and the moment the topmost
    checkpointed layer is recomputed (everything below it, its input back on the device, and its whole layer).
    Logits, saved: the fp32 log-softmax, ``tokens x vocab x 4``; the head output, its fp32 upcast and the
    gradient are transient (`loss_logits_bytes`). With the chunked loss (``loss_chunk_tokens`` > 0,
    `fsdp_peft.model.loss`) the saved part is ``tokens x (c·h + 8)``: the gradient of the hidden states and the
    labelled rows' indices (every token counted as labelled). ``chunk_tokens`` overrides the recipe's
    ``loss_chunk_tokens``.
    """
    model_config = model_config.get_text_config()  # a vision-language model: its language model
    h = model_config.hidden_size
    i = getattr(model_config, "intermediate_size", 4 * h)
    experts = expert_count(model_config)
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or h // heads
    kv = (getattr(model_config, "num_key_value_heads", None) or heads) * head_dim
    mlp = 4 * i  # gate, up, the activation and the product
    if experts:  # a mixture of experts: each token passes top-k experts' MLPs, and the router (logits, weights)
        # frozen experts save, per routed token, gate, up and the activation, and the expert's output (its routing
        # weight's multiply); adapted ones (their weights need gradients) also the gathered input and the product
        routed, width = experts_per_token(model_config), expert_width(model_config)
        mlp = routed * (3 * width + h) + 4 * experts
        if recipe.lora_target_parameters:
            mlp += routed * (width + h)
    # the norms' fp32 inputs (their upcasts), q, the attention output, o_proj's input, the MLP's input, k and v
    norms = 4 if model_config.model_type in FOUR_NORM_MODEL_TYPES else 2
    per_layer = compute_bytes * (4 * h + 2 * kv + mlp) + 4 * h * norms
    if model_config.model_type in QK_NORM_MODEL_TYPES:  # q and k normed per head too: their fp32 inputs
        per_layer += 4 * (heads * head_dim + kv)
    per_layer += compute_bytes * adapter_ranks
    if recipe.lora_dropout > 0:  # one dropout per adapter: six see width h, down sees i (experts take none)
        per_layer += (compute_bytes + 1) * (4 * h if experts else 6 * h + i)
    if recipe.sequence_parallel_size > 1:  # the attention output, exchanged back, no longer shares o_proj's input
        per_layer += compute_bytes * h
    layer = tokens * per_layer  # what a layer that is not checkpointed saves
    if experts and (recipe.load_in_4bit or recipe.lora_target_parameters):
        # the experts' weights as their matmuls read them (dequantized, or with LoRA folded in: new tensors, not the
        # parameters) are saved for backward like the layer's activations
        layer += 3 * experts * expert_width(model_config) * h * compute_bytes  # gate_up [2I, h] + down [h, I]
    layer_input = tokens * compute_bytes * h
    kept_input = 0 if checkpointing.offload else layer_input  # on the device, per checkpointed layer
    layers = model_config.num_hidden_layers
    kept = min(checkpointing.count, layers)
    saved = (layers - kept) * layer + kept * kept_input
    peak = saved
    if kept:
        top = min(checkpointing.top(), layers - 1)
        below = (top - (kept - 1)) * layer + (kept - 1) * kept_input  # the layers under the topmost checkpointed one
        peak = max(saved, below + layer_input + layer)
    rest = layer_input  # the final norm's input
    if recipe.loss_chunk_tokens if chunk_tokens is None else chunk_tokens:
        rest += tokens * (compute_bytes * h + 8)
    else:
        rest += tokens * model_config.vocab_size * 4
    return peak + rest, saved + rest


def loss_logits_bytes(model_config, chunk_tokens: int, tokens: int, compute_bytes: int) -> int:
    """The loss's transient logits (not saved for backward). The model's own loss: the head output, its fp32
    upcast (``c`` < 4) and the fp32 gradient, for every token. The chunked loss: for one chunk, all of
    that and its fp32 log-softmax (the chunk's own small graph, freed before the next chunk)."""
    model_config = model_config.get_text_config()
    upcast = 4 if compute_bytes != 4 else 0
    if not chunk_tokens:
        return tokens * model_config.vocab_size * (compute_bytes + upcast + 4)
    return min(chunk_tokens, tokens) * model_config.vocab_size * (compute_bytes + upcast + 8)


ROLLOUT_ROW = "rollouts, transient (est.)"
DEQUANTIZED_ROW = "4-bit dequantized for rollouts (est.)"


def kv_cache_bytes_per_token(model_config, compute_bytes: int) -> int:
    """Keys and values of every layer for one token: ``2 x layers x kv heads x head size`` in the compute dtype."""
    heads = model_config.num_attention_heads
    head_size = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    return 2 * model_config.num_hidden_layers * kv_heads * head_size * compute_bytes


def load_model_config(name: str, trust_remote_code: bool = False):
    """The model's config only: embedded tiny models, local directories and downloaded hub models, then the
    shipped configs' hub models (their published config.json kept in the package: planning needs no network),
    then any other hub id (its config downloaded)."""
    path = resolve_model_path(name)
    try:
        return known_model_config(name, trust_remote_code)
    except (OSError, ValueError):
        pass  # not on this machine, nor shipped
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"model_name_or_path: cannot read the config of '{name}' ({first}); give a local directory with "
            "config.json, or log in / connect for a hub id"
        ) from None


def plan_memory(
    config_path,
    world_size: int | None,
    gpu_memory: int,
    low_memory_loading: bool | None = None,
    offload_params: bool | None = None,
    *,
    procedure,
) -> MemoryPlan:
    """Plan the recipe config at ``config_path``, trained by ``procedure`` (its recipe's
    `fsdp_peft.procedures.procedure.Procedure`: `fsdp_peft.procedures.registry.config_procedure`), on ``world_size``
    GPUs of ``gpu_memory`` bytes each.

    FSDP and mixed-precision settings come from the YAML or, under an accelerate config, from the
    ``FSDP_*``/``ACCELERATE_*`` variables already in the environment (``fsdp-peft plan --accelerate-config``).
    ``low_memory_loading`` and ``offload_params``, where not ``None``, override the settings'
    ``cpu_ram_efficient_loading`` and ``offload_params`` (as ``accelerate launch --fsdp_... true`` would).
    A config whose ``fsdp_config`` asks for the TPU route is planned as on XLA (chips as ranks) wherever it runs.
    """
    recipe, training, _ = resolve_recipe_config(["--config", str(config_path)], Path(config_path), "outputs")
    if asks_for_xla(training) and not on_xla():  # a TPU config: planned per chip wherever it is planned
        with xla_assumed():
            plan = plan_memory(
                config_path, world_size, gpu_memory, low_memory_loading, offload_params, procedure=procedure
            )
        plan.notes.append(f"planned for the TPU route its fsdp_config asks for ({DEVICE_VARIABLE} is not set here)")
        return plan
    return plan_recipe(
        recipe, training, procedure, str(config_path), world_size, gpu_memory, low_memory_loading, offload_params
    )


def plan_recipe(
    recipe,
    training: dict,
    procedure,
    label: str,
    world_size: int | None,
    gpu_memory: int,
    low_memory_loading: bool | None = None,
    offload_params: bool | None = None,
    offload_possible: bool = True,
    auto_compiles: bool = True,
) -> MemoryPlan:
    """`plan_memory` of resolved values: ``recipe`` (`fsdp_peft.settings.config.RecipeArguments`), ``training`` (the
    ``TrainingArguments`` values), the ``procedure`` (`fsdp_peft.procedures.procedure.Procedure`: what one of its
    rows puts through the model, whether it trains through TRL); ``label`` names the config in the output. A run
    plans itself through this under ``activation_checkpointing: auto`` (``offload_possible``: a device to offload
    activations from; ``auto_compiles``: ``generate_compiled: auto`` compiles there, a GPU)."""
    check_keys(recipe, training)
    ranks = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if ranks < 1:
        raise ConfigError(f"--gpus: {ranks} is not a positive number of GPUs")
    settings = fsdp_settings(training)
    notes = []
    if settings is None and ranks > 1:
        notes.append("no FSDP settings in the config: assumed FSDP2 full sharding (pass --accelerate-config FILE)")
    shard_over = ranks if (settings is not None or ranks > 1) else 1
    fsdp = "none" if shard_over == 1 and settings is None else f"FSDP{settings.version if settings else 2}"
    mixed = mixed_precision_dtype(training)
    compute_bytes = DTYPE_BYTES[mixed or recipe.torch_dtype]
    gather_dtype = (mixed or recipe.torch_dtype) if shard_over > 1 else recipe.torch_dtype  # what FSDP gathers in
    gather_bytes = DTYPE_BYTES[gather_dtype]
    model_config = load_model_config(recipe.model_name_or_path, recipe.trust_remote_code)
    peft_model = meta_peft_model(model_config, recipe)
    version = settings.version if settings is not None else 2
    trl_trainer = procedure.through_trl
    counts = count_model(peft_model, recipe, shard_over, mixed, gather_bytes, version, head_in_root=trl_trainer)

    optim = str(training.get("optim") or "adamw_torch").lower().removeprefix("optimizernames.")
    optimizer, note = estimated_optimizer_state_bytes(optim, counts.adapter_bytes, counts.adapter_tensors)
    notes += [note] if note else []
    base_class = type(peft_model.get_base_model())
    if chosen_attention(recipe.attn_implementation, base_class) == "eager":
        which = "eager" if recipe.attn_implementation == "eager" else f"auto (eager for {base_class.__name__})"
        notes.append(f"attn_implementation: {which} keeps seq x seq attention weights per layer; not counted")
    layers = model_config.get_text_config().num_hidden_layers
    asked = requested(training, layers)
    choose = False  # auto, and nothing else checkpoints: the plan chooses below, once every other row is known
    if settings and settings.activation_checkpointing:
        checkpointing, reason = every(layers), "fsdp_activation_checkpointing: true (FSDP's own, every layer)"
    elif asked == AUTO:
        checkpointing, reason, choose = NONE, "", True
    else:
        checkpointing, reason = asked, "as the config sets it"
    offload = bool(settings and settings.offload_params) if offload_params is None else offload_params
    if is_vision_config(model_config):
        notes.append(
            "vision-language model: image tokens count within max_seq_length; the vision tower and projector are "
            "counted with the weights, their activations per image are not"
        )
    per_rank = int(training.get("per_device_train_batch_size") or 8)
    tokens = per_rank * math.ceil(recipe.max_seq_length / recipe.sequence_parallel_size)  # a rank's 1/N of each row
    if recipe.sequence_parallel_size > 1:
        notes.append(
            f"sequence_parallel_size {recipe.sequence_parallel_size}: each rank holds 1/"
            f"{recipe.sequence_parallel_size} of every row (tokens per rank below); packed rows under sdpa add a "
            "seq x seq boolean mask per micro-batch, not counted"
        )
    rollout_cache = 0
    if procedure.planned_rows is not None:  # not one sequence a row: DPO's pairs, GRPO's prompt + completion
        rows = procedure.planned_rows(recipe, training, model_config, compute_bytes, per_rank, tokens)
        tokens, rollout_cache = rows.tokens, rows.cache_bytes
        notes += [rows.note] if rows.note else []
    xla = xla_plan(trainer_fsdp_arguments(training).get("fsdp_config"), ranks, tokens)
    if xla is not None:  # TPU chips as ranks: fsdp_peft.core.xla
        fsdp, xla_checkpointing, tokens = xla
        if xla_checkpointing:
            checkpointing, reason = every(layers), "xla_fsdp_grad_ckpt: true (every layer)"
        elif choose:
            checkpointing, reason = NONE, "auto on XLA: xla_fsdp_grad_ckpt decides (off)"
        choose = False
        notes = [note for note in notes if not note.startswith("no FSDP settings")]
        if recipe.loss_chunk_tokens:
            notes.append(f"loss_chunk_tokens: the model's own loss on full logits is counted: {ON_XLA}")
    plan = MemoryPlan(
        config=label,
        model=recipe.model_name_or_path,
        world_size=ranks,
        gpu_memory_bytes=gpu_memory,
        fsdp=fsdp,
        mixed_precision=mixed,
        load_in_4bit=recipe.load_in_4bit,
        tokens_per_rank=tokens,
        checkpointing=checkpointing,
        offload_params=offload,
        optimizer=optim,
        counts=counts,
        preference=trl_trainer,
        notes=notes,
        checkpointable_layers=layers,
        checkpointing_reason=reason,
    )
    resident = dict(zip(RESIDENT_ROWS, (counts.base_bytes, counts.adapter_bytes, counts.adapter_bytes, optimizer)))
    plan.gpu = {name: 0 if offload else value for name, value in resident.items()}
    plan.gpu["quantization constants (whole)"] = counts.quantization_constant_bytes
    gathered = 0
    if shard_over > 1:  # current unit + the prefetched one, and the biggest non-layer unit (head / embeddings)
        gathered = 2 * counts.layer_gathered_bytes + counts.largest_other_unit_gathered_bytes
    if four_bit := FourBit.of(recipe):  # one weight dequantized for its matmul (a MoE's: every expert of one parameter)
        largest = max(counts.largest_linear_numel, counts.largest_expert_numel)
        gathered += largest * four_bit.compute.itemsize
    plan.gpu["gathered units at peak (est.)"] = gathered
    # XLA: the model's own loss (fsdp_peft.model.loss)
    chunk_tokens = 0 if xla is not None else recipe.loss_chunk_tokens
    unavailable = chunked_loss_unavailable(peft_model.get_base_model(), SimpleNamespace(**training))
    liger = liger_requested(recipe, training)
    if liger:  # its fused linear cross-entropy: the chunked loss's saved gradient, chunks of its own size
        text = model_config.get_text_config()
        chunk_tokens = liger_chunk_tokens(tokens, text.hidden_size, text.vocab_size)
        notes.append(
            f"kernels: liger: its fused linear cross-entropy counted in chunks of {chunk_tokens} tokens (its own "
            "size), its norms and SwiGLU as the model's own (not measured on a GPU yet)"
        )
    elif chunk_tokens and unavailable:  # e.g. a head wrapped by trainable tokens (new tokens) or a trained copy
        chunk_tokens = 0
        notes.append(f"loss_chunk_tokens: the model's own loss on full logits is counted: {unavailable}")
    if trl_trainer:  # TRL's fused log-prob head: saves what the chunked loss saves, one tile transient
        chunk_tokens = TRL_TOKEN_TILE
    layer_ranks = counts.layer_adapter_ranks
    plan.gpu["activations (est.)"] = activation_bytes(
        model_config, recipe, tokens, compute_bytes, checkpointing, chunk_tokens, layer_ranks
    )
    plan.gpu["loss logits, transient (est.)"] = (
        min(tokens, TRL_TOKEN_TILE) * min(model_config.get_text_config().vocab_size, TRL_VOCAB_TILE) * compute_bytes
        if trl_trainer
        # Liger's cross-entropy kernel writes each chunk's gradient into its logits: one chunk x vocabulary buffer
        else chunk_tokens * model_config.get_text_config().vocab_size * compute_bytes
        if liger
        else loss_logits_bytes(model_config, chunk_tokens, tokens, compute_bytes)
    )
    if rollout_cache:  # generate gathers every unit once per call (fsdp_peft.tools.generation.parameters_gathered)
        plan.gpu[ROLLOUT_ROW] = rollout_cache + counts.base_bytes * (shard_over - 1)
    copies = rollout_copies_bytes(recipe, counts, fsdp, gather_dtype, auto_compiles) if rollout_cache else 0
    if copies and recipe.generate_compiled == "true":  # asked for: planned, checkpointing chosen with them
        plan.gpu[DEQUANTIZED_ROW] = copies
    plan.gpu["CUDA context and slack (est.)"] = CUDA_CONTEXT_BYTES

    full_model_bytes = counts.base_parameters * DTYPE_BYTES[recipe.torch_dtype]
    low_memory = (
        bool(settings and settings.cpu_ram_efficient_loading) if low_memory_loading is None else low_memory_loading
    )
    plan.low_memory_loading = low_memory
    ranks_per_node = min(ranks, int(os.environ.get("LOCAL_WORLD_SIZE", ranks)))
    plan.host = {
        "loading: checkpoint copies (est.)": full_model_bytes * (1 if low_memory else ranks_per_node),
        "offloaded shards": sum(resident.values()) * ranks_per_node if offload else 0,
    }
    if not low_memory and xla is None:
        whole = count_model(peft_model, recipe, 1, mixed, gather_bytes, version, head_in_root=trl_trainer)
        plan.gpu_loading = loading_bytes(whole, counts, recipe, shard_over)
    if counts.expert_parameters and recipe.load_in_4bit and not low_memory:
        loaded = counts.expert_parameters * DTYPE_BYTES[recipe.torch_dtype]
        plan.notes.append(
            f"4-bit experts: ordinary loading puts every expert on each GPU in {recipe.torch_dtype} ({gib(loaded)}) "
            "before quantizing them; fsdp_cpu_ram_efficient_loading: true quantizes them tensor by tensor on rank 0"
        )
    vision = is_vision_config(model_config)  # the vision blocks checkpoint as layers too: all or none there

    def activations(checkpointing: Checkpointing) -> int:
        return activation_bytes(model_config, recipe, tokens, compute_bytes, checkpointing, chunk_tokens, layer_ranks)

    least = choose_checkpointing(plan, activations, offload_possible, vision) if choose else plan.checkpointing
    if copies:
        plan.rollouts_dequantized, plan.rollouts_reason = True, "generate_compiled: true"
        if recipe.generate_compiled == AUTO:
            choose_rollouts(plan, copies)
    plan.suggestions = suggestions(plan, model_config, recipe, resident, full_model_bytes, low_memory)
    if procedure.planned_rows is None and xla is None:
        plan.longest_sequence = longest_sequence(
            plan, model_config, recipe, per_rank, compute_bytes, chunk_tokens, least
        )
    return plan


def choose_checkpointing(plan: MemoryPlan, activations, offload_possible: bool, all_or_none: bool) -> Checkpointing:
    """``activation_checkpointing: auto``: the first of `fsdp_peft.settings.checkpointing.candidates` (fewest layers
    first) whose peak stays within ``1 - MARGIN`` of the GPU, else the last (the least memory);
    ``activations(checkpointing)`` gives a candidate's activations row. Sets the plan's checkpointing, its activations
    row, the candidates and why; returns the least memory of them."""
    total = plan.checkpointable_layers
    options = candidates(total, offload_possible)
    if all_or_none:
        options = [c for c in options if c.count in (0, total)]
    others = plan.gpu_total - plan.gpu["activations (est.)"]
    limit = int(plan.gpu_memory_bytes * (1 - MARGIN))
    rows = [(c, activations(c)) for c in options]
    peaks = [(c, row, max(others + row, plan.gpu_loading)) for c, row in rows]
    plan.checkpointing_choices = [{"checkpointing": c.describe(total), "peak": peak} for c, _, peak in peaks]
    fitting = [choice for choice in peaks if choice[2] <= limit]
    chosen, row, peak = fitting[0] if fitting else peaks[-1]
    plan.checkpointing = chosen
    plan.gpu["activations (est.)"] = row
    within = f"{1 - MARGIN:.0%} of {budget(plan.gpu_memory_bytes)}"
    plan.checkpointing_reason = (
        f"auto: the fewest whose planned peak, {gib(peak)}, is within {within}"
        if fitting
        else f"auto: no choice is within {within}; the least memory of them ({gib(peak)})"
    )
    return options[-1]


def rollout_copies_bytes(recipe, counts: ModelCounts, fsdp: str, gathered: str, auto_compiles: bool) -> int:
    """Bytes of the 16-bit copies of a QLoRA model's 4-bit linear weights that each rollout's generate call makes
    for the compiled decode step (`fsdp_peft.tools.generation.four_bit_dequantized`, every unit gathered): the 4-bit
    linear weights' elements in ``gathered``, the dtype the weights are gathered in. None (0) where no 4-bit layer
    is, where the step is not compiled (``generate_compiled: false``; ``auto`` where ``auto_compiles`` is False: a
    CPU), under FSDP1 or XLA (weights gathered per forward), with ``generate_gather_budget: none``, or where the
    compute dtype is not that dtype (such a layer keeps its own forward, which casts)."""
    four_bit = FourBit.of(recipe)
    compiled = recipe.generate_compiled == "true" or (recipe.generate_compiled == AUTO and auto_compiles)
    if not four_bit or not compiled or fsdp == "FSDP1" or fsdp.startswith("XLA"):
        return 0
    if str(recipe.generate_gather_budget).strip().lower() == "none":
        return 0
    if four_bit.compute != getattr(torch, gathered):
        return 0
    return counts.quantized_linear_parameters * DTYPE_BYTES[gathered]


def choose_rollouts(plan: MemoryPlan, copies: int) -> None:
    """QLoRA rollouts under ``generate_compiled: auto``: the 4-bit layers dequantized for each generate call (their
    ``copies`` a row of the plan; the compiled decode step needs them) where the planned total with them is within
    ``1 - MARGIN`` of the GPU, else kept 4-bit (an eager decode step). Checkpointing was chosen without them: the
    plan counts rollouts beside the activations, an upper bound (the two do not overlap), so checkpointing more
    layers for the copies' sake would buy recomputation for memory that generation does not contend for. Sets the
    plan's choice and why."""
    limit = int(plan.gpu_memory_bytes * (1 - MARGIN))
    within = f"{1 - MARGIN:.0%} of {budget(plan.gpu_memory_bytes)}"
    total = plan.gpu_total + copies
    if total > limit:
        plan.rollouts_dequantized = False
        plan.rollouts_reason = (
            f"auto: with their dequantized copies ({gib(copies)}) the planned total, {gib(total)}, is over {within}"
        )
        return
    rows = list(plan.gpu.items())  # the copies' row before the last (the CUDA context's)
    plan.gpu = dict([*rows[:-1], (DEQUANTIZED_ROW, copies), rows[-1]])
    plan.rollouts_reason = f"auto: the planned total with their copies, {gib(total)}, is within {within}"


def rollouts_line(plan: MemoryPlan) -> str | None:
    """What the plan's QLoRA rollouts compute with, and why; None for a plan without them."""
    if plan.rollouts_dequantized is None:
        return None
    how = "dequantized for each generate call" if plan.rollouts_dequantized else "kept (an eager decode step)"
    return f"4-bit layers in rollouts: {how} ({plan.rollouts_reason})"


def loading_bytes(whole: ModelCounts, counts: ModelCounts, recipe, ranks: int) -> int:
    """A GPU's peak while ordinary loading: the whole model as loaded (4-bit weights packed; a MoE's experts in
    ``torch_dtype``, quantized after loading), its adapters and quantization constants, the largest unit's shard
    being made, and the CUDA context. FSDP2 frees each unit's weights as it shards it
    (`fsdp_peft.core._compat.accelerate_patches.originals_released_while_sharding`; accelerate alone held them all).
    Low-memory loading puts only shards on a GPU."""
    base = whole.base_bytes
    if whole.expert_parameters and recipe.load_in_4bit:
        base += whole.expert_parameters * DTYPE_BYTES[recipe.torch_dtype] - whole.expert_bytes
    unit = max(counts.layer_gathered_bytes, counts.largest_other_unit_gathered_bytes) // ranks
    return base + whole.adapter_bytes + whole.quantization_constant_bytes + unit + CUDA_CONTEXT_BYTES


def longest_sequence(
    plan: MemoryPlan, model_config, recipe, rows: int, compute_bytes: int, chunk: int, checkpointing: Checkpointing
) -> int:
    """The longest ``max_seq_length`` (a multiple of 256, up to 4M) whose plan fits, all else as planned, with
    ``checkpointing`` (under auto: the least memory it may choose)."""
    fixed = plan.gpu_total - plan.gpu["activations (est.)"] - plan.gpu["loss logits, transient (est.)"]
    layer_ranks = plan.counts.layer_adapter_ranks

    def fits(length: int) -> bool:
        tokens = rows * math.ceil(length / recipe.sequence_parallel_size)
        saved = activation_bytes(model_config, recipe, tokens, compute_bytes, checkpointing, chunk, layer_ranks)
        return fixed + saved + loss_logits_bytes(model_config, chunk, tokens, compute_bytes) <= plan.gpu_memory_bytes

    low, high = 0, 2**22 // 256  # in units of 256 tokens
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle * 256) else (low, middle - 1)
    return low * 256


def suggestions(plan: MemoryPlan, model_config, recipe, resident: dict, full_model_bytes: int, low_memory: bool):
    """Switches that lower per-GPU (or host) memory, each with what it saves; most saving first."""
    found = []
    compute_bytes = DTYPE_BYTES[plan.mixed_precision or recipe.torch_dtype]
    layer_ranks = plan.counts.layer_adapter_ranks
    if plan.checkpointing.count < plan.checkpointable_layers:
        tokens = plan.tokens_per_rank
        everything = every(plan.checkpointable_layers)
        checkpointed = activation_bytes(
            model_config, recipe, tokens, compute_bytes, everything, adapter_ranks=layer_ranks
        )
        saved = plan.gpu["activations (est.)"] - checkpointed
        found.append({"switch": "activation_checkpointing: true (or fsdp_activation_checkpointing)", "saves": saved})
    if not recipe.loss_chunk_tokens and not plan.fsdp.startswith("XLA") and not plan.preference:
        tokens, checkpointing = plan.tokens_per_rank, plan.checkpointing
        chunked = activation_bytes(model_config, recipe, tokens, compute_bytes, checkpointing, 512, layer_ranks)
        chunked += loss_logits_bytes(model_config, 512, tokens, compute_bytes)
        saved = plan.gpu["activations (est.)"] + plan.gpu["loss logits, transient (est.)"] - chunked
        found.append({"switch": "loss_chunk_tokens: 512 (chunked loss)", "saves": saved})
    if not plan.offload_params:
        found.append({"switch": "fsdp_offload_params: true (accelerate config)", "saves": sum(resident.values())})
    if DEQUANTIZED_ROW in plan.gpu:  # the rollouts' dequantized copies (choose_rollouts)
        switch = "generate_compiled: false (rollouts through the 4-bit layers, eagerly)"
        found.append({"switch": switch, "saves": plan.gpu[DEQUANTIZED_ROW]})
    if not plan.load_in_4bit:  # 4 bits per value plus ~1.6% constants instead of torch_dtype
        bytes_per_value = DTYPE_BYTES[recipe.torch_dtype]
        saved = plan.counts.linear_weight_bytes * (1 - 0.5 * 1.016 / bytes_per_value)
        found.append({"switch": "load_in_4bit: true (QLoRA recipe)", "saves": int(saved)})
    if not low_memory and plan.world_size > 1 and not is_vision_config(model_config):  # refused for VLMs
        saved = full_model_bytes * (plan.world_size - 1)
        found.append(
            {"switch": "fsdp_cpu_ram_efficient_loading: true (host RAM while loading)", "saves": saved, "host": True}
        )
        if plan.gpu_loading > plan.gpu_total and plan.fsdp == "FSDP2":  # each GPU then receives its shards only
            saved = plan.gpu_loading - plan.gpu_total
            switch = "fsdp_cpu_ram_efficient_loading: true (each GPU receives its shards only)"
            found.append({"switch": switch, "saves": saved, "loading": True})
    return sorted(found, key=lambda s: (s.get("host", False), -s["saves"]))


def gib(value: int) -> str:
    """A byte count for people: GiB from 1 GiB up, else MiB."""
    return f"{value / GIB:.2f} GiB" if abs(value) >= GIB else f"{value / 2**20:.1f} MiB"


def budget(value: int) -> str:
    """A GPU size as given: ``24 GiB`` rather than ``24.00 GiB``."""
    return gib(value).replace(".00 ", " ")


def verdict(plan: MemoryPlan) -> str:
    """One line: fits with what to spare, or does not fit and which switches would save how much."""
    size = budget(plan.gpu_memory_bytes)
    spare = plan.gpu_memory_bytes - plan.gpu_peak
    if spare >= 0:
        return f"fits in {size} per GPU with {gib(spare)} to spare (estimate)"
    if plan.gpu_loading > plan.gpu_total:  # the whole model on each GPU before sharding
        needed = f"does not fit in {size} per GPU while loading (needs {gib(plan.gpu_loading)}, estimate)"
        loading = [s for s in plan.suggestions if s.get("loading")]
        remedy = f"turn on {loading[0]['switch']}" if loading else "load_in_4bit: true, or larger GPUs"
        return f"{needed}: {remedy}"
    gpu_switches = [s for s in plan.suggestions if not s.get("host") and not s.get("loading")]
    listed = ", ".join(f"{s['switch']} (saves {gib(s['saves'])})" for s in gpu_switches if s["saves"] > 0)
    needed = f"does not fit in {size} per GPU (needs {gib(plan.gpu_total)}, estimate)"
    return f"{needed}: turn on {listed}" if listed else f"{needed}: use more or larger GPUs, or a smaller batch"


def format_plan(plan: MemoryPlan) -> str:
    """The readable table: per-GPU components, host RAM, notes and verdict."""
    c = plan.counts
    lines = [
        f"memory plan for {plan.config}: {plan.model}, {plan.world_size} GPU(s) x {budget(plan.gpu_memory_bytes)}, "
        f"{plan.fsdp}, mixed precision {plan.mixed_precision or 'none'}, "
        f"{'QLoRA (4-bit base)' if plan.load_in_4bit else 'LoRA'}",
        f"  base parameters {c.base_parameters:,}; adapter parameters {c.adapter_parameters:,}; "
        f"optimizer {plan.optimizer}; "
        f"{plan.tokens_per_rank:,} tokens per rank per micro-batch; activation checkpointing "
        f"{plan.checkpointing.describe(plan.checkpointable_layers)}; offload {'on' if plan.offload_params else 'off'}; "
        f"low-memory loading {'on' if plan.low_memory_loading else 'off'}",
        "",
        f"  {'per GPU (largest rank)':<40} {'bytes':>14} {'':>11}",
    ]
    lines += [f"  {name:<40} {value:>14,} {gib(value):>11}" for name, value in plan.gpu.items()]
    lines.append(f"  {'total':<40} {plan.gpu_total:>14,} {gib(plan.gpu_total):>11}")
    if plan.gpu_loading:
        lines.append(f"  {'while loading: whole model (est.)':<40} {plan.gpu_loading:>14,} {gib(plan.gpu_loading):>11}")
    lines += ["", f"  {'host RAM per node':<40}"]
    lines += [f"  {name:<40} {value:>14,} {gib(value):>11}" for name, value in plan.host.items()]
    lines.append("")
    if plan.checkpointing_choices:
        chosen = plan.checkpointing.describe(plan.checkpointable_layers)
        lines += [f"  {'activation checkpointing: auto':<48} {'peak':>11}"]
        shown = plan.checkpointing_choices
        at = next(i for i, choice in enumerate(shown) if choice["checkpointing"] == chosen)
        if len(shown) > 8:  # the fastest, the chosen one and its neighbours, the least memory
            shown = [shown[0], *shown[max(1, at - 1) : at + 2], *shown[-2:]]
            shown = list({choice["checkpointing"]: choice for choice in shown}.values())
        for choice in shown:
            mark = "  <- chosen" if choice["checkpointing"] == chosen else ""
            lines.append(f"  {choice['checkpointing']:<48} {gib(choice['peak']):>11}{mark}")
    if plan.checkpointing_reason:
        lines += [f"  activation checkpointing: {plan.checkpointing_reason}", ""]
    if line := rollouts_line(plan):
        lines += [f"  {line}", ""]
    lines += [f"  note: {note}" for note in plan.notes]
    lines.append("  (est.) rows are estimates; weights, gradients and optimizer rows are exact counts from the config")
    host_tips = [s for s in plan.suggestions if s.get("host")]
    lines += [f"  host RAM: {s['switch']} saves {gib(s['saves'])}" for s in host_tips]
    if plan.longest_sequence is not None:
        lines.append(
            f"  longest max_seq_length that fits {budget(plan.gpu_memory_bytes)} per GPU with this batch: "
            f"{plan.longest_sequence:,} tokens (estimate)"
        )
    lines.append(verdict(plan))
    return "\n".join(lines)


def device_memory(recipe) -> int | None:
    """The memory ``activation_checkpointing: auto`` plans within: ``device_memory`` as given, else this rank's GPU's
    total memory; ``None`` on a machine without one (nothing to plan within)."""
    if str(recipe.device_memory).strip().lower() != AUTO:
        return parse_size(recipe.device_memory, "device_memory")
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(distributed.ranks().local_rank).total_memory


def launch_plan(recipe, training: dict, procedure, source) -> MemoryPlan | None:
    """The plan a run makes of itself before any weights, on this launch's ranks and device, where it has something
    to choose (``activation_checkpointing: auto``; QLoRA rollouts under ``generate_compiled: auto`` on a GPU, where
    auto compiles) and memory to plan within (`device_memory`); else None."""
    memory = device_memory(recipe)
    on_gpu = _on_gpu()  # offloading activations moves them off a GPU; on CPU they are there already
    rollouts = on_gpu and recipe.load_in_4bit and recipe.generate_compiled == AUTO and procedure.samples_rollouts
    if memory is None or (_asked(recipe, training)[0] != AUTO and not rollouts):
        return None
    return plan_recipe(
        recipe, training, procedure, str(source), None, memory, offload_possible=on_gpu, auto_compiles=on_gpu
    )


def _on_gpu() -> bool:
    """Whether this process runs on a GPU (where ``generate_compiled: auto`` compiles and activations can be
    offloaded)."""
    return torch.cuda.is_available()


def _asked(recipe, training: dict) -> tuple[Checkpointing | str, int]:
    """What the config asks to checkpoint (`requested`), and the model's decoder layers."""
    layers = load_model_config(recipe.model_name_or_path, recipe.trust_remote_code).get_text_config().num_hidden_layers
    return requested(training, layers), layers


def run_checkpointing(recipe, training: dict, source, plan: MemoryPlan | None) -> tuple[CheckpointingChoice, dict]:
    """What a run checkpoints, and the training values that make transformers do it: the config's own setting, or
    under ``auto`` the choice of ``plan``, `launch_plan`'s on this launch's ranks and device (refused, before any
    weights, when not even the least memory of the choices fits)."""
    asked, layers = _asked(recipe, training)
    if asked != AUTO:
        return CheckpointingChoice(asked, layers, "as the config sets it"), {}
    # the Trainer's switch off: the recipe checkpoints the chosen layers
    # (fsdp_peft.settings.checkpointing.apply_checkpointing)
    off = {**{key: None for key in CHECKPOINTING_KEYS + KWARGS_KEYS}, "activation_checkpointing": False}
    if plan is None:
        reason = "auto: no GPU memory to plan within; set device_memory to plan one"
        return CheckpointingChoice(NONE, layers, reason), off
    if not plan.fits:
        raise ConfigError(
            f"{source}: {verdict(plan)} (activation_checkpointing: auto, with the least memory of its choices: "
            f"{plan.checkpointing.describe(plan.checkpointable_layers)}); `fsdp-peft plan` shows every row"
        )
    wrapper = plan.checkpointing_reason.startswith(("fsdp_activation_checkpointing", "xla_fsdp_grad_ckpt"))
    kwargs = checkpoint_kwargs(training)
    return CheckpointingChoice(plan.checkpointing, layers, plan.checkpointing_reason, not wrapper, kwargs), off


def rollouts_as_planned(recipe, plan: MemoryPlan | None):
    """The recipe with ``generate_compiled: auto`` made ``false`` where ``plan`` (`launch_plan`'s) keeps a QLoRA
    run's 4-bit layers for its rollouts (their dequantized copies do not fit: the decode step could not compile), and
    the line that says what the plan chose (None: nothing chosen)."""
    line = rollouts_line(plan) if plan is not None and recipe.generate_compiled == AUTO else None
    if line is None or plan.rollouts_dequantized:
        return recipe, line
    return replace(recipe, generate_compiled="false"), line
