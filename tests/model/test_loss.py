"""The chunked causal-LM loss (`fsdp_peft.model.loss`): equal to the model's own loss, without its logits."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
from transformers.loss.loss_utils import ForCausalLMLoss

from conftest import REPO, last_json_line, torchrun
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.model.loss import chunked_causal_lm_loss, chunked_loss_unavailable, head_computes_loss
from fsdp_peft.procedures.sft import SFT_PROCEDURE
from fsdp_peft.settings.config import resolve_recipe_config
from fsdp_peft.tools.validation import check_before_training

CHECK = Path(__file__).parents[1] / "distributed" / "chunked_loss_check.py"
LORA_TINY = REPO / "configs" / "llama_lora" / "tiny.yaml"


def hidden_and_labels(vocab: int = 300, hidden: int = 16):
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(2, 37, hidden, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=generator) / 4
    labels = torch.randint(0, vocab, (2, 37), generator=generator)
    labels[0, :5] = -100  # a prompt
    labels[1, 30:] = -100  # padding
    return states, weight, labels


@pytest.mark.parametrize("num_items_in_batch", [None, torch.tensor(50)])
def test_chunked_loss_and_hidden_gradient_equal_the_model_loss_in_fp32(num_items_in_batch):
    states, weight, labels = hidden_and_labels()
    reference = ForCausalLMLoss(F.linear(states, weight), labels, weight.shape[0], num_items_in_batch)
    (expected,) = torch.autograd.grad(reference, states)
    chunked = chunked_causal_lm_loss(states, weight, None, labels, 7, num_items_in_batch)
    (gradient,) = torch.autograd.grad(chunked, states)
    assert chunked.item() == pytest.approx(reference.item(), rel=1e-6)
    assert ((gradient - expected).norm() / expected.norm()).item() < 1e-6


def test_chunked_loss_under_bf16_autocast_runs_the_head_in_bf16_like_the_model():
    states, weight, labels = hidden_and_labels()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = ForCausalLMLoss(F.linear(states, weight), labels, weight.shape[0])
        chunked = chunked_causal_lm_loss(states, weight, None, labels, 7)
    in_fp32 = chunked_causal_lm_loss(states, weight, None, labels, 7)
    assert abs(chunked.item() - reference.item()) < 1e-5 < abs(in_fp32.item() - reference.item())


def test_saved_for_backward_is_the_hidden_gradient_not_the_logits():
    states, weight, labels = hidden_and_labels(vocab=4096)
    saved = {}
    for name, compute in {
        "full": lambda: ForCausalLMLoss(F.linear(states, weight), labels, weight.shape[0]),
        "chunked": lambda: chunked_causal_lm_loss(states, weight, None, labels, 7),
    }.items():
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: sizes.append(t.numel() * t.element_size()) or t, lambda t: t
        ):
            compute()
        saved[name] = sum(sizes)
    labelled = int((F.pad(labels, (0, 1), value=-100)[:, 1:] != -100).sum())
    assert saved["full"] >= states.shape[0] * states.shape[1] * 4096 * 4  # at least the fp32 logits
    assert saved["chunked"] <= labelled * 16 * 4 + labelled * 8 + 1024  # hidden gradient and row indices


def test_the_head_computes_the_loss_inside_the_model_forward_and_is_restored():
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    input_ids = torch.randint(0, 300, (2, 20))
    labels = input_ids.clone()
    labels[:, :6] = -100
    reference = model(input_ids=input_ids, labels=labels).loss
    with head_computes_loss(model, labels, 5):
        chunked = model(input_ids=input_ids, labels=labels).loss
    assert chunked.item() == pytest.approx(reference.item(), rel=1e-6)
    assert "forward" not in vars(model.lm_head) and "_loss_function" not in vars(model)
    assert model(input_ids=input_ids).logits.shape == (2, 20, 300)


def test_the_model_loss_is_kept_where_chunking_would_change_it(monkeypatch):
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config).requires_grad_(False)  # a frozen base, as under LoRA
    plain = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    assert chunked_loss_unavailable(model, plain) is None
    smoothing = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[], label_smoothing_factor=0.1)
    assert "label_smoothing_factor" in chunked_loss_unavailable(model, smoothing)
    model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in chunked_loss_unavailable(model, plain)
    model.config.final_logit_softcapping = None
    monkeypatch.setenv("PJRT_DEVICE", "TPU")  # XLA: per-batch shapes; the SPMD wrapper shards the logits
    assert chunked_loss_unavailable(model, plain).startswith("XLA: ")
    monkeypatch.delenv("PJRT_DEVICE")
    model.lm_head.weight.requires_grad_(True)
    assert "trains" in chunked_loss_unavailable(model, plain)


def test_a_negative_loss_chunk_size_is_refused_before_training(tmp_path):
    recipe, training, _ = resolve_recipe_config(
        ["--config", str(LORA_TINY), "--output_dir", str(tmp_path), "--loss_chunk_tokens", "-1"], LORA_TINY, "x"
    )
    with pytest.raises(ConfigError, match=r"^loss_chunk_tokens: must be at least 0, got -1 \(0 turns"):
        check_before_training(recipe, training, SFT_PROCEDURE)


@pytest.mark.slow
def test_chunked_loss_trains_like_the_model_loss_under_fsdp1_and_fsdp2(tmp_path):
    """Packing + answer-only labels + gradient checkpointing + accumulation, and padded answer-only rows;
    FSDP1 and FSDP2 on 2 gloo ranks, fp32: losses and adapter gradients within 1e-6 relative."""
    report = last_json_line(torchrun(CHECK, "--out", str(tmp_path)).stdout)
    assert sorted(report) == ["fsdp1_packing", "fsdp1_padded", "fsdp2_packing", "fsdp2_padded"]
    for name, run in report.items():
        assert run["chunk_tokens"] == [0, 7], name  # the chunked run did chunk
        assert run["micro_batches"] == (4 if "packing" in name else 2) and run["optimizer_steps"] == 2, name
        assert run["nonzero_gradient_shards"] == run["gradient_shards"] > 0, name
        assert run["loss_relative_error"] < 1e-6, name
        assert run["gradient_relative_error"] < 1e-6, name  # all adapter gradients of a step together
        # single tensors: fp32 rounding, the same order as the fp32 model loss's own distance from float64
        assert run["worst_tensor_relative_error"] < 5e-6, name
        assert all(math.isfinite(loss) for losses in run["losses"] for loss in losses), name
    for name in ("fsdp2_packing", "fsdp2_padded"):  # the head's unit: one all-gather per forward, none per chunk
        assert report[name]["head_gathers"] == [report[name]["micro_batches"]] * 2, name
