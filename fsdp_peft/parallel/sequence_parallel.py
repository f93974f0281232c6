"""Ulysses sequence parallelism: each rank of a sequence group holds a contiguous 1/N of every row.

``sequence_parallel_size: N`` arranges the ranks as (data parallel x N): accelerate's context-parallel
dimension gives the N ranks of a group the same rows, FSDP2 shards over all ranks, and the Trainer counts
the loss's tokens over the group (`fsdp_peft.procedures.trainer`). Here: how a batch is split and how attention sees the
whole sequence anyway.

- `split_rows`: labels shifted before the split (each position's target travels with it), global position
  ids (rotary embeddings, packed documents), the sequence padded at the end to a multiple of N, then each
  rank keeps its contiguous slice.
- `ulysses_attention`: q/k/v of the rank's tokens and all heads are exchanged (all-to-all) for all tokens of
  1/N of the heads, the recipe's kernel (sdpa or eager) runs on the whole sequence with a causal, or for packed
  rows document-causal, mask from the gathered position ids, and the inverse exchange returns the rank's
  tokens. Its backward is the same pair of exchanges.
- `sequence_split`: within it the model's attention is `ulysses_attention`; outside (generation, the samples
  shown at evaluation) the recipe's kernel runs unsplit as ever.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import ParallelismConfig
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fsdp_peft.core.distributed import ranks
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import logger
from fsdp_peft.core.xla import on_xla
from fsdp_peft.data.tokenize import IGNORE_INDEX
from fsdp_peft.model.attention import chosen_attention, model_class_named
from fsdp_peft.model.moe import expert_count, router_aux_loss_coefficient
from fsdp_peft.model.paths import local_model_config
from fsdp_peft.parallel.cpu_fsdp import USE_PARALLELISM_CONFIG
from fsdp_peft.settings.fsdp_settings import RuleContext, launcher_asks_for_fsdp

ULYSSES = "fsdp_peft_ulysses"  # the attention name the model runs under while a split is active
KERNELS = ("sdpa", "eager")  # the kernels the split wraps (tested on CPU; flash kernels are refused)


@dataclass
class SequenceGroup:
    """The ranks that share rows, this rank's place among them, and the kernel attention wraps."""

    group: dist.ProcessGroup
    size: int
    rank: int
    kernel: str


