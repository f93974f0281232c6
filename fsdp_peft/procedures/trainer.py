"""The recipes' `Trainer`: Hugging Face's own, plus FSDP for PEFT, FSDP on CPU, and adapter saving."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from fsdp_peft.core._compat.accelerate_patches import fsdp1_adapter_checkpoints
from fsdp_peft.core._compat.torch_patches import fsdp2_accumulation_skips_ungathered_parameters
from fsdp_peft.core._compat.transformers_patches import loss_counts_every_ranks_tokens
from fsdp_peft.core._compat.trl_patches import trl_without_the_checkpointing_warning
from fsdp_peft.core.atomic_publish import publish_directory
from fsdp_peft.core.dtypes import trainable_dtypes_kept
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import logger
from fsdp_peft.core.xla import (
    load_spmd_checkpoint,
    unwrap_xla_fsdp,
    xla_trainable_state_dict,
)
from fsdp_peft.model.adapter_files import RECIPE_FILE, write_base_record
from fsdp_peft.model.loading import pending_checkpoint
from fsdp_peft.model.loss import causal_lm_of, chunked_loss_unavailable, head_computes_loss
from fsdp_peft.model.moe import RouterAuxLoss, router_aux_loss_weight
from fsdp_peft.model.new_tokens import config_before_growth, write_new_tokens
from fsdp_peft.model.variants import converted_adapter_config, peft_adapter_tensors
from fsdp_peft.parallel.cpu_fsdp import (
    cpu_fsdp_requested,
    enable_cpu_fsdp,
    parallelism_config_held_back,
    skip_sync_module_states,
)
from fsdp_peft.parallel.fsdp_layout import FsdpLayoutReport, unit_name
from fsdp_peft.parallel.sequence_parallel import sequence_parallel_mesh, split_for_training, tokens_counted_once
from fsdp_peft.parallel.shard import shard
from fsdp_peft.procedures.eval_loss import HeldOutLoss
from fsdp_peft.procedures.memory import MemoryReport
from fsdp_peft.settings.families import family_of_model
from fsdp_peft.settings.fsdp_settings import fsdp_settings
from fsdp_peft.tools.runs import Run, RunBegins


class PeftFsdpMixin:
    """FSDP settings for PEFT, real FSDP in the CPU mode, complete checkpoints and adapter saving.

    Mixed in before `transformers.Trainer` or a trainer built on it (TRL's `DPOTrainer`, `KTOTrainer`,
    `GRPOTrainer`): the recipes' trainers share this one behaviour (`PeftFsdpTrainer`,
    `fsdp_peft.procedures.trainer.trl_trainer`: TRL's trainers, GRPO's with `fsdp_peft.procedures.rl.GatheredRollouts`).
    """

    head_read_directly = False  # the loss reads the output head's weight without calling it (TRL's fused head)

    def __init__(
        self,
        *args,
        fsdp_reduce_dtype: torch.dtype = torch.float32,
        loss_chunk_tokens: int = 0,
        sequence_parallel_size: int = 1,
        recipe_config: dict | None = None,
        run: Run | None = None,
        callbacks=None,
        **kwargs,
    ):
        self.fsdp_reduce_dtype = fsdp_reduce_dtype
        self.loss_chunk_tokens = loss_chunk_tokens
        self.sequence_parallel_size = sequence_parallel_size
        self.recipe_config = recipe_config or {}
        self.run_id = run.run_id if run is not None else None
        # The run's start becomes final at its first optimizer step (fsdp_peft.tools.runs); the layout report goes
        # last: its forward hooks should only see training forwards.
        begins = [RunBegins(run)] if run is not None else []
        callbacks = [*begins, *(callbacks or []), MemoryReport(), FsdpLayoutReport()]
        if kwargs.get("eval_dataset") is not None and self.recipe_config.get("max_eval_samples"):
            kwargs["eval_dataset"] = first_rows(kwargs["eval_dataset"], self.recipe_config["max_eval_samples"])
        super().__init__(*args, callbacks=callbacks, **kwargs)
        # FSDP1 flat parameters hide these names once the model is wrapped: remember them now.
        self.trainable_parameter_names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        if loss_chunk_tokens and (reason := chunked_loss_unavailable(causal_lm_of(self.model), self.args)):
            logger.info(f"loss_chunk_tokens: the model's own loss on full logits is used: {reason}")
            self.loss_chunk_tokens = 0

    def create_accelerator_and_postprocess(self):
        if self.sequence_parallel_size > 1:
            self.args.parallelism_config = sequence_parallel_mesh(self.sequence_parallel_size, self.args.world_size)
        if cpu_fsdp_requested(self.args):
            skip_sync_module_states(self.args)
        with parallelism_config_held_back(self.args):
            super().create_accelerator_and_postprocess()
        if enable_cpu_fsdp(self.accelerator, self.args):
            self.is_fsdp_enabled = True

    def _move_model_to_device(self, model, device):
        if pending_checkpoint(model) is None:  # a low-memory skeleton gets its weights, on device, from FSDP
            super()._move_model_to_device(model, device)

    def _prepare_for_training(self, *args, **kwargs):
        """Trainer's preparation as the middle of the sharding step (`fsdp_peft.parallel.shard`)."""
        return shard(self, lambda: super(PeftFsdpMixin, self)._prepare_for_training(*args, **kwargs))

    def _prepare_context_parallel_inputs(self, model, inputs):
        """A Ulysses split of each row over the sequence group (`fsdp_peft.parallel.sequence_parallel`)."""
        return split_for_training(self, model, inputs)

    def _track_num_input_tokens(self, inputs):
        """Trainer's count of the tokens trained on, a sequence group's rows counted once."""
        tokens_counted_once(self, lambda: super(PeftFsdpMixin, self)._track_num_input_tokens(inputs))

    def _save_checkpoint(self, model, trial):
        """Trainer's checkpoint, made visible only when complete, plus adapter config and recipe for export.

        Every rank writes into ``.checkpoint-N.partial`` beside the run's checkpoints; once all are done,
        rank 0 renames it to ``checkpoint-N``. A crash mid-save leaves only the hidden directory, which
        Trainer's checkpoint discovery (``checkpoint-<number>``) never picks.
        """
        run_dir = Path(self._get_output_dir(trial=trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging_run = run_dir / f".{name}.partial"
        final = run_dir / name
        if self.args.should_save and staging_run.exists():  # left by a crash during this same save
            shutil.rmtree(staging_run)
        self.accelerator.wait_for_everyone()
        original = self._get_output_dir
        self._get_output_dir = lambda trial=None: str(staging_run)
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._get_output_dir = original
        if self.args.should_save:
            write_adapter_metadata(self.unwrapped_model(), self.recipe_config, staging_run / name)
            layout = {**run_layout(self.args, self.sequence_parallel_size), "run_id": self.run_id}
            (staging_run / name / LAYOUT_FILE).write_text(json.dumps(layout, indent=1))
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            if final.exists():
                shutil.rmtree(final)
            os.rename(staging_run / name, final)
            shutil.rmtree(staging_run)
            if self.state.best_model_checkpoint and str(staging_run) in self.state.best_model_checkpoint:
                self.state.best_model_checkpoint = str(final)
            rotate_checkpoints(
                output_dir=str(run_dir),
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()

    def unwrapped_model(self):
        """The `PeftModel`: accelerate unwraps torch FSDP; XLA FSDP's wrappers are taken off here."""
        return unwrap_xla_fsdp(self.accelerator.unwrap_model(self.model))

    def train(self, *args, **kwargs):
        """Trainer's training, with FSDP1 checkpoints that hold the adapter. (Checkpoints a crash left
        half-written, hidden ``.checkpoint-N.partial``, are replaced by the run's start: `fsdp_peft.tools.runs`.)"""
        adapter = getattr(self.model, "active_adapter", "default")
        with fsdp1_adapter_checkpoints(self.trainable_parameter_names, adapter):
            return super().train(*args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """XLA FSDP v2 checkpoints hold the wrapped model's names: `load_spmd_checkpoint` unwraps them."""
        if self.is_fsdp_xla_v2_enabled:
            return load_spmd_checkpoint(model if model is not None else self.model, resume_from_checkpoint)
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _run_epoch(self, *args, **kwargs):
        """Nothing left to train (resumed from a checkpoint at ``max_steps``): Trainer would take one more step."""
        if 0 < self.state.max_steps <= self.state.global_step:
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)

    def save_adapter(self, directory: str | os.PathLike) -> Path:
        """Save the trained adapter in PEFT format, gathered from all shards; collective on every rank.

        Trainer's own ``save_model`` writes nothing under ``SHARDED_STATE_DICT``. Only trainable
        parameters are gathered, an adapter missing any of them is refused, and the directory appears
        only once complete (written beside it, then renamed).
        """
        directory = Path(directory)
        offload = self.args.device.type != "cpu"
        if self.is_fsdp_xla_enabled:
            state_dict = xla_trainable_state_dict(self.model, self.trainable_parameter_names)
        else:
            state_dict = gather_trainable_state_dict(self.model, self.trainable_parameter_names, offload)
        if self.args.should_save:
            with publish_directory(directory, replace=True) as staging:
                write_adapter(self.unwrapped_model(), state_dict, staging)
                write_adapter_metadata(self.unwrapped_model(), self.recipe_config, staging)
                converted_adapter_config(self.unwrapped_model()).save_pretrained(staging)
        if dist.is_initialized():
            dist.barrier()
        return directory


def first_rows(rows, count: int):
    """The first ``count`` rows of a `datasets.Dataset` or a map-style torch dataset (``max_eval_samples``), before a
    trainer prepares them: every evaluation's loss (and DPO/KTO's held-out scores) is computed on these."""
    count = min(count, len(rows))
    return rows.select(range(count)) if hasattr(rows, "select") else torch.utils.data.Subset(rows, range(count))


class PeftFsdpTrainer(PeftFsdpMixin, Trainer):
    """`transformers.Trainer` with FSDP settings for PEFT, real FSDP in the CPU mode, adapter saving."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        vision = family_of_model(causal_lm_of(self.model)).vision is not None
        loss_counts_every_ranks_tokens(self, vision)  # a vision-language model's loss: every rank's tokens
        self.router_aux_loss = RouterAuxLoss(router_aux_loss_weight(causal_lm_of(self.model)))

    held_out: HeldOutLoss | None = None  # the evaluation under way, if any

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        """Trainer's loop, whose loss figure is replaced by the held-out tokens' mean cross-entropy
        (`fsdp_peft.procedures.eval_loss`): the same on any number of ranks and for any evaluation batch size."""
        loss_only = prediction_loss_only if prediction_loss_only is not None else self.args.prediction_loss_only
        self.held_out = HeldOutLoss(dataloader, drops_fill=loss_only and "inputs" not in self.args.include_for_metrics)
        try:
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix=metric_key_prefix
            )
        finally:
            held_out, self.held_out = self.held_out, None
        loss = held_out.mean()
        if loss is not None:
            output.metrics[f"{metric_key_prefix}_loss"] = loss
        return output

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Training steps take the chunked loss (`fsdp_peft.model.loss`) when ``loss_chunk_tokens`` is set; evaluation,
        which returns logits, keeps the model's own. A MoE router's auxiliary loss counts once per optimizer step
        (`fsdp_peft.model.moe.RouterAuxLoss`). In an evaluation the rows accelerate repeats to fill the last batch go
        unlabelled and each forward's mean token loss, the router's term taken out, is counted (`HeldOutLoss`)."""
        if self.held_out is not None and not model.training and "labels" in inputs:
            inputs = self.held_out.without_fill(inputs)
            # no item count: the mean over these tokens; a copy, as the label smoother pops the labels
            loss, outputs = super().compute_loss(model, dict(inputs), True)
            model_loss = self.label_smoother is None and self.compute_loss_func is None  # with the router's term
            aux = getattr(outputs, "aux_loss", None) if model_loss else None
            self.held_out.add(self.router_aux_loss.without_aux(loss, aux), inputs)
            return (loss, outputs) if return_outputs else loss
        chunked = self.loss_chunk_tokens and not return_outputs and "labels" in inputs and not self.compute_loss_func
        labels, shift_labels = inputs.get("labels"), inputs.get("shift_labels")
        items = num_items_in_batch if self.model_accepts_loss_kwargs else None  # as the model's own loss sees it
        chunks = head_computes_loss(causal_lm_of(model), labels, self.loss_chunk_tokens, items, shift_labels)
        with chunks if chunked else contextlib.nullcontext():
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        if model.training and items is not None:  # Trainer leaves this loss undivided by the accumulation
            scale = self.accelerator.num_processes if self.args.average_tokens_across_devices else 1
            accumulation = self.current_gradient_accumulation_steps
            loss = self.router_aux_loss.corrected(loss, getattr(outputs, "aux_loss", None), scale, accumulation)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict, *args, **kwargs):
        """Training logs gain the router's auxiliary loss (mean over the forwards since the last log and the ranks)."""
        if "loss" in logs and self.router_aux_loss.weight:
            mean = torch.tensor(self.router_aux_loss.pop_mean() or 0.0, dtype=torch.float64)
            if dist.is_initialized():
                mean = mean.to(self.args.device)
                dist.all_reduce(mean)
                mean = mean / dist.get_world_size()
            logs["aux_loss"] = round(float(mean), 6)
        super().log(logs, *args, **kwargs)


LAYOUT_FILE = "fsdp_peft_layout.json"


def run_layout(args, sequence_parallel_size: int = 1) -> dict:
    """What a sharded checkpoint depends on: world size, global batch (data position), FSDP version. A sequence
    group's ranks hold the same rows: the global batch counts each group once."""
    settings = fsdp_settings(args)
    version = settings.version if settings is not None else None
    world, per_device, accumulation = (
        args.world_size,
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
    )
    return {
        "world_size": world,
        "sequence_parallel_size": sequence_parallel_size,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accumulation,
        "global_batch_size": max(world // sequence_parallel_size, 1) * per_device * accumulation,
        "fsdp_version": version,
    }


def _describe(layout: dict) -> str:
    fsdp = f"FSDP{layout['fsdp_version']}" if layout["fsdp_version"] else "no FSDP"
    split = layout.get("sequence_parallel_size", 1)
    ranks = f"{layout['world_size']} ranks" + (f" ({split} to a row)" if split > 1 else "")
    return (
        f"{fsdp}, global batch {layout['global_batch_size']} = {ranks} x "
        f"{layout['per_device_train_batch_size']} per device x {layout['gradient_accumulation_steps']} accumulation"
    )


def check_resumable(checkpoint: Path, args, run_id: str | None = None, sequence_parallel_size: int = 1) -> None:
    """Refuse, before any weights load, a resume that cannot continue the run exactly.

    Another world size is fine (FSDP2 sharded state is resharded on load) as long as the global batch
    stays the same: Trainer finds its data position by counting batches. A different FSDP version
    cannot read the sharded state at all.
    """
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise ConfigError(f"resume_from_checkpoint: {checkpoint} is not a directory")
    if not (checkpoint / LAYOUT_FILE).is_file():
        return  # not written by fsdp-peft: Trainer's own checks apply
    saved, current = json.loads((checkpoint / LAYOUT_FILE).read_text()), run_layout(args, sequence_parallel_size)
    auto = str(args.resume_from_checkpoint).lower() in ("auto", "true")
    if auto and run_id and saved.get("run_id") not in (None, run_id):
        raise ConfigError(
            f"resume_from_checkpoint: auto: {checkpoint} belongs to run {saved['run_id']}, not to this run ({run_id}) "
            "recorded in its output_dir; name the checkpoint to resume it explicitly, or choose another output_dir"
        )
    where = (
        f"resume_from_checkpoint: {checkpoint} was written with {_describe(saved)}; this run has {_describe(current)}"
    )
    if saved["fsdp_version"] != current["fsdp_version"]:
        wanted = f"FSDP{saved['fsdp_version']} (e.g. configs/accelerate/cpu_fsdp{saved['fsdp_version']}.yaml)"
        raise ConfigError(f"{where}. Its sharded state is only readable under {wanted}: relaunch with that")
    if saved["global_batch_size"] != current["global_batch_size"]:
        groups = max(current["world_size"] // current["sequence_parallel_size"], 1)
        per_rank, left = divmod(saved["global_batch_size"], groups * current["gradient_accumulation_steps"])
        fix = f"--per_device_train_batch_size {per_rank}" if per_rank and not left else "the same global batch"
        raise ConfigError(
            f"{where}. Resuming would change which examples every remaining step sees; keep the global batch: {fix}"
        )


def write_adapter(peft_model, state_dict: dict[str, torch.Tensor], directory: Path) -> None:
    """Write ``state_dict`` as the active adapter in PEFT's format (``PeftModel.from_pretrained`` reads it).

    peft's own ``save_pretrained`` selects adapter tensors by the model's module names, which FSDP1
    wrappers change; the keys here are already the unwrapped names, renamed as peft names them
    (`fsdp_peft.model.variants.peft_adapter_tensors`).
    """
    tensors = peft_adapter_tensors(peft_model, state_dict)
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    peft_model.create_or_update_model_card(str(directory))


def write_adapter_metadata(peft_model, recipe_config: dict, directory: Path) -> None:
    """``adapter_config.json``, the recipe config and the base's record, next to adapter weights (final or
    sharded): what export and generate need to rebuild, and check, the model it was trained as."""
    peft_model.peft_config[peft_model.active_adapter].save_pretrained(directory)
    (directory / RECIPE_FILE).write_text(json.dumps(recipe_config, indent=1, sort_keys=True, default=str))
    write_base_record(config_before_growth(peft_model), directory)
    write_new_tokens(peft_model, directory)  # new tokens: the grown tokenizer and what grew


def gather_trainable_state_dict(
    model: torch.nn.Module, expected: list[str], offload_to_cpu: bool
) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of the ``expected`` trainable parameters, keyed by the unwrapped names.

    FSDP2 and plain models go through ``torch.distributed.checkpoint``; FSDP1 flat parameters hide
    their original parameters from it, so each trainable unit (the policy gives every adapter leaf
    its own) is gathered on its own. Collective: every rank must call it.
    """
    if not isinstance(model, FSDP):
        options = StateDictOptions(full_state_dict=True, cpu_offload=offload_to_cpu, ignore_frozen_params=True)
        state_dict = get_model_state_dict(model, options=options)
    else:
        state_dict = {}
        for name, unit in model.named_modules():
            flat = getattr(unit, "_flat_param", None) if isinstance(unit, FSDP) else None
            if flat is None or not flat.requires_grad:
                continue
            with FSDP.summon_full_params(unit, recurse=False, writeback=False, offload_to_cpu=offload_to_cpu):
                for param_name, parameter in unit.module.named_parameters():
                    if "_fsdp_wrapped_module" not in param_name and "_flat_param" not in param_name:
                        state_dict[unit_name(f"{name}.{param_name}")] = parameter.detach().clone().cpu()
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise RuntimeError(
            f"gathered adapter lacks {len(missing)} trainable tensors (e.g. {missing[0]}); not saving it"
        )
    return {name: state_dict[name] for name in expected}


class ReferenceWithoutCopy:
    """For TRL's `DPOTrainer`, `KTOTrainer` and `GRPOTrainer`: the reference is the adapter-disabled policy,
    adapters as built.

    Two things their ``__init__`` does to a `PeftModel` built by `fsdp_peft.model.modeling` are undone: the
    frozen "ref" adapter it adds (a second adapter copy; with a fresh adapter the disabled adapter is the
    same reference), and the bf16 cast of a 4-bit base's adapter weights (they stay in the dtype
    `attach_lora` chose, fp32 master weights as in SFT). Their fused log-prob head leaves the output head's
    FSDP2 unit ungathered, which gradient accumulation under mixed precision needs patched
    (`fsdp_peft.core._compat.torch_patches.fsdp2_accumulation_skips_ungathered_parameters`).
    """

    head_read_directly = (
        True  # FSDP1: the head stays in the root unit (fsdp_peft.parallel.fsdp_policies.fsdp1_wrap_policy)
    )

    def __init__(self, model, *args, **kwargs):
        fsdp2_accumulation_skips_ungathered_parameters()  # TRL's fused head leaves the head's unit ungathered
        with trl_without_the_checkpointing_warning(), trainable_dtypes_kept(model):  # TRL casts adapters to bf16
            super().__init__(model, *args, **kwargs)  # (DPO may compute the reference log-probs here)
        if "ref" in self.model.peft_config:
            self.model.delete_adapter("ref")
        self.trainable_parameter_names = [n for n, p in self.model.named_parameters() if p.requires_grad]

    def compute_loss(self, *args, **kwargs):
        """TRL's loss, without the FutureWarning its reference forward raises (`fsdp_peft.core._compat`)."""
        with trl_without_the_checkpointing_warning():
            return super().compute_loss(*args, **kwargs)


@functools.cache
def trl_trainer(base: str, *mixins: type) -> type:
    """TRL's trainer class ``base`` (``DPOTrainer``, ``KTOTrainer``, ``GRPOTrainer``) with the recipes' FSDP behaviour
    (`PeftFsdpMixin`), the adapter-disabled policy as its reference (`ReferenceWithoutCopy`) and a procedure's own
    ``mixins`` first, built on first use: only a DPO/KTO or GRPO run imports TRL (every recipe imports the procedures'
    values through `fsdp_peft.procedures.registry`, and the TPU environment has no TRL)."""
    import trl  # lazy: TRL only where a run of its trainers starts

    return type(f"Recipes{base}", (*mixins, ReferenceWithoutCopy, PeftFsdpMixin, getattr(trl, base)), {})
