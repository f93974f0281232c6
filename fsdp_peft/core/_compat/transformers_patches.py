"""transformers' Trainer and models, patched where they break PEFT under FSDP."""

from __future__ import annotations

import contextlib
import warnings

from fsdp_peft.core._compat.registry import _source_of, patch


@patch(
    "transformers",
    still_needed=lambda: "update_fsdp_plugin_peft(" in _source_of("transformers.trainer:Trainer._prepare_for_training"),
)
@contextlib.contextmanager
def trainer_peft_update_skipped():
    """Replaces ``transformers.trainer.update_fsdp_plugin_peft`` with a no-op while Trainer prepares the model.

    Why: Trainer calls it on the FSDP1 path only, after fsdp-peft set the PEFT-aware policies
    (`fsdp_peft.parallel.fsdp_policies.configure_fsdp_for_peft`), and would replace them with peft's lambda policy.
    Upstream: transformers 5.24 calls it only when ``delay_optimizer_creation`` (FSDP1).
    Remove when: transformers applies the same PEFT-aware policies under both FSDP versions.
    """
    import transformers.trainer  # lazy: patch target, resolved when patched

    original = transformers.trainer.update_fsdp_plugin_peft
    transformers.trainer.update_fsdp_plugin_peft = lambda model, accelerator: None
    try:
        yield
    finally:
        transformers.trainer.update_fsdp_plugin_peft = original


def _vision_models_refusing_loss_kwargs() -> bool:
    from transformers import Qwen2_5_VLForConditionalGeneration  # lazy: only vision runs need it

    return Qwen2_5_VLForConditionalGeneration.accepts_loss_kwargs is False


@patch("transformers", still_needed=_vision_models_refusing_loss_kwargs)
def loss_counts_every_ranks_tokens(trainer, vision: bool) -> None:
    """Sets ``trainer.model_accepts_loss_kwargs`` when ``vision`` (the model is a vision-language model of a known
    family) and its class says it takes no loss kwargs.

    Why: transformers 5.24's Qwen2.5-VL sets ``accepts_loss_kwargs = False`` although its forward hands ``**kwargs``
    on to ``self.loss_function``; Trainer then passes no ``num_items_in_batch``, each rank divides by its own
    labelled tokens, and 2 ranks whose rows differ in answer length train other gradients than one process on the
    same rows when the rows' answer lengths differ (docs/compat.md#the-measurements).
    Remove when: the class no longer sets the attribute to False.
    """
    model = trainer.accelerator.unwrap_model(trainer.model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if vision and getattr(type(base), "accepts_loss_kwargs", True) is False:
        trainer.model_accepts_loss_kwargs = True


@patch("transformers")
@contextlib.contextmanager
def xla_fsdp_optimizer_created(trainer):
    """Replaces ``trainer._wrap_model`` (on this instance) by one that, under XLA FSDP, creates the optimizer
    for the wrapped model when Trainer has none yet.

    Why: under XLA FSDP (v1 and v2) ``Trainer._prepare_for_training`` delays optimizer creation until the
    model is wrapped, but since transformers 5.3 ``_wrap_model`` no longer assigns the wrapped model to
    ``self.model``, so the branch that creates it is skipped and ``create_scheduler`` fails with
    ``'NoneType' object has no attribute 'param_groups'``. transformers 5.2 ran unpatched; 5.24 needs it
    (tests/xla/test_xla_recipes.py checks both: needed, and applied).
    Remove when: Trainer creates the delayed optimizer after XLA FSDP wrapping again.
    """
    original = trainer._wrap_model

    def wrap_then_create_optimizer(model, *args, **kwargs):
        wrapped = original(model, *args, **kwargs)
        if trainer.is_fsdp_xla_enabled and trainer.optimizer is None and wrapped is not trainer.model:
            trainer.create_optimizer(wrapped)
        return wrapped

    trainer._wrap_model = wrap_then_create_optimizer
    try:
        yield
    finally:
        del trainer._wrap_model


CHECKPOINTING_ALIAS_WARNING = "`is_gradient_checkpointing` is deprecated"  # transformers 5.24's FutureWarning


@contextlib.contextmanager
def checkpointing_alias_quiet():
    """Inside, transformers' FutureWarning for the deprecated ``is_gradient_checkpointing`` alone is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=CHECKPOINTING_ALIAS_WARNING, category=FutureWarning)
        yield
