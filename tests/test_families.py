"""Model families: lookup by model_type, each family's tiny model, pad tokens, and the generic path."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from conftest import launch_recipe, read_json
from fsdp_peft import paths, tiny
from fsdp_peft.families import ATTENTION_AND_MLP, FAMILIES, GENERIC, family_for, lora_targets, pad_token_for
from fsdp_peft.policies import decoder_layer_classes

# sha256 of model.safetensors of tiny-llama as built before families existed (commit fc7ae9a)
TINY_LLAMA_WEIGHTS_SHA256 = "04ad6d44177f175c00107245b12c35a4ff2408b658c36261224a67850e7f1ca5"


def test_families_are_found_by_model_type_and_other_models_take_the_generic_path():
    assert [family_for(t).decoder_layer for t in ("llama", "qwen2", "qwen3", "mistral")] == [
        "LlamaDecoderLayer",
        "Qwen2DecoderLayer",
        "Qwen3DecoderLayer",
        "MistralDecoderLayer",
    ]
    assert family_for("gpt_neox") is GENERIC and family_for(None) is GENERIC
    assert lora_targets(["auto"], family_for("mistral")) == list(ATTENTION_AND_MLP)
    assert lora_targets(["auto"], GENERIC) == "all-linear"
    assert lora_targets(["all-linear"], family_for("llama")) == "all-linear"
    assert lora_targets(["q_proj", "v_proj"], family_for("llama")) == ["q_proj", "v_proj"]


def test_tiny_llama_weights_are_unchanged(tiny_model_dir):
    digest = hashlib.sha256((tiny_model_dir / "model.safetensors").read_bytes()).hexdigest()
    assert digest == TINY_LLAMA_WEIGHTS_SHA256


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_family_has_a_tiny_model_of_its_architecture_that_its_entry_fits(family, tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = paths.tiny_model_path(family.tiny_model)
    assert path.name == f"{family.tiny_model}-seed{tiny.WEIGHTS_SEED}"
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [family.tiny_architecture] and family_for(config.model_type) is family
    assert (config.num_hidden_layers, config.hidden_size) == (4, 128)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == family.tiny_architecture
    assert [c.__name__ for c in decoder_layer_classes(model)] == [family.decoder_layer]
    assert family.decoder_layer in model._no_split_modules  # the entry agrees with transformers
    linear_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(family.lora_target_modules) == linear_names - {"lm_head"}
    assert AutoTokenizer.from_pretrained(path).chat_template == tiny.CHAT_TEMPLATE

    monkeypatch.setenv("FSDP_PEFT_CACHE", str(tmp_path))  # rebuilt from the seed: the same weights
    rebuilt = AutoModelForCausalLM.from_pretrained(paths.tiny_model_path(family.tiny_model))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), rebuilt.state_dict().values()))


class _Vocabulary:
    def __init__(self, tokens):
        self.tokens, self.eos_token = tokens, "</s>"

    def get_vocab(self):
        return {token: i for i, token in enumerate(self.tokens)}


def test_pad_token_is_the_familys_when_the_vocabulary_has_it_else_eos():
    llama, mistral = family_for("llama"), family_for("mistral")
    assert pad_token_for(_Vocabulary(["a", "<|finetune_right_pad_id|>", "</s>"]), llama) == "<|finetune_right_pad_id|>"
    assert pad_token_for(_Vocabulary(["a", "</s>"]), llama) == "</s>"
    assert pad_token_for(_Vocabulary(["<unk>", "</s>"]), mistral) == "<unk>"
    assert pad_token_for(_Vocabulary(["<unk>", "</s>"]), GENERIC) == "</s>"


def test_model_names_resolve_to_tiny_caches_including_moved_ones(tiny_cache):
    assert paths.resolve_model_path("tiny-mistral") == str(tiny_cache / "tiny-mistral-seed1234")
    assert paths.resolve_model_path("/gone/tiny-qwen3-seed1234") == str(tiny_cache / "tiny-qwen3-seed1234")
    assert paths.resolve_model_path("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"


@pytest.mark.slow
def test_a_model_with_no_family_entry_trains_through_the_generic_path(tmp_path, tiny_cache):
    """GPT-NeoX (fused query_key_value, dense_h_to_4h): units from _no_split_modules, LoRA on all linear layers."""
    from transformers import AutoTokenizer, GPTNeoXConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny.TINY_MODEL_ASSETS)
    config = GPTNeoXConfig(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=128,
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["GPTNeoXForCausalLM"],
    )
    assert family_for(config.model_type) is GENERIC
    model_dir = tmp_path / "neox"
    model_dir.mkdir()
    tiny.write_checkpoint(model_dir, config, tokenizer)
    out = tmp_path / "out"
    result = launch_recipe(
        "llama_lora",
        "--model_name_or_path",
        str(model_dir),
        "--lora_target_modules",
        "auto",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--generate_samples",
        "0",
        "--generate_eval_samples",
        "0",
        "--output_dir",
        str(out),
    )
    layout = read_json(out / "fsdp_layout.json")
    layers = [unit for unit in layout["units"] if ".layers." in unit]
    assert layers == [f"base_model.model.gpt_neox.layers.{i}" for i in range(4)]
    adapted = json.loads((out / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert len(adapted) == 4 * 4  # all-linear: every linear layer of every decoder layer, not the head
    leaves = {name.rsplit(".", 1)[-1] for name in adapted}
    assert leaves == {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"}
    results = read_json(out / "results.json")
    assert results["steps"] == 2 and results["fsdp"] is True
    assert "llama_lora: 2 steps" in result.stdout
