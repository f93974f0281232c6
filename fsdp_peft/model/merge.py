"""The merge of a LoRA adapter (every variant fsdp-peft trains) into its base's tensors, in torch alone.

`adapter_updates` reads an adapter's tensors (peft names) and config into one `WeightUpdate` per base
tensor; `WeightUpdate.apply` gives the merged tensor, in peft's ``merge_and_unload`` order. The streaming
export (`fsdp_peft.tools.export`) runs on this module and torch only: no peft, transformers model code or
bitsandbytes is imported to merge.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.model.model_record import NewTokens
from fsdp_peft.model.new_tokens import with_new_rows

FROM_BASE_WEIGHTS = ("pissa", "olora", "loftq")  # initialisations that read (and change) the base weights


def init_reads_base_weights(value: str) -> bool:
    """PiSSA (any ``pissa_niter_N``), OLoRA and LoftQ derive the adapter from the base weights."""
    return value.split("_niter_")[0] in FROM_BASE_WEIGHTS


@dataclass
class WeightUpdate:
    """What an adapter does to one base tensor, in peft's ``merge_and_unload`` order: the LoRA delta
    (``scale * B @ A``, transposed for an embedding), then DoRA's magnitude over the row norms of
    ``W + delta``; or the trained copy of a ``modules_to_save`` module; or trained token rows."""

    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    embedding: bool = False
    scale: float = 1.0
    magnitude: torch.Tensor | None = None
    replacement: torch.Tensor | None = None
    token_indices: list[int] = field(default_factory=list)
    token_rows: torch.Tensor | None = None
    grown: NewTokens | None = None  # new tokens grew this tensor's rows (`fsdp_peft.model.new_tokens`)
    experts: int = 0  # LoRA on a stack of experts ``[experts, out, in]``: one A/B pair per expert (peft ParamWrapper)

    def delta_shape(self) -> tuple[int, ...]:
        rows, columns = self.lora_b.shape[0], self.lora_a.shape[1]
        if self.experts:
            return (self.experts, rows, columns)
        return (columns, rows) if self.embedding else (rows, columns)

    def expert_delta(self) -> torch.Tensor:
        """``scale * B_e @ A_e`` for every expert, as peft's ``ParamWrapper.get_delta_weight`` forms it: A's rows are
        expert-major ``[experts x r, in]``, B's columns rank-major ``[out, r x experts]``."""
        a = self.lora_a.float().reshape(self.experts, -1, self.lora_a.shape[-1])
        b = self.lora_b.float().reshape(self.lora_b.shape[0], -1, self.experts)
        return torch.einsum("o r e, e r i -> e o i", b, a) * self.scale

    def apply(self, weight: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
        """The merged fp32 tensor for base tensor ``weight`` (left unchanged): peft's operations, each in place
        on one fp32 buffer. With ``scratch`` the result lives in its reused buffers, valid until the next call."""
        if self.replacement is not None:
            return self.replacement.float()
        scratch = scratch or Scratch()
        if self.grown is not None:  # the base tensor as the run grew it: new rows the mean of the old ones
            weight = with_new_rows(weight, self.grown.ids, self.grown.rows)
        merged = scratch.take("merged", weight.shape).copy_(weight)
        if self.experts:
            return merged.add_(self.expert_delta())
        if self.lora_a is not None:
            rows, columns = self.lora_b.shape[0], self.lora_a.shape[1]
            delta = torch.matmul(self.lora_b.float(), self.lora_a.float(), out=scratch.take("delta", (rows, columns)))
            merged.add_((delta.T if self.embedding else delta).mul_(self.scale))
            if self.magnitude is not None:  # DoRA: the norm is taken of W + delta, as peft's merge_safe does
                norm = torch.linalg.norm(merged, dim=1)
                merged.mul_((self.magnitude.float() / norm).view(-1, 1))
        if self.token_rows is not None:
            merged.index_copy_(0, torch.tensor(self.token_indices), self.token_rows.float())
        return merged


class Scratch:
    """fp32 work buffers reused from one tensor's merge to the next. A fresh full-size tensor costs more in
    page faults than the merge's arithmetic (docs/compat.md#elsewhere-in-the-package), and the memory is the same:
    one merged tensor and one delta."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape) -> torch.Tensor:
        count = math.prod(shape)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < count:
            buffer = self.buffers[name] = torch.empty(count, dtype=torch.float32)
        return buffer[:count].view(shape)


def _pattern_value(pattern: dict, module: str, default: float) -> float:
    """peft's pattern lookup (``get_pattern_key``): the first key matching the end of the module name."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _token_indices(config: dict, module: str) -> list[int]:
    indices = config.get("trainable_token_indices") or []
    if isinstance(indices, dict):
        indices = next((v for k, v in indices.items() if re.match(rf"(.*\.)?({k})$", module)), [])
    return list(indices)


# peft's LoRA on parameters: one wrapper per adapted parameter of a module, nested (`expert_updates`)
PARAMETER_WRAPPER_KEY = re.compile(r"(.+?)((?:\.base_layer)*)\.lora_(A|B)(?:\.weight)?")


def expert_updates(
    tensors: dict[str, torch.Tensor], config: dict, origin, base_shapes: dict[str, tuple] | None
) -> dict[str, WeightUpdate]:
    """The updates of peft's LoRA on parameters (``target_parameters``: a mixture of experts' 3D weights), taken out
    of ``tensors``. peft nests one wrapper per adapted parameter of a module, so the adapter names a wrapper
    (``experts``, ``experts.base_layer``, ...), not the parameter: each is matched to the base parameter of its module
    whose shape, ``[experts, out, in]``, its A and B fit (``base_shapes``: every base tensor's shape)."""
    holders = {target.rpartition(".")[0] for target in config.get("target_parameters") or ()}  # "mlp.experts"
    wrappers: dict[str, dict[str, torch.Tensor]] = {}
    for key in list(tensors) if holders and base_shapes is not None else ():
        match = PARAMETER_WRAPPER_KEY.fullmatch(key)
        if match is None or f"{match[1]}.weight" in base_shapes:  # a Linear layer's LoRA
            continue
        if any(not holder or match[1] == holder or match[1].endswith(f".{holder}") for holder in holders):
            wrappers.setdefault(f"{match[1]}{match[2]}", {})[match[3]] = tensors.pop(key)
    updates: dict[str, WeightUpdate] = {}
    for wrapper, pair in wrappers.items():
        if set(pair) != {"A", "B"}:
            raise ConfigError(f"{origin}: adapter has an incomplete LoRA pair (A, B) for {wrapper}")
        module = wrapper.split(".base_layer")[0]
        a, b = pair["A"], pair["B"]
        fits = [
            key
            for key, shape in (base_shapes or {}).items()
            if key.rsplit(".", 1)[0] == module
            and len(shape) == 3
            and tuple(shape[1:]) == (b.shape[0], a.shape[1])
            and a.shape[0] % shape[0] == 0
        ]
        if len(fits) != 1:
            found = "no" if not fits else f"{len(fits)}"
            raise ConfigError(
                f"{origin}: the LoRA on parameters of {wrapper} ({list(b.shape)} @ {list(a.shape)}) fits {found} "
                f"[experts, {b.shape[0]}, {a.shape[1]}] parameter of {module} in the base (wrong --base?)"
            )
        r = a.shape[0] // base_shapes[fits[0]][0]
        alpha = _pattern_value(config.get("alpha_pattern") or {}, fits[0], config["lora_alpha"])
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        updates[fits[0]] = WeightUpdate(lora_a=a, lora_b=b, scale=scale, experts=base_shapes[fits[0]][0])
    return updates


def _inside(module: str, saved: tuple[str, ...]) -> bool:
    """Whether module path ``module`` is one of ``saved`` (peft's ``modules_to_save`` names, matched as a suffix)
    or inside one (a trained copy's submodules: Qwen2.5-VL's projector ``merger.mlp.0``)."""
    parts = module.split(".")
    return any(".".join(parts[: i + 1]).endswith(name) for name in saved for i in range(len(parts)))


def adapter_updates(
    tensors: dict[str, torch.Tensor],
    config: dict,
    origin,
    new_tokens: NewTokens | None = None,
    base_shapes: dict[str, tuple] | None = None,
) -> dict[str, WeightUpdate]:
    """``{base tensor key: WeightUpdate}`` from an adapter's tensors (peft names, prefix removed); ``new_tokens``:
    the tensors the run grew; ``base_shapes``: the base's tensor shapes, which LoRA on parameters needs."""
    tensors = dict(tensors)
    updates: dict[str, WeightUpdate] = expert_updates(tensors, config, origin, base_shapes)
    for key in new_tokens.grown if new_tokens is not None else ():
        updates.setdefault(key, WeightUpdate()).grown = new_tokens
    saved_modules = tuple(config.get("modules_to_save") or ())
    for key, tensor in tensors.items():
        if match := re.fullmatch(r"(.+)\.lora_(A|B|embedding_A|embedding_B)(?:\.weight)?", key):
            update = updates.setdefault(f"{match[1]}.weight", WeightUpdate())
            update.embedding = match[2].startswith("embedding")
            if match[2].endswith("A"):
                update.lora_a = tensor
            else:
                update.lora_b = tensor
        elif match := re.fullmatch(r"(.+)\.lora_magnitude_vector(?:\.weight)?", key):
            updates.setdefault(f"{match[1]}.weight", WeightUpdate()).magnitude = tensor
        elif match := re.fullmatch(r"(.+)\.token_adapter\.trainable_tokens_delta", key):
            update = updates.setdefault(f"{match[1]}.weight", WeightUpdate())
            update.token_rows, update.token_indices = tensor, _token_indices(config, match[1])
        elif (match := re.fullmatch(r"(.+?)(?:\.modules_to_save)?\.(\w+)", key)) and _inside(match[1], saved_modules):
            updates.setdefault(f"{match[1]}.{match[2]}", WeightUpdate()).replacement = tensor
        else:
            raise ConfigError(f"{origin}: adapter tensor '{key}' is none of the LoRA variants export merges")
    for name, update in updates.items():
        module = name.rsplit(".", 1)[0]
        if (update.lora_a is None) != (update.lora_b is None) or (
            update.magnitude is not None and update.lora_a is None
        ):
            raise ConfigError(f"{origin}: adapter has an incomplete LoRA pair (A, B, magnitude) for {name}")
        if update.magnitude is not None and update.embedding:
            raise ConfigError(f"{origin}: DoRA on an embedding layer ({module}) is not supported by export yet")
        if update.token_rows is not None and len(update.token_indices) != update.token_rows.shape[0]:
            raise ConfigError(f"{origin}: trainable_token_indices of {module} do not match its trained rows")
        if update.lora_a is not None and not update.experts:
            r = update.lora_a.shape[0]
            alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
            update.scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return updates
