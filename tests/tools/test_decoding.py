"""The compiled decode step's choices (`fsdp_peft.tools.decoding`) and 4-bit weights dequantized for a generation call
(`fsdp_peft.tools.generation.four_bit_dequantized`). The compiled step's tokens against the eager path's: under FSDP2
in tests/tools/test_generation.py, for every family's recipe in tests/test_recipes_fsdp.py, tests/model/test_moe.py
and tests/model/test_vision.py."""

from __future__ import annotations

import torch
from test_generation import lora_model


def test_a_call_compiles_over_a_static_cache_of_bucketed_length(tiny_model_dir):
    from fsdp_peft.tools.decoding import CACHE_BUCKET, decoding_for_call

    model = lora_model(tiny_model_dir)
    short = decoding_for_call(model, "true", True, 10, 32)
    assert short.eager_because is None and short.kwargs["cache_implementation"] == "static"
    assert short.kwargs["max_cache_len"] == CACHE_BUCKET == 64 and short.kwargs["disable_compile"] is False
    config = short.kwargs["compile_config"]
    assert config._compile_all_devices and config.mode == "default" and config.dynamic is False
    assert decoding_for_call(model, "true", True, 40, 32).kwargs["max_cache_len"] == 128  # 72 positions, 2 buckets


def test_each_reason_to_decode_eagerly_is_said_once(tiny_model_dir, caplog, monkeypatch):
    from conftest import tiny_llama_in_4bit
    from fsdp_peft.tools import decoding

    model = lora_model(tiny_model_dir)
    assert decoding.eager_because(model, "false", True) == "generate_compiled: false"
    # asked for here (4-bit layers are then dequantized for the call): true, or auto off CPU
    assert [decoding.compiles_here(model, setting) for setting in ("true", "auto", "false")] == [True, False, False]
    assert decoding.eager_because(model, "true", False).startswith("the weights gather in every forward (FSDP1")
    assert decoding.eager_because(model, "auto", True).startswith("on CPU compiling costs more")
    monkeypatch.setenv("PATH", "")  # no C++ compiler to be found
    monkeypatch.delenv("CXX", raising=False)
    assert decoding.eager_because(model, "true", True).startswith("no C++ compiler")
    monkeypatch.undo()
    four_bit = lora_model(tiny_model_dir, base=tiny_llama_in_4bit(tiny_model_dir))
    assert decoding.eager_because(four_bit, "true", True).startswith("4-bit layers")
    decoding._SAID.clear()
    with caplog.at_level("INFO", logger="fsdp_peft"):
        for _ in range(3):
            assert decoding.decoding_for_call(model, "false", True, 10, 8).kwargs == {}
    lines = [r.getMessage() for r in caplog.records if "decodes eagerly" in r.getMessage()]
    assert lines == ["generation decodes eagerly: generate_compiled: false"]


def test_generate_compiled_reads_yaml_booleans_as_the_words():
    """``generate_compiled: true`` in YAML arrives as a bool; validate refuses what is not auto, true or false
    (tests/tools/test_validation.py)."""
    from fsdp_peft.settings.config import RecipeArguments

    assert RecipeArguments(generate_compiled=True).generate_compiled == "true"
    assert RecipeArguments(generate_compiled=" Auto").generate_compiled == "auto"


def test_4_bit_layers_compute_with_their_weights_dequantized_for_the_block_then_are_back(tiny_model_dir):
    """Every 4-bit layer replaced by a plain one holding its weight dequantized, computing what bitsandbytes'
    own forward computes (training mode: its dequantize-and-multiply path; eval mode on an AVX512-BF16 CPU repacks
    the weight for a kernel of its own), within the budget; the 4-bit layers back, untouched, after."""
    import bitsandbytes as bnb

    from conftest import tiny_llama_in_4bit
    from fsdp_peft.tools.generation import DequantizedLinear, adapters_merged, four_bit_dequantized

    model = lora_model(tiny_model_dir, base=tiny_llama_in_4bit(tiny_model_dir)).train()
    layers = {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(layers) == 4 * 7
    name = next(n for n in layers if n.endswith("q_proj.base_layer"))
    x = torch.randn(3, layers[name].in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = layers[name](x)
    each = {n: m.in_features * m.out_features * 2 for n, m in layers.items()}  # bf16 bytes
    with four_bit_dequantized(model, None) as used:
        dense = dict(model.named_modules())
        assert used == sum(each.values()) and not any(isinstance(dense[n], bnb.nn.Linear4bit) for n in layers)
        assert type(dense[name]) is DequantizedLinear and dense[name].weight.dtype == torch.bfloat16
        with torch.no_grad():
            assert torch.equal(dense[name](x), expected)
        with adapters_merged(model, None) as merged:  # QLoRA's update stays apart from the 16-bit weight
            assert merged == 0
    assert all(dict(model.named_modules())[n] is m for n, m in layers.items())
    budget = sum(sorted(each.values())[:3])
    with four_bit_dequantized(model, budget) as used:
        assert 0 < used <= budget
        assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) < len(layers)
