"""Chunked causal-LM loss: the output head and cross-entropy applied a chunk of labelled tokens at a time.

With a 128k vocabulary the logits of one 4k-token sequence are 2 GiB in fp32, and the model's own loss
keeps them, their fp32 copy and their log-softmax for backward. Here the output head's forward computes the
loss itself: for each chunk of labelled tokens it forms that chunk's logits, adds up the cross-entropy and,
when training, the gradient of the hidden states, then drops the logits. Backward only scales that
gradient (tokens x hidden): the full logits, and their gradient, never exist.

The loss is computed inside the head's own forward, so FSDP's hooks (FSDP2) or unit (FSDP1) around the
head run as usual and its weight is gathered exactly as for the model's own loss: once, not per chunk
(under FSDP2 accelerate also keeps the final norm + head unit gathered until backward). Unlabelled tokens
(prompts under answer-only loss, padding, packed-example boundaries) are dropped before the head.
`chunked_loss_unavailable` names the cases where this would not equal the model's own loss; there the
model's loss runs unchanged.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from fsdp_peft.core.xla import on_xla

IGNORE_INDEX = -100
ON_XLA = (
    "XLA: dropping unlabelled tokens gives every batch its own shapes (a graph compile per step), and the "
    "Trainer's SPMD wrapper shards the logits the model returns"
)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The ``...ForCausalLM`` module under FSDP1 and PEFT wrappers (FSDP2 wraps in place)."""
    inner = getattr(model, "_fsdp_wrapped_module", None) or getattr(model, "module", None) or model
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def chunked_loss_unavailable(causal_lm: torch.nn.Module, args) -> str | None:
    """Why the chunked loss would not equal this model's own loss under ``args``; ``None`` when it would."""
    if on_xla():
        return ON_XLA
    if getattr(args, "label_smoothing_factor", 0):
        return "label_smoothing_factor > 0 (Trainer's label smoother needs the full logits)"
    if getattr(args, "use_liger_kernel", False):
        return "use_liger_kernel: Liger's fused linear cross-entropy replaces the head's loss"
    head = causal_lm.get_output_embeddings() if hasattr(causal_lm, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return f"the output head is a {type(head).__name__}, not a plain torch Linear (adapted or quantized head)"
    if head.weight.requires_grad or (head.bias is not None and head.bias.requires_grad):
        return "the output head trains"
    config = getattr(causal_lm, "config", None)
    transformed = [key for key in LOGIT_TRANSFORMS if getattr(config, key, None) not in (None, 1, 1.0)]
    if transformed:
        return f"the model transforms its logits after the head ({transformed[0]})"
    if getattr(causal_lm, "loss_type", None) not in (None, "ForCausalLM"):
        return f"the model's loss is {causal_lm.loss_type}, not the causal-LM cross-entropy"
    return None


def shifted_targets(labels: torch.Tensor, shift_labels: torch.Tensor | None) -> torch.Tensor:
    """The token each position predicts, flattened (transformers' ``ForCausalLMLoss`` shift)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    return shift_labels.reshape(-1)


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on (as for the model's own head), else the input's."""
    device = tensor.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tensor.dtype


class ChunkedHeadCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, ``chunk`` rows at a time.

    Divided by ``denominator`` as the model's loss is. The gradient of ``hidden`` is formed chunk by chunk
    in forward with the model's own ops (cross-entropy backward, then the head) and saved; backward scales
    it by the incoming gradient. The weight and bias are frozen.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int, dtype: torch.dtype, denominator):
        wants_grad = ctx.needs_input_grad[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if wants_grad else None
        transient = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)  # a chunk's graph: freed here
        with torch.autocast(hidden.device.type, enabled=False), torch.enable_grad(), transient:
            weight = weight.detach().to(dtype)
            bias = None if bias is None else bias.detach().to(dtype)
            for start in range(0, hidden.shape[0], chunk):
                rows = hidden[start : start + chunk].detach().to(dtype).requires_grad_(wants_grad)
                logits = F.linear(rows, weight, bias).float()
                loss = F.cross_entropy(logits, targets[start : start + chunk], reduction="sum") / denominator
                if wants_grad:  # the model's own ops (log-softmax backward, then the head), on this chunk only
                    (grad_hidden[start : start + chunk],) = torch.autograd.grad(loss, rows)
                total += loss.detach()
                del logits, loss
        ctx.save_for_backward(grad_hidden)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, None, None


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    chunk_tokens: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model's causal-LM loss (``ForCausalLMLoss``: mean over labelled tokens, or their sum divided by
    ``num_items_in_batch``) from the final hidden states, without materialising the logits."""
    targets = shifted_targets(labels, shift_labels).to(hidden.device)
    labelled = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, labelled)
    if num_items_in_batch is None:
        denominator = torch.tensor(float(labelled.numel()), device=hidden.device)
    elif torch.is_tensor(num_items_in_batch):
        denominator = num_items_in_batch.to(hidden.device)
    else:
        denominator = num_items_in_batch
    return ChunkedHeadCrossEntropy.apply(
        rows, weight, bias, targets.index_select(0, labelled), chunk_tokens, compute_dtype(hidden), denominator
    )


@contextlib.contextmanager
def head_computes_loss(
    causal_lm: torch.nn.Module,
    labels: torch.Tensor,
    chunk_tokens: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
):
    """Within: the model's forward (called with ``labels``) returns the chunked loss as its ``loss``.

    The head's forward returns the loss instead of logits, and the model's loss function hands it
    through; both are instance attributes, removed on exit.
    """
    head = causal_lm.get_output_embeddings()
    head = getattr(head, "_fsdp_wrapped_module", head)  # FSDP1 unit: its own forward gathers the weight first

    def head_forward(hidden: torch.Tensor) -> torch.Tensor:
        return chunked_causal_lm_loss(
            hidden, head.weight, head.bias, labels, chunk_tokens, num_items_in_batch, shift_labels
        )

    def loss_already_computed(logits: torch.Tensor, labels=None, vocab_size=None, **kwargs) -> torch.Tensor:
        return logits

    previous = vars(causal_lm).get("_loss_function")
    head.forward = head_forward
    causal_lm.loss_function = loss_already_computed
    try:
        yield
    finally:
        del head.forward
        if previous is None:
            del causal_lm._loss_function
        else:
            causal_lm.loss_function = previous
