"""Packing: short examples share a row, never each other's attention, and train exactly as unpacked."""

from __future__ import annotations

import json
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.data.cache import load_data
from fsdp_peft.data.packing import FlattenedCollator, PackedCollator, check_packing_keeps_examples_apart, data_collator
from fsdp_peft.data.tokenize import IGNORE_INDEX
from fsdp_peft.settings.config import RecipeArguments

WORDS = ["abcde", "fg", "hijklmn", "op", "qrstu", "vwxyz", "ab", "cdefgh"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request, tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation=request.param
    ).eval()


@pytest.fixture
def rows_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_PEFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"reverse: {w}", "completion": w[::-1]}) + "\n" for w in WORDS))
    return path


def packed_and_unpacked(tokenizer, path, max_seq_length=64):
    packed, _, _ = load_data(
        RecipeArguments(train_file=str(path), packing=True, max_seq_length=max_seq_length), tokenizer
    )
    unpacked, _, _ = load_data(RecipeArguments(train_file=str(path), max_seq_length=max_seq_length), tokenizer)
    return packed, unpacked


def test_packed_rows_hold_whole_examples_with_restarting_positions(tokenizer, rows_file):
    packed, unpacked = packed_and_unpacked(tokenizer, rows_file)
    examples = sorted(tuple(r["input_ids"]) for r in unpacked)
    pieces = []
    for row in packed:
        assert len(row["input_ids"]) <= 64 and len(row["labels"]) == len(row["position_ids"]) == len(row["input_ids"])
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        for start, end in zip(starts, starts[1:]):
            assert row["position_ids"][start:end] == list(range(end - start))
            assert row["labels"][start] == IGNORE_INDEX
            pieces.append(tuple(row["input_ids"][start:end]))
    assert sorted(pieces) == examples  # every example exactly once, none split
    assert len(packed) < len(unpacked) == len(WORDS)
    trained = sum(label != IGNORE_INDEX for r in packed for label in r["labels"])
    assert trained == sum(label != IGNORE_INDEX for r in unpacked for label in r["labels"])


def test_no_attention_crosses_an_example_boundary(tokenizer, rows_file, model):
    packed, unpacked = packed_and_unpacked(tokenizer, rows_file)
    row = next(r for r in packed if r["position_ids"].count(0) >= 2)
    second = row["position_ids"].index(0, 1)
    end = row["position_ids"].index(0, second + 1) if row["position_ids"].count(0) > 2 else len(row["input_ids"])
    batch = PackedCollator(tokenizer.pad_token_id)([row])
    with torch.no_grad():
        together = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0, second:end]
        alone = model(input_ids=torch.tensor([row["input_ids"][second:end]])).logits[0]
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[
            0, second:end
        ]  # KV cache
    assert together.shape == alone.shape
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    assert (leaky - alone).abs().max() > 1e-2  # why the collator passes use_cache=False


def test_packed_loss_equals_unpacked_loss(tokenizer, rows_file, model):
    packed, unpacked = packed_and_unpacked(tokenizer, rows_file)
    unpacked_batch = data_collator(RecipeArguments(), tokenizer)(unpacked.to_list())
    packed_batch = data_collator(RecipeArguments(packing=True), tokenizer)(packed.to_list())
    assert set(packed_batch) == {"input_ids", "labels", "position_ids", "use_cache"}
    with torch.no_grad():
        loss_unpacked = model(**unpacked_batch).loss
        loss_packed = model(**packed_batch).loss
    assert packed_batch["input_ids"].shape[0] < unpacked_batch["input_ids"].shape[0]
    torch.testing.assert_close(loss_packed, loss_unpacked, atol=1e-6, rtol=1e-6)


def test_flattened_rows_train_exactly_as_padded_rows(tokenizer, rows_file, model):
    """Padding-free: the micro-batch's packed rows joined into one row without a pad token give the padded
    rows' loss (SDPA and eager keep examples apart by position_ids here as in each padded row)."""
    packed, _ = packed_and_unpacked(tokenizer, rows_file, max_seq_length=24)
    features = packed.to_list()
    padded, flat = PackedCollator(tokenizer.pad_token_id)(features), FlattenedCollator()(features)
    tokens = sum(len(feature["input_ids"]) for feature in features)
    assert len(features) > 2 and padded["input_ids"].numel() > tokens  # the padded batch did pad
    assert flat["input_ids"].shape == (1, tokens) and not (flat["input_ids"] == tokenizer.pad_token_id).any()
    assert (flat["labels"] != IGNORE_INDEX).sum() == (padded["labels"] != IGNORE_INDEX).sum()
    with torch.no_grad():
        torch.testing.assert_close(model(**flat).loss, model(**padded).loss, atol=1e-6, rtol=1e-6)


def test_variable_length_kernels_get_flattened_rows_and_the_others_padded_rows(tokenizer):
    chosen = {
        attention: type(data_collator(RecipeArguments(packing=True, attn_implementation=attention), tokenizer))
        for attention in ("flash_attention_2", "flash_attention_3", "sdpa", "eager", "flex_attention", "auto")
    }
    assert chosen == {
        "flash_attention_2": FlattenedCollator,
        "flash_attention_3": FlattenedCollator,
        "sdpa": PackedCollator,
        "eager": PackedCollator,
        "flex_attention": PackedCollator,
        "auto": PackedCollator,  # SDPA here: no CUDA GPU with flash-attn on this machine
    }


def test_packing_check_accepts_the_tiny_model_and_refuses_leaking_attention(model):
    check_packing_keeps_examples_apart(model)

    class Leaky(torch.nn.Module):  # every position sees all tokens before it, whatever position_ids say
        config = types.SimpleNamespace(_attn_implementation="custom")

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(1))

        def forward(self, input_ids, position_ids=None, use_cache=None):
            return types.SimpleNamespace(logits=input_ids.float().cumsum(-1)[..., None] * self.weight)

    with pytest.raises(ConfigError, match="packing: with attn_implementation 'custom' this model lets packed examples"):
        check_packing_keeps_examples_apart(Leaky())
