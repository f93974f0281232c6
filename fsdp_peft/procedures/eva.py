"""EVA (explained variance adaptation, ``init_lora_weights: eva``) on sharded data.

EVA sets each adapter's ``lora_A`` to the top right singular vectors of the inputs its layer sees on the
training data (``lora_B`` starts at zero, so the initial model is the base). peft computes them with
``get_eva_state_dict``: forward passes with the adapters off, an incremental SVD per layer, repeated over the
batches until every layer's components stop moving (cosine similarity >= ``eva_tau``).

Here the pass runs once the `PeftModel` exists and before FSDP wraps it (accelerate wraps inside
``Trainer.train``), on every rank: each forwards its own part of each global batch, exactly as the distributed
sampler splits one, and peft all-gathers the layer inputs (rank order, so the rows are those of one process
with the whole global batch), so every rank computes the same SVD. Rank 0's result is then broadcast, so the
ranks start from bitwise the same adapter whatever the SVD kernels do. The batches are the first
``eva_batches`` global batches of a permutation of the training rows seeded by ``seed``: the same rows for
any number of ranks. The pass leaves every random number generator as it found it, and a resumed run skips it
(its checkpoint holds the trained adapter). On CPU the pass runs on one thread. Rank 0 writes the initial
``lora_A`` rows to ``output_dir/eva_init.safetensors``.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from peft.tuners.lora.eva import get_eva_state_dict, initialize_lora_eva_weights
from safetensors.torch import save_file

from fsdp_peft.core.distributed import ranks
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import logger
from fsdp_peft.tools.export import torch_threads
from fsdp_peft.tools.runs import EVA_INIT_FILE

PASSES_PER_BATCH = 50  # the pass gives up (an error) after this many forwards per distinct batch


def eva_batches(trainer, count: int, seed: int) -> list[dict]:
    """This rank's part (``per_device_train_batch_size`` rows) of each of the first ``count`` global batches
    of a seeded permutation of the training rows, collated like the Trainer's."""
    dataset = trainer._remove_unused_columns(trainer.train_dataset, description="eva")
    per_rank, world, rank = trainer.args.per_device_train_batch_size, ranks().world_size, ranks().rank
    global_size = per_rank * world
    if len(dataset) < count * global_size:
        raise ConfigError(
            f"eva_batches: {count} global batches of {global_size} rows need {count * global_size} training rows, "
            f"and the data has {len(dataset)}; lower eva_batches"
        )
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    batches = []
    for start in range(0, count * global_size, global_size):
        rows = order[start + rank * per_rank : start + (rank + 1) * per_rank]
        batches.append(trainer.data_collator([dataset[i] for i in rows]))
    return batches


class _Forwards:
    """peft's forward function for the pass: the model's forward without labels (the loss is not needed),
    under the training's autocast; counts the passes and stops a pass that does not converge."""

    def __init__(self, autocast, limit: int):
        self.autocast, self.limit, self.count = autocast, limit, 0

    def __call__(self, model, inputs):
        self.count += 1
        if self.count > self.limit:
            raise ConfigError(
                f"eva_batches, eva_tau: the EVA components did not settle within {self.limit} forward passes; "
                "raise eva_batches (more distinct batches settle sooner) or lower eva_tau"
            )
        with self.autocast():
            return model(**{key: value for key, value in inputs.items() if key != "labels"})


def initialise_eva(trainer, recipe, resumed: bool) -> None:
    """Set every LoRA ``lora_A`` of the (not yet wrapped) ``trainer.model`` from EVA's SVD of its layer inputs;
    collective. A resumed run keeps its checkpoint's adapter instead."""
    if resumed:
        logger.info("eva: resuming, the checkpoint's adapter is loaded; the EVA pass is skipped")
        return
    model = trainer.model
    device = trainer.args.device
    batches = eva_batches(trainer, recipe.eva_batches, trainer.args.seed)
    batches = [{key: value.to(device) for key, value in batch.items()} for batch in batches]
    forwards = _Forwards(trainer.autocast_smart_context_manager, PASSES_PER_BATCH * len(batches))
    gpus = [device.index or 0] if device.type == "cuda" else []
    started = time.monotonic()
    # on CPU one thread: the SVD's arithmetic (near-equal singular values' vectors) then does not depend on the
    # process's thread count, and its many small SVDs run faster (measured in docs/variants.md)
    threads = torch_threads(1) if device.type == "cpu" else contextlib.nullcontext()
    with torch.random.fork_rng(devices=gpus), warnings.catch_warnings(), threads:
        warnings.filterwarnings("ignore", message="torch.distributed is initialized")  # the gather is the point
        state = get_eva_state_dict(model, batches, forward_fn=forwards, show_progress_bar=False)
        state = {name: rows.contiguous() for name, rows in state.items()}
        if dist.is_initialized():  # every rank computed the same SVD; start from rank 0's bits all the same
            for name in sorted(state):
                dist.broadcast(state[name], src=0)
        initialize_lora_eva_weights(model, eva_state_dict=dict(state), show_progress_bar=False)
    adapter = model.active_adapter
    initial = {name: model.get_submodule(name).lora_A[adapter].weight.detach().cpu().clone() for name in state}
    rows = trainer.args.per_device_train_batch_size * ranks().world_size
    logger.info(
        f"eva: lora_A of {len(initial)} layers from the SVD of their inputs over {len(batches)} global batches "
        f"of {rows} rows ({forwards.count} forward passes, {time.monotonic() - started:.1f} s)"
    )
    if trainer.args.should_save:
        Path(trainer.args.output_dir).mkdir(parents=True, exist_ok=True)
        save_file(initial, str(Path(trainer.args.output_dir) / EVA_INIT_FILE))
