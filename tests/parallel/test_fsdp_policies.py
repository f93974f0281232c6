"""The FSDP policy pieces on a real PEFT model, without a process group."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from fsdp_peft.parallel.fsdp_policies import (
    decoder_layer_classes,
    embeddings_and_head,
    fsdp1_wrap_policy,
    mixed_precision_policy,
)


@pytest.fixture(scope="module")
def peft_model(tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_mixed_precision_gathers_in_bf16_and_reduces_as_configured(version, reduce_dtype):
    policy = mixed_precision_policy(version, "bf16", reduce_dtype)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == reduce_dtype
    if version == 1:
        assert policy.buffer_dtype is None and policy.cast_forward_inputs
    else:
        assert policy.output_dtype is None


def test_decoder_layers_come_from_no_split_modules_or_the_config(peft_model):
    assert decoder_layer_classes(peft_model) == {LlamaDecoderLayer}
    assert decoder_layer_classes(peft_model, ["LlamaDecoderLayer"]) == {LlamaDecoderLayer}
    with pytest.raises(ValueError, match=r"no module of class \['MistralDecoderLayer'\] in the model"):
        decoder_layer_classes(peft_model, ["MistralDecoderLayer"])


def test_fsdp1_policy_wraps_layers_adapter_leaves_and_untied_embeddings_only(peft_model):
    policy = fsdp1_wrap_policy(peft_model, {LlamaDecoderLayer})
    wrapped = [name for name, m in peft_model.named_modules() if name and policy(m, recurse=False, nonwrapped_numel=0)]
    (embed, head), tied = embeddings_and_head(peft_model)
    assert not tied
    assert sum(".lora_A." in n or ".lora_B." in n for n in wrapped) == 4 * 7 * 2
    assert sum(n.endswith(tuple(f"layers.{i}" for i in range(4))) for n in wrapped) == 4
    assert {n for n in wrapped if "lora_" not in n and "layers." not in n} == {
        "base_model.model.model.embed_tokens",
        "base_model.model.lm_head",
    }
    assert not any(n.endswith(("base_layer", "q_proj", "norm")) for n in wrapped)  # frozen leaves stay in their layer


@pytest.mark.parametrize(
    "adapter",
    [
        {"trainable_token_indices": [3, 5, 7], "target_modules": ["q_proj"]},
        {"target_modules": ["q_proj", "embed_tokens"]},
    ],
    ids=["tokens", "embedding-lora"],
)
def test_fsdp1_policy_gives_embedding_adapters_and_their_frozen_base_units_of_their_own(adapter, tiny_model_dir):
    """The peft layer that reads its trainable rows itself is a unit holding only those; the frozen embedding
    it calls is another; the token wrapper around them is none (nothing would be left in it)."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = get_peft_model(base, LoraConfig(r=4, task_type="CAUSAL_LM", **adapter))
    policy = fsdp1_wrap_policy(model, {LlamaDecoderLayer})
    wrapped = {name for name, m in model.named_modules() if name and policy(m, recurse=False, nonwrapped_numel=0)}
    embed = "base_model.model.model.embed_tokens"
    reader = f"{embed}.token_adapter" if "trainable_token_indices" in adapter else embed
    assert {n for n in wrapped if n.startswith(embed)} == {reader, f"{reader}.base_layer"}
    modules = dict(model.named_modules())
    own = [
        p for p in modules[reader].parameters() if not any(p is q for q in modules[f"{reader}.base_layer"].parameters())
    ]
    assert own and all(p.requires_grad and p.dtype == torch.float32 for p in own)
    assert not any(p.requires_grad for p in modules[f"{reader}.base_layer"].parameters())


@pytest.mark.slow
def test_fsdp1_generate_is_registered_behind_torch_compile(tiny_model_dir):
    """torch_compile wraps the FSDP1 root in an OptimizedModule; generate must still gather the root's weights
    (unregistered, the CPU recipe run crashed with SIGSEGV in its first generate: measured 3 of 3)."""
    from conftest import REPO, last_json_line, torchrun

    report = last_json_line(torchrun(REPO / "tests" / "distributed" / "compiled_generate_check.py").stdout)
    assert report["registered"] is True
    assert report["sharded"] == report["reference"] and len(report["reference"]) == 6 + 8
