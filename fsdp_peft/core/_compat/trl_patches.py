"""TRL's trainers: their warnings about activation checkpointing under PEFT."""

from __future__ import annotations

import contextlib

from fsdp_peft.core._compat.registry import _source_of, patch
from fsdp_peft.core._compat.transformers_patches import checkpointing_alias_quiet


@patch(
    "trl",
    still_needed=lambda: "is_gradient_checkpointing" in _source_of("trl.models.utils:disable_gradient_checkpointing"),
)
@contextlib.contextmanager
def trl_without_the_checkpointing_warning():
    """Silences transformers' FutureWarning for ``is_gradient_checkpointing`` (that one alone) while TRL's trainers
    compute a loss, build (DPO: precompute reference log-probs), score held-out pairs, or make and score GRPO rollouts
    (`fsdp_peft.procedures.trainer.ReferenceWithoutCopy`, `fsdp_peft.procedures.preference.held_out_preference`,
    `fsdp_peft.procedures.rl.GatheredRollouts`).

    Why: TRL 1.16 reads the deprecated name in ``unwrap_model_for_generation`` and ``disable_gradient_checkpointing``
    around every reference forward and rollout batch, so each DPO, KTO and GRPO run printed "`is_gradient_checkpointing`
    is deprecated" on every rank, a warning no user can act on. `UPSTREAM` checks that TRL still reads the old name.
    Remove when: TRL reads ``is_activation_checkpointing``.
    """
    with checkpointing_alias_quiet():
        yield
