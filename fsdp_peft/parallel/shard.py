"""The sharding step: how the model a recipe built becomes the model each rank trains, in order, in one place.

Trainer prepares the model inside its private ``_prepare_for_training`` (accelerate wraps it there: FSDP2's
``fully_shard`` per unit, or FSDP1; XLA FSDP on TPUs); `fsdp_peft.procedures.trainer.PeftFsdpMixin` overrides that hook
with one call to `shard`, which runs Trainer's preparation as its middle step. What is decided earlier is said where it
is: the model and its adapters (`fsdp_peft.model.modeling.build_model`), the FSDP settings
(`fsdp_peft.settings.fsdp_settings`), the CPU mode (`fsdp_peft.parallel.cpu_fsdp`), what TRL's trainers add and undo
(`fsdp_peft.procedures.trainer.ReferenceWithoutCopy`).
"""

from __future__ import annotations

from typing import Callable, TypeVar

from fsdp_peft.core._compat.accelerate_patches import context_parallel_hooks_skipped, originals_released_while_sharding
from fsdp_peft.core._compat.transformers_patches import trainer_peft_update_skipped, xla_fsdp_optimizer_created
from fsdp_peft.core.log import logger
from fsdp_peft.core.xla import expose_generate, prepare_for_xla_fsdp, sharding_summary
from fsdp_peft.model.loading import weights_loaded_after_sharding
from fsdp_peft.parallel.fsdp_layout import is_sharded
from fsdp_peft.parallel.fsdp_policies import configure_fsdp_for_peft, decoder_layer_classes, register_generate

Prepared = TypeVar("Prepared")


def shard(trainer, prepare: Callable[[], Prepared]) -> Prepared:
    """Shard ``trainer.model`` with ``prepare`` (Trainer's own preparation) as the wrapping step; returns its result.

    1. Units and policies: each decoder layer a unit (FSDP1: each adapter too, apart from the frozen weights), the
       mixed-precision policy that gathers in the 4-bit quant storage dtype and reduces in ``fsdp_reduce_dtype``
       (`fsdp_peft.parallel.fsdp_policies.configure_fsdp_for_peft`); on TPUs, XLA FSDP's per-layer wrapping.
    2. Wrapping: Trainer's preparation, with transformers' FSDP1 PEFT update skipped (it would replace step 1's
       policies), XLA FSDP's optimizer created after the wrap, and, for low-memory loading, the weights streamed
       from rank 0 into the shards right after accelerate shards the weightless skeleton; otherwise each unit's
       unsharded weights are freed as it is sharded (accelerate would hold them all until it returns). With sequence
       parallelism the mesh is accelerate's (data x sequence, `fsdp_peft.parallel.sequence_parallel`), without the
       ring-attention hooks accelerate would attach (they drop every attention mask).
    3. ``generate`` registered as an FSDP forward method (sharded sampling gathers each unit as forward does).
    """
    model = trainer.model
    if trainer.is_fsdp_enabled and not is_sharded(model):
        configure_fsdp_for_peft(model, trainer.accelerator, trainer.fsdp_reduce_dtype, trainer.head_read_directly)
    if trainer.is_fsdp_xla_enabled:
        prepare_for_xla_fsdp(model, trainer.args, decoder_layer_classes(model))
    with (
        trainer_peft_update_skipped(),
        xla_fsdp_optimizer_created(trainer),
        context_parallel_hooks_skipped(trainer.accelerator),
        originals_released_while_sharding(),
        weights_loaded_after_sharding(model, trainer.accelerator),
    ):
        prepared = prepare()
    register_generate(trainer.model)
    if trainer.is_fsdp_xla_enabled:
        expose_generate(trainer.model)
        logger.info(sharding_summary(trainer.model, trainer.args.fsdp_config))
    return prepared
