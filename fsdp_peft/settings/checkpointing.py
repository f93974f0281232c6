"""Activation checkpointing: how many decoder layers keep only their input for backward, and where that input lives.

``activation_checkpointing`` is ``true`` (every layer), ``false`` (none) or ``auto``, the default: the plan
(`fsdp_peft.tools.plan.choose_checkpointing`) takes the first of `candidates` (fewest layers recomputed first, then the
checkpointed inputs offloaded to host memory) whose planned peak stays under ``device_memory`` less `MARGIN`, and
`apply_checkpointing` checkpoints that many layers from the first. A config that sets ``true`` (with transformers'
own ``activation_checkpointing_kwargs``: ``every_n_layers``, ``offload``) is left to the Trainer, as ever.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

AUTO = "auto"
MARGIN = 0.10  # auto keeps the planned peak at most 90% of the device: the plan's stated accuracy on GPUs
CHECKPOINTING_KEYS = ("activation_checkpointing", "gradient_checkpointing")  # transformers 5.24's name, its alias
KWARGS_KEYS = ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")


@dataclass(frozen=True)
class Checkpointing:
    """``count`` decoder layers checkpointed: the first ones (``spacing`` 1), or every ``spacing``-th from layer 0 as
    transformers' ``every_n_layers`` places them; their inputs in host memory if ``offload``."""

    count: int
    spacing: int = 1
    offload: bool = False

    def describe(self, total: int) -> str:
        """``none``, ``all 32 layers``, ``20 of 32 layers``, ``11 of 32 layers (every 3rd)``, ``..., offloaded``."""
        if not self.count:
            return "none"
        what = f"all {total} layers" if self.count >= total else f"{self.count} of {total} layers"
        if self.spacing > 1 and self.count < total:
            what += f" (every {_ordinal(self.spacing)})"
        return what + (", inputs offloaded to host memory" if self.offload else "")

    def top(self) -> int:
        """The index of the last checkpointed layer (the first recomputed in backward)."""
        return (self.count - 1) * self.spacing


def every(total: int, offload: bool = False) -> Checkpointing:
    return Checkpointing(total, offload=offload)


NONE = Checkpointing(0)


@dataclass(frozen=True)
class CheckpointingChoice:
    """What a run checkpoints and why: the config's own setting, or the plan's choice under ``auto``."""

    checkpointing: Checkpointing
    layers: int  # the model's decoder layers
    reason: str
    by_the_recipe: bool = False  # auto: `apply_checkpointing` sets the layers; else the Trainer, from the config
    checkpoint_kwargs: dict = field(default_factory=dict)  # the config's for torch.utils.checkpoint (use_reentrant)

    def to_json(self) -> dict:
        c = self.checkpointing
        return {"layers": c.count, "of": self.layers, "spacing": c.spacing, "offload": c.offload, "reason": self.reason}

    def line(self) -> str:
        return choice_line(self.to_json())


def choice_line(record: dict) -> str:
    """The summary line of a `CheckpointingChoice.to_json` record (``results.json``'s ``activation_checkpointing``)."""
    checkpointing = Checkpointing(record["layers"], record["spacing"], record["offload"])
    return f"activation checkpointing: {checkpointing.describe(record['of'])} ({record['reason']})"


def _ordinal(n: int) -> str:
    """``2nd``, ``3rd``, ``11th``, ``21st``."""
    return f"{n}{'th' if 11 <= n % 100 <= 13 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def candidates(total: int, offload_possible: bool) -> list[Checkpointing]:
    """Every count of layers from none to all (the fastest first), then every layer with its input offloaded (where
    there is a device to offload from)."""
    counts = [Checkpointing(count) for count in range(total + 1)]
    return [*counts, every(total, offload=True)] if offload_possible else counts


def requested(training: dict, total: int) -> Checkpointing | str:
    """What the training values ask of a model with ``total`` decoder layers: `AUTO` when the config leaves
    ``activation_checkpointing`` unset or says ``auto``, else the layers its ``activation_checkpointing_kwargs``
    give (every layer by default; ``every_n_layers`` n: layers 0, n, 2n, ...)."""
    values = [training.get(key) for key in CHECKPOINTING_KEYS]
    set_values = [value for value in values if value is not None]
    if not set_values or any(str(value).lower() == AUTO for value in set_values):
        return AUTO
    if not any(set_values):
        return NONE
    kwargs = _kwargs(training)
    spacing = int(kwargs.get("every_n_layers", 1))
    return Checkpointing(math.ceil(total / spacing), spacing, bool(kwargs.get("offload", False)))


def _kwargs(training: dict) -> dict:
    """The config's ``activation_checkpointing_kwargs`` (or its deprecated alias's)."""
    return next((training[key] for key in KWARGS_KEYS if isinstance(training.get(key), dict)), {}) or {}


def checkpoint_kwargs(training: dict) -> dict:
    """The config's ``activation_checkpointing_kwargs`` that go on to ``torch.utils.checkpoint`` (``use_reentrant``)."""
    return {key: value for key, value in _kwargs(training).items() if key not in ("every_n_layers", "offload")}


def blocks(model) -> list:
    """``model``'s transformer blocks as transformers marks them (its ``GradientCheckpointingLayer``s), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer  # lazy: config and keys import this module

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def apply_checkpointing(model, choice: CheckpointingChoice) -> int:
    """Checkpoint the first ``choice`` layers of ``model`` (a PeftModel or a transformers model) with transformers'
    own machinery, the rest not; returns how many are. Only for the plan's choices: a config's own setting is the
    Trainer's to apply."""
    if not choice.by_the_recipe or not choice.checkpointing.count:
        return 0
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False, **choice.checkpoint_kwargs},
        offload=choice.checkpointing.offload,
    )
    layers = blocks(base)
    if choice.checkpointing.count < choice.layers:  # some: the first ones (all: every block, a VLM's tower too)
        for index, layer in enumerate(layers):
            layer.gradient_checkpointing = index < choice.checkpointing.count
    return sum(layer.gradient_checkpointing for layer in layers)
