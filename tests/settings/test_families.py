"""Model families: lookup by model_type, each family's tiny model, pad tokens, and the generic path."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
import torch

from conftest import REPO, launch_recipe, logged_losses, read_json, run_launch, write_tiny_model
from fsdp_peft.model import paths, tiny
from fsdp_peft.parallel.fsdp_policies import decoder_layer_classes
from fsdp_peft.settings.families import ATTENTION_AND_MLP, FAMILIES, GENERIC, family_for, lora_targets, pad_token_for

# sha256 of model.safetensors of tiny-llama as built before families existed (commit fc7ae9a)
TINY_LLAMA_WEIGHTS_SHA256 = "04ad6d44177f175c00107245b12c35a4ff2408b658c36261224a67850e7f1ca5"
GEMMA2_STEPS = 5
# as tests/test_recipes_fsdp.py: with 4 rows a rank, bf16 rounding of the other matmul shapes alone puts QLoRA
# 1.4e-4 apart after 3 steps, tiny-llama (SDPA) and Gemma-2 (eager) alike; with 16, 2.8e-5 and 3.6e-5
GEMMA2_PER_RANK_BATCH = 16
GEMMA2_LOSS_TOLERANCE = {"llama_lora": 1e-5, "llama_qlora": 1e-4}  # relative; fp32 LoRA, bf16-storage QLoRA


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


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.vision is None], ids=lambda f: f.name)
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
    from transformers import AutoConfig, GPTNeoXConfig

    model_dir = write_tiny_model(
        tmp_path / "neox", GPTNeoXConfig, tie_word_embeddings=False, architectures=["GPTNeoXForCausalLM"]
    )
    assert family_for(AutoConfig.from_pretrained(model_dir).model_type) is GENERIC
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


@pytest.fixture(scope="module", params=["llama_lora", "llama_qlora"])
def gemma2_runs(request, tmp_path_factory, tiny_gemma2_dir) -> dict:
    """The recipe (LoRA fp32, QLoRA nf4) on the tiny Gemma-2 with ``attn_implementation: auto``: 2 FSDP2 ranks, and
    one process with the same global batch and seed."""
    recipe = request.param
    common = [
        "--model_name_or_path",
        str(tiny_gemma2_dir),
        "--lora_target_modules",
        "auto",
        "--attn_implementation",
        "auto",
        "--max_steps",
        str(GEMMA2_STEPS),
        "--logging_steps",
        "1",
        "--warmup_steps",
        "0",
        "--generate_samples",
        "0",
        "--generate_eval_samples",
        "0",
    ]
    two, one = tmp_path_factory.mktemp(f"gemma2_{recipe}_two"), tmp_path_factory.mktemp(f"gemma2_{recipe}_one")
    launch_recipe(
        recipe, *common, "--per_device_train_batch_size", str(GEMMA2_PER_RANK_BATCH), "--output_dir", str(two)
    )
    batch = str(2 * GEMMA2_PER_RANK_BATCH)
    single = [sys.executable, str(REPO / "recipes" / f"{recipe}.py"), *common, "--per_device_train_batch_size", batch]
    result = run_launch([*single, "--output_dir", str(one)])
    assert result.returncode == 0, result.stderr[-4000:]
    return {"recipe": recipe, "two": two, "one": one}


@pytest.mark.slow
def test_gemma2_trains_with_auto_attention_on_two_ranks_as_in_one_process(gemma2_runs):
    """Gemma-2 has no SDPA: ``auto`` runs eager, and FSDP2 over 2 ranks matches one process step for step."""
    two, one = logged_losses(gemma2_runs["two"]), logged_losses(gemma2_runs["one"])
    assert sorted(two) == sorted(one) == list(range(1, GEMMA2_STEPS + 1))
    worst = max(abs(two[step] - one[step]) / abs(one[step]) for step in one)
    print(f"{gemma2_runs['recipe']} on Gemma-2: losses {list(one.values())}, largest relative difference {worst:.2e}")
    assert worst <= GEMMA2_LOSS_TOLERANCE[gemma2_runs["recipe"]], (two, one)
    for run in ("two", "one"):
        assert read_json(gemma2_runs[run] / "results.json")["attention"] == "eager"


@pytest.mark.slow
def test_gemma2_decoder_layers_become_fsdp_units_with_lora_on_all_linear_layers(gemma2_runs):
    layout = read_json(gemma2_runs["two"] / "fsdp_layout.json")
    assert layout["world_size"] == 2 and read_json(gemma2_runs["two"] / "results.json")["fsdp"] is True
    layers = [unit for unit in layout["units"] if ".layers." in unit]
    assert layers == [f"base_model.model.model.layers.{i}" for i in range(4)]
    adapted = json.loads((gemma2_runs["two"] / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert set(adapted) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    adapters = [p["name"] for p in layout["parameters"] if ".lora_A." in p["name"]]
    assert len(adapters) == 4 * 7 and all(".layers." in name for name in adapters)  # not the (tied) head
