"""The eval loss: the mean cross-entropy over every labelled held-out token, on any number of ranks and batch size.

Trainer's own figure averages each rank's batch mean, repeated once per row, and keeps the first rows of the last
gathered batch. Two things make it move with the launch rather than with the model: batch means weigh a short row
like a long one, so the figure changes with ``per_device_eval_batch_size``; and on several ranks accelerate fills
the last batch of every rank to its full size with rows from the start of the set (``even_batches``: every rank must
run the same forwards, FSDP gathers in each), whose losses enter the kept batch means (measured: docs/checkpoints.md).

`HeldOutLoss` counts instead, on each rank, the labelled tokens and the sum of their losses over the rows it holds
for real, and adds them up over the ranks at the end: the loss of the whole held-out set as one process computes
it in one batch. Which rows are fill follows from the loader accelerate prepared: only a sharded loader with even
batches fills, only its last batch, which holds the set's remainder after whole global batches, then the fill; each
rank holds the slice of it at its data-parallel index. A sequence group's ranks hold slices of the same rows; their
sums add up to each row once.
Where only the loss leaves the step (the recipes' evaluations) and the batch is text rows, the fill rows are not run
at all; a rank left with none of the set's rows runs one row, unlabelled, since FSDP needs every rank's forward.
"""

from __future__ import annotations

import torch

from fsdp_peft.core.distributed import gathered_from_every_rank
from fsdp_peft.data.tokenize import IGNORE_INDEX

TEXT_ROWS = ("input_ids", "attention_mask", "labels", "shift_labels", "position_ids", "token_type_ids")


class HeldOutLoss:
    """One evaluation's token-loss sum and token count on this rank; `mean` adds them over the ranks.

    Built from the evaluation's prepared dataloader; `without_fill` and `add` are called once per forward, in order.
    """

    def __init__(self, dataloader, drops_fill: bool = False):
        sampler = getattr(dataloader, "batch_sampler", None)
        self.ranks = ranks = getattr(sampler, "num_processes", 1)
        per_rank = getattr(sampler, "batch_size", None) or getattr(dataloader, "batch_size", None) or 1
        self.position = getattr(sampler, "process_index", 0)  # the data-parallel index: a slice of each batch
        self.rows_per_rank = per_rank // ranks if getattr(sampler, "split_batches", False) else per_rank
        self.rows = getattr(dataloader, "dataset", None)
        # accelerate fills only a sharded, even, not drop_last loader of known length; its last batch then holds
        # `remainder` of the set's rows (counted here, not read from accelerate's state, which a loader reading ahead
        # sets early)
        fills = ranks > 1 and getattr(sampler, "even_batches", True) and not getattr(sampler, "drop_last", False)
        known = fills and hasattr(self.rows, "__len__") and hasattr(dataloader, "__len__")
        self.remainder = len(self.rows) % (self.rows_per_rank * ranks) if known else 0
        self.last_step = len(dataloader) - 1 if known else -1
        self.step = -1
        self.drops_fill = drops_fill  # nothing but the loss leaves the step: fill rows need not run
        self.total: torch.Tensor | float = 0.0  # this rank's sum of token losses (float64 where the device has it)
        self.tokens: torch.Tensor | int = 0  # and its labelled tokens

    def rows_held(self, rows: int) -> int:
        """How many of this rank's ``rows`` in the current batch (its first ones) are held-out rows, not fill."""
        if self.step != self.last_step or not self.remainder:
            return rows
        return max(0, min(rows, self.remainder - self.position * self.rows_per_rank))

    def without_fill(self, inputs: dict) -> dict:
        """The next batch's ``inputs`` without their fill rows: dropped where the step returns only its loss and every
        tensor holds text rows (a rank left with fill alone runs one row, unlabelled: every rank must still forward),
        else unlabelled (images and other inputs need not be laid out by row). A batch of packed rows joined into one
        (`fsdp_peft.data.packing.FlattenedCollator`) has its fill's tokens unlabelled, found by its rows' lengths."""
        self.step += 1
        rows = inputs["labels"].shape[0]
        if rows == 1 < self.rows_per_rank:  # joined: the rows the sampler gave are stretches of one row
            held = self.rows_held(self.rows_per_rank)
            if held == self.rows_per_rank:
                return inputs
            first = (self.last_step * self.ranks + self.position) * self.rows_per_rank  # this rank's, in the set
            end = sum(len(self.rows[first + i]["input_ids"]) for i in range(held))
            return _unlabelled(dict(inputs), (slice(None), slice(end, None)))
        held = self.rows_held(rows)
        if held == rows:
            return inputs
        tensors = {key: value for key, value in inputs.items() if torch.is_tensor(value)}  # and flags: use_cache
        by_row = all(key in TEXT_ROWS and value.shape[:1] == (rows,) for key, value in tensors.items())
        kept = dict(inputs)
        if self.drops_fill and by_row:
            kept.update({key: value[: max(held, 1)] for key, value in tensors.items()})
        return _unlabelled(kept, slice(held, None))

    def add(self, mean_loss: torch.Tensor, inputs: dict) -> None:
        """One forward's loss, the mean over the tokens it counted: the labels the model shifts, or the shifted
        labels a split row carries."""
        targets = inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"][..., 1:]
        tokens = (targets != IGNORE_INDEX).sum()
        # a rank with only fill rows, or a row slice without labels, has a NaN mean: it adds nothing
        exact = torch.float64 if mean_loss.device.type in ("cpu", "cuda") else torch.float32  # XLA, MPS: no float64
        self.total = self.total + torch.where(tokens > 0, mean_loss.detach().to(exact) * tokens, 0.0)
        self.tokens = self.tokens + tokens

    def mean(self) -> float | None:
        """The loss over every rank's held-out tokens (collective when distributed); ``None`` without labels."""
        counted = gathered_from_every_rank((float(self.total), int(self.tokens)))
        tokens = sum(n for _, n in counted)
        return sum(total for total, _ in counted) / tokens if tokens else None


def _unlabelled(inputs: dict, fill) -> dict:
    """``inputs`` with the labels (and a split row's shifted labels) at index ``fill`` ignored, on copies."""
    for key in ("labels", "shift_labels"):
        if key in inputs:
            inputs[key] = inputs[key].clone()
            inputs[key][fill] = IGNORE_INDEX
    return inputs