_active: SequenceGroup | None = None  # set only inside `sequence_split`
_positions: tuple | None = None  # (local ids, their version, the gathered ids): one gather per forward


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 in equal chunks; its adjoint is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x := x.contiguous())
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty_like(grad := grad.contiguous())
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def tokens_to_heads(x: torch.Tensor, group: dist.ProcessGroup, n: int) -> torch.Tensor:
    """(B, H, S/n, D), the rank's tokens of every head -> (B, H/n, S, D), every token of the rank's heads."""
    b, h, s, d = x.shape
    x = _AllToAll.apply(x.reshape(b, n, h // n, s, d).transpose(0, 1), group)  # chunk j of heads to rank j
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)  # chunk i came from rank i: tokens in order


def heads_to_tokens(y: torch.Tensor, group: dist.ProcessGroup, n: int) -> torch.Tensor:
    """The inverse of `tokens_to_heads`: (B, H/n, S, D) -> (B, H, S/n, D)."""
    b, h, s, d = y.shape
    y = _AllToAll.apply(y.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4), group)  # token chunk i to rank i
    return y.transpose(0, 1).reshape(b, n * h, s // n, d)


def gathered_positions(local: torch.Tensor, group: dist.ProcessGroup, n: int) -> torch.Tensor:
    """The whole rows' position ids; every layer (and a checkpointed layer's recompute) gets the same tensor,
    so they are gathered once per forward."""
    global _positions
    if _positions is not None and _positions[0] is local and _positions[1] == local._version:
        return _positions[2]
    parts = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(parts, local.contiguous(), group=group)
    _positions = (local, local._version, torch.cat(parts, dim=-1))
    return _positions[2]


def document_causal_mask(positions: torch.Tensor, batch: int) -> torch.Tensor | None:
    """``None`` (plain causal) when each row is one document; else (B, 1, S, S), True where a token may attend:
    earlier or itself, in the same document (a document starts where the position ids do not go up by one)."""
    positions = positions.expand(batch, -1)
    documents = (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    if bool((documents[:, -1] == 0).all()):
        return None
    s = positions.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=positions.device).tril()
    return (causal[None] & (documents[:, :, None] == documents[:, None, :]))[:, None]


def _eager(query, key, value, mask, dropout: float, scaling: float, training: bool) -> torch.Tensor:
    """Softmax attention written out, as transformers' eager kernels compute it: (B, H, S, D) -> (B, S, H, D)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if mask is None:
        s = query.shape[2]
        mask = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous()


def ulysses_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface: q (B, Hq, S/n, D), k and v (B, Hkv, S/n, D) -> (B, S/n, Hq, D)."""
    split = _active
    if split is None:
        raise RuntimeError("ulysses attention ran outside a sequence split")
    if kwargs.get("position_ids") is None:
        raise RuntimeError(
            "ulysses attention needs the rows' global position ids (fsdp_peft.parallel.sequence_parallel)"
        )
    n, group = split.size, split.group
    kv_heads = key.shape[1]
    if kv_heads % n:  # fewer kv heads than ranks (validated: n is a multiple of them): each rank needs its own
        key, value = key.repeat_interleave(n // kv_heads, dim=1), value.repeat_interleave(n // kv_heads, dim=1)
    query, key, value = (tokens_to_heads(t, group, n) for t in (query, key, value))
    positions = gathered_positions(kwargs["position_ids"], group, n)
    mask = document_causal_mask(positions, query.shape[0])
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if split.kernel == "eager":
        out = _eager(query, key, value, mask, dropout, scaling, module.training)
    else:
        kernel = _SdpaModule(query.shape[1] // key.shape[1])  # query heads per kv head, as before the exchange
        rest = {k: v for k, v in kwargs.items() if k not in ("position_ids", "is_causal")}
        out, _ = sdpa_attention_forward(kernel, query, key, value, mask, dropout=dropout, scaling=scaling, **rest)
    return heads_to_tokens(out.transpose(1, 2), group, n).transpose(1, 2).contiguous(), None


@dataclass
class _SdpaModule:
    """What transformers' sdpa kernel reads from the attention module: GQA groups, causality."""

    num_key_value_groups: int
    is_causal: bool = True


def _register() -> None:
    AttentionInterface.register(ULYSSES, ulysses_attention)


def split_rows(inputs: dict, rank: int, n: int, pad_id: int) -> dict:
    """This rank's slice of a collated causal-LM batch (every rank of the group holds the same batch).

    Right padding only: a row whose attention mask has a hole or leads with padding is refused (the split
    attends causally by position, so it cannot honour a mask)."""
    ids, labels = inputs["input_ids"], inputs["labels"]
    mask = inputs.get("attention_mask")
    if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError(
            "sequence_parallel_size: a row is left-padded or has a hole in its attention mask; "
            "the split needs right-padded rows (padding_side: right)"
        )
    positions = inputs.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # each position's target, before the split
    pad = -ids.shape[1] % n
    if pad:
        more = torch.arange(1, pad + 1, device=ids.device)
        ids = F.pad(ids, (0, pad), value=pad_id)
        shifted = F.pad(shifted, (0, pad), value=IGNORE_INDEX)
        positions = torch.cat([positions, positions[:, -1:] + more], dim=1)
    width = ids.shape[1] // n
    part = slice(rank * width, (rank + 1) * width)
    rest = {k: v for k, v in inputs.items() if k not in ("input_ids", "labels", "attention_mask", "position_ids")}
    local_targets = shifted[:, part].contiguous()
    return {
        **rest,
        "input_ids": ids[:, part].contiguous(),
        "position_ids": positions[:, part].contiguous(),
        "labels": local_targets,  # the model computes its loss only when given labels; shift_labels win
        "shift_labels": local_targets,
    }


def _attention_configs(model: torch.nn.Module) -> list:
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    return [c for c in configs.values() if hasattr(c, "_attn_implementation")]


@contextlib.contextmanager
def sequence_split(model: torch.nn.Module, split: SequenceGroup):
    """Within: every attention of ``model`` runs `ulysses_attention` over ``split``'s group."""
    global _active, _positions
    _register()
    configs = _attention_configs(model)
    kernels = [c._attn_implementation for c in configs]
    _active = split
    for config in configs:
        config._attn_implementation = ULYSSES
    try:
        yield
    finally:
        for config, kernel in zip(configs, kernels):
            config._attn_implementation = kernel
        _active, _positions = None, None


def sequence_parallel_mesh(size: int, world_size: int):
    """accelerate's parallelism config for ``size``-rank sequence groups: its context-parallel dimension gives
    a group the same rows, and FSDP2 shards over data and sequence ranks together."""
    if world_size % size or world_size < size:
        raise ConfigError(
            f"sequence_parallel_size: {size} does not divide this launch's {world_size} process(es); launch "
            "with accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml (or fsdp2.yaml) on a multiple"
        )
    return ParallelismConfig(dp_shard_size=world_size // size, cp_size=size)


def split_for_training(trainer, model: torch.nn.Module, inputs: dict):
    """``Trainer._prepare_context_parallel_inputs`` for Ulysses: (the split's context, this rank's inputs)."""
    config = getattr(trainer.accelerator, "parallelism_config", None)
    if config is None or not config.cp_enabled or "labels" not in inputs:
        return contextlib.nullcontext, inputs
    mesh = trainer.accelerator.torch_device_mesh["cp"]
    kernel = trainer.model.config._attn_implementation
    if kernel not in KERNELS:
        raise ConfigError(f"sequence_parallel_size: the model runs {kernel} attention; the split wraps {KERNELS}")
    split = SequenceGroup(mesh.get_group(), mesh.size(), mesh.get_local_rank(), kernel)
    local = split_rows(inputs, split.rank, split.size, trainer.model.config.pad_token_id or 0)
    if not getattr(trainer, "_sequence_split_reported", False):
        trainer._sequence_split_reported = True
        logger.info(
            f"sequence parallel: each row split over {split.size} ranks ({local['input_ids'].shape[1]} of "
            f"{inputs['input_ids'].shape[1]} tokens of the first batch on each), {kernel} attention within"
        )
    return (lambda: sequence_split(model, split)), local


def tokens_counted_once(trainer, count) -> None:
    """``count()`` (Trainer's token count, which sums every rank's rows), with a sequence group's rows, which each
    of its ranks holds, counted once."""
    before = trainer.state.num_input_tokens_seen
    count()
    config = getattr(trainer.accelerator, "parallelism_config", None)
    if config is not None and config.cp_enabled:
        trainer.state.num_input_tokens_seen = before + (trainer.state.num_input_tokens_seen - before) // config.cp_size


def sequence_split_runs_here(context: RuleContext) -> str | None:
    """The split runs SFT under FSDP2 over a launch whose size it divides, on one of `KERNELS`."""
    recipe = context.recipe
    n = recipe.sequence_parallel_size
    if n <= 1:
        return None
    key = f"sequence_parallel_size: {n}"
    if context.procedure.through_trl:
        return (
            f"{key}: the preference and GRPO recipes train without the split (their losses are not made exact "
            "under it yet); set sequence_parallel_size: 1"
        )
    if on_xla():
        return f"{key}: the TPU route has no sequence split; set sequence_parallel_size: 1"
    launched = "WORLD_SIZE" in os.environ  # a launch, or validate --accelerate-config: its ranks are known
    world = ranks().world_size
    if launched and (world % n or world < n):
        return f"{key} does not divide this launch's {world} process(es); use a divisor of num_processes above 1"
    fsdp = context.fsdp
    if launched and fsdp is None and not launcher_asks_for_fsdp():
        return f"{key}: the split runs under FSDP2; launch with configs/accelerate/cpu_fsdp2.yaml (or fsdp2.yaml)"
    if fsdp is not None and fsdp.version != 2:
        return f"{key}: FSDP{fsdp.version} cannot shard over the sequence mesh; use FSDP2 (fsdp_version: 2)"
    if os.environ.get(USE_PARALLELISM_CONFIG, "false").lower() == "true":
        return (
            f"{key} with the launcher's parallelism_config (HSDP or context parallel): the split builds its own "
            "mesh; drop parallelism_config from the accelerate config"
        )
    model_class = model_class_named(recipe.model_name_or_path, recipe.trust_remote_code)
    kernel = chosen_attention(recipe.attn_implementation, model_class)
    if kernel not in KERNELS:
        return f"{key}: attn_implementation {kernel}; the split wraps {' or '.join(KERNELS)}: set one of those"
    return None


def sequence_split_keeps_the_models_loss(context: RuleContext) -> str | None:
    """No label smoothing with the split: Trainer's label smoother shifts the labels it is given by one token, and a
    split row's are shifted already (`split_rows`); measured on 2 ranks of the tiny model with 0.1, the first step's
    loss 5.51990 against one process's 5.52791 (5.52096 both without smoothing)."""
    n, factor = context.recipe.sequence_parallel_size, context.training.get("label_smoothing_factor") or 0
    if n <= 1 or not factor:
        return None
    return (
        f"sequence_parallel_size: {n} with label_smoothing_factor: {factor}: Trainer's label smoother shifts the "
        "labels again, which a split row carries shifted already; set label_smoothing_factor: 0, or "
        "sequence_parallel_size: 1"
    )


def sequence_split_fits_the_model(context: RuleContext) -> str | None:
    """Heads divide over the group, every layer attends to the whole causal prefix, and a mixture of experts adds
    no load-balancing loss."""
    recipe = context.recipe
    n = recipe.sequence_parallel_size
    if n <= 1:
        return None
    try:
        config = local_model_config(recipe.model_name_or_path, recipe.trust_remote_code)
    except (OSError, ValueError):
        return None  # not on this machine yet, or refused by the causal-LM rule
    text = config.get_text_config()
    key, name = f"sequence_parallel_size: {n}", recipe.model_name_or_path
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % n:
        return f"{key}: {name} has {heads} query heads, which do not split over {n} ranks; use a divisor of {heads}"
    if kv_heads % n and n % kv_heads:
        return (
            f"{key}: {name} has {kv_heads} key/value heads; the group size and that count must divide one "
            "another (fewer kv heads than ranks are replicated)"
        )
    layer_types = getattr(text, "layer_types", None)
    windowed = (
        any(kind != "full_attention" for kind in layer_types)
        if layer_types is not None
        else bool(getattr(text, "sliding_window", None)) and getattr(text, "use_sliding_window", True)
    )
    if windowed:
        return (
            f"{key}: {name} has sliding-window or chunked attention layers; the split attends to the whole causal "
            "prefix and would lose the window: set sequence_parallel_size: 1"
        )
    if expert_count(text) and (aux := router_aux_loss_coefficient(text, recipe.router_aux_loss_coef)):
        return (
            f"{key}: {name} is a mixture of experts whose router's load-balancing loss is on ({aux}); that loss "
            "multiplies two means over all of a row's tokens, which the split does not gather: set "
            "router_aux_loss_coef: 0 (or sequence_parallel_size: 1)"
        )
    return None
