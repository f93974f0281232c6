"""New tokens (`fsdp_peft.model.new_tokens`): the key's checks, the new rows' values, the grown model peft wraps.

The 2-rank run, reload, export and plan of a run with new tokens: tests/model/test_variants.py (the tokens variant)."""

from __future__ import annotations

import pytest
import torch

from conftest import REPO
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.model.modeling import load_base_model, load_tokenizer, lora_config
from fsdp_peft.model.new_tokens import grow_vocabulary, new_tokens_of, trained_token_indices, with_new_rows
from fsdp_peft.recipe import parse_recipe_config

LORA_TINY = REPO / "configs" / "llama_lora" / "tiny.yaml"


def _recipe(tmp_path, *argv):
    return parse_recipe_config(["--config", str(LORA_TINY), "--output_dir", str(tmp_path), *argv], LORA_TINY, "x")


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (["<|a|>", "<|a|>"], "new_special_tokens: '<|a|>' is listed twice; list each new token once"),
        (["<|a|>", " "], "new_special_tokens: every token must be a non-empty string, got ' '"),
        (["<|end|>"], "new_special_tokens: '<|end|>' is already in the tokenizer's vocabulary"),
        (["<|a|>", "<|a|>", "<|end|>"], "new_special_tokens: '<|a|>' is listed twice"),  # one line per problem
    ],
)
def test_new_special_tokens_must_be_new_distinct_strings(tmp_path, tokens, message):
    with pytest.raises(ConfigError) as error:
        _recipe(tmp_path, "--new_special_tokens", *tokens)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


def test_new_rows_are_the_mean_of_the_existing_vocabulary_and_draw_no_random_numbers():
    weight = torch.arange(12, dtype=torch.float32).view(4, 3)
    grown = with_new_rows(weight, [4, 5], 6)
    assert torch.equal(grown[:4], weight)
    assert torch.equal(grown[4], weight.mean(0)) and torch.equal(grown[5], weight.mean(0))
    inside = with_new_rows(weight, [2], 4)  # a padded vocabulary: the new id inside the embedding's rows
    assert torch.equal(inside[[0, 1, 3]], weight[[0, 1, 3]]) and torch.equal(inside[2], weight[:2].mean(0))


def test_grown_model_trains_exactly_the_new_rows_of_embedding_and_untied_head(tmp_path):
    recipe, _ = _recipe(tmp_path, "--new_special_tokens", "<|tool_call|>", "<|tool_result|>")
    recipe.trainable_token_indices = [3]
    tokenizer = load_tokenizer(recipe)
    model = load_base_model(recipe)
    before = model.get_input_embeddings().weight.detach().clone()
    state = torch.random.get_rng_state()
    grow_vocabulary(model, tokenizer, recipe)
    assert torch.equal(torch.random.get_rng_state(), state)  # the LoRA draws that follow are unchanged
    new = new_tokens_of(model)
    assert new.ids == [262, 263] and (new.base_rows, new.rows) == (262, 264) and len(tokenizer) == 264
    assert new.grown == ["model.embed_tokens.weight", "lm_head.weight"]
    assert model.config.vocab_size == 264 and model.lm_head.weight.shape == (264, 128)
    embedding = model.get_input_embeddings().weight
    assert torch.equal(embedding[:262], before) and torch.equal(embedding[262], before.mean(0))
    indices = lora_config(recipe, model).trainable_token_indices
    assert indices == {"embed_tokens": [3, 262, 263], "lm_head": [262, 263]}


def test_a_tied_head_grows_with_the_embedding_and_uses_its_trained_rows(tmp_path, tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    recipe, _ = _recipe(tmp_path, "--new_special_tokens", "<|tool_call|>")
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config)
    grow_vocabulary(model, load_tokenizer(recipe), recipe)
    new = new_tokens_of(model)
    assert (new.head, new.grown) == (None, ["model.embed_tokens.weight"])
    assert model.lm_head.weight is model.get_input_embeddings().weight and model.lm_head.weight.shape[0] == 263
    indices = trained_token_indices(model, [])
    assert indices == {"embed_tokens": [262]}
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=indices))
    delta = peft_model.base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta["default"]
    with torch.no_grad():
        delta.fill_(0.5)
        ids = torch.tensor([[5, 262]])
        hidden = peft_model.base_model.model.model(input_ids=ids).last_hidden_state
        logits = peft_model(input_ids=ids).logits
    assert torch.allclose(logits[0, :, 262], hidden[0] @ delta[0], atol=1e-5)  # the head's row 262 is the trained one


def test_plan_counts_the_grown_embedding_and_head_their_trained_rows_and_the_full_logits(tmp_path):
    from fsdp_peft.procedures.registry import plan_config

    plain, grown = tmp_path / "plain.yaml", tmp_path / "grown.yaml"
    plain.write_text(f"include: {LORA_TINY}\n")
    grown.write_text(f'include: {LORA_TINY}\nnew_special_tokens: ["<|tool_call|>", "<|tool_result|>"]\n')
    before, after = plan_config(plain, 2, 80 * 2**30), plan_config(grown, 2, 80 * 2**30)
    rows = 2 * 2 * 128  # 2 new tokens x (embedding + untied head) x hidden
    assert after.counts.base_parameters - before.counts.base_parameters == rows
    assert after.counts.adapter_parameters - before.counts.adapter_parameters == rows
    assert any("full logits is counted: the output head is a TrainableTokensWrapper" in n for n in after.notes)
    assert after.gpu["loss logits, transient (est.)"] > before.gpu["loss logits, transient (est.)"]
