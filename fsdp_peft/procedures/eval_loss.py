"""The eval loss: the mean cross-entropy over every labelled held-out token, on any number of ranks and batch size.

Trainer's own figure averages each rank's batch mean, repeated once per row, and keeps the first rows of the last
gathered batch. Two things make it move with the launch rather than with the model: batch means weigh a short row
like a long one, so the figure changes with ``per_device_eval_batch_size``; and on several ranks accelerate fills
the last batch of every rank to its full size with rows from the start of the set (``even_batches``: every rank must
run the same forwards, FSDP gathers in each), whose losses enter the kept batch means (measured: docs/checkpoints.md).

`HeldOutLoss` counts instead, on each rank, the labelled tokens and the sum of their losses over the rows it holds
for real, and adds them up over the ranks at the end: the loss of the whole held-out set as one process computes
it in one batch. Which rows are fill follows from accelerate's own numbers, read as ``gather_for_metrics`` reads them:
the last global batch holds ``remainder`` held-out rows, then the fill, and each rank holds the slice of it at its
data-parallel index. A sequence group's ranks hold slices of the same rows; their sums add up to each row once.
Where only the loss leaves the step (the recipes' evaluations) and the batch is text rows, the fill rows are not run
at all; a rank left with none of the set's rows runs one row, unlabelled, since FSDP needs every rank's forward.
"""

from __future__ import annotations

import torch

from fsdp_peft.core.distributed import gathered_from_every_rank
from fsdp_peft.data.tokenize import IGNORE_INDEX

TEXT_ROWS = ("input_ids", "attention_mask", "labels", "shift_labels", "position_ids", "token_type_ids")


class HeldOutLoss:
    """One evaluation's token-loss sum and token count on this rank; `mean` adds them over the ranks."""

    def __init__(self, dataloader, drops_fill: bool = False):
        sampler = getattr(dataloader, "batch_sampler", None)
        ranks = getattr(sampler, "num_processes", 1)
        per_rank = getattr(sampler, "batch_size", None) or getattr(dataloader, "batch_size", 1)
        self.position = getattr(sampler, "process_index", 0)  # the data-parallel index: a slice of each batch
        self.rows_per_rank = per_rank // ranks if getattr(sampler, "split_batches", False) else per_rank
        self.drops_fill = drops_fill  # nothing but the loss leaves the step: fill rows need not run
        self.total, self.tokens = 0.0, 0  # this rank's sum of token losses (float64) and labelled tokens

    def rows_held(self, rows: int, gradient_state) -> int:
        """How many of this rank's ``rows`` (its first ones) are held-out rows, not fill."""
        remainder = gradient_state.remainder
        if not gradient_state.end_of_dataloader or remainder <= 0:  # -1: no length; 0: the set divides
            return rows
        return max(0, min(rows, remainder - self.position * self.rows_per_rank))

    def without_fill(self, inputs: dict, gradient_state) -> dict:
        """``inputs`` without their fill rows: dropped where the step returns only its loss and every tensor holds text
        rows (a rank left with fill alone runs one row, unlabelled: every rank must still forward), else unlabelled
        (images and other inputs need not be laid out by row)."""
        rows = inputs["labels"].shape[0]
        held = self.rows_held(rows, gradient_state)
        if held == rows:
            return inputs
        tensors = {key: value for key, value in inputs.items() if torch.is_tensor(value)}  # and flags: use_cache
        by_row = all(key in TEXT_ROWS and value.shape[:1] == (rows,) for key, value in tensors.items())
        kept = dict(inputs)
        if self.drops_fill and by_row:
            kept.update({key: value[: max(held, 1)] for key, value in tensors.items()})
        for key in ("labels", "shift_labels"):
            if key in kept and kept[key].shape[0] > held:
                kept[key] = kept[key].clone()
                kept[key][held:] = IGNORE_INDEX
        return kept

    def add(self, mean_loss: torch.Tensor, inputs: dict) -> None:
        """One forward's loss, the mean over the tokens it counted: the labels the model shifts, or the shifted
        labels a split row carries."""
        targets = inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"][..., 1:]
        tokens = int((targets != IGNORE_INDEX).sum())
        if tokens:  # a rank with only fill rows, or a row slice without labels, has a NaN mean: it adds nothing
            self.total += float(mean_loss) * tokens
            self.tokens += tokens

    def mean(self) -> float | None:
        """The loss over every rank's held-out tokens (collective when distributed); ``None`` without labels."""
        counted = gathered_from_every_rank((self.total, self.tokens))
        tokens = sum(n for _, n in counted)
        return sum(total for total, _ in counted) / tokens if tokens else None
