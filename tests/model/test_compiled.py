"""The compiled step (`fsdp_peft.model.compiled`, ``compile: true``): each decoder layer's training forward compiled.

The reference never calls the code under test: one eager process, without FSDP, on the same global batch.
"""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import REPO, launch_recipe, logged_losses, read_json, run_launch
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.model.compiled import compile_layers

SHORT = ["--max_steps", "6", "--logging_steps", "1", "--warmup_steps", "0", "--generate_samples", "0"]
SHORT += ["--generate_eval_samples", "0"]
GRAPH_BOUND = 8  # dynamo's own recompile limit per frame: past it a layer would run eager without a word


def test_each_layer_runs_its_compiled_forward_in_training_and_the_eager_one_otherwise():
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_hidden_layers": 3}
    config = LlamaConfig(vocab_size=64, **sizes)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8))
    eager = model(input_ids=ids).logits
    assert compile_layers(model) == 3
    model.eval()
    before = counters["stats"]["unique_graphs"]
    assert torch.equal(model(input_ids=ids).logits, eager)
    assert counters["stats"]["unique_graphs"] == before  # evaluation and generate: the eager forward
    model.train()
    torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, eager, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] > before


@pytest.mark.parametrize(
    ("recipe", "overrides", "expected"),
    [
        ("llama_qlora", [], "compile: true with load_in_4bit: true: under FSDP bitsandbytes re-wraps"),
        ("qwen_moe_lora", [], "compile: true with LoRA on the experts (lora_target_parameters)"),
        ("llama_lora", ["--torch_compile", "true"], "compile: true compiles each layer; torch_compile: true"),
    ],
)
def test_what_compile_cannot_run_yet_is_refused_in_one_line_before_weights(recipe, overrides, expected):
    from fsdp_peft.recipe import parse_recipe_config

    config = REPO / "configs" / recipe / "tiny.yaml"
    with pytest.raises(ConfigError) as refused:
        parse_recipe_config(["--compile", "true", *overrides], config, "outputs/unused")
    assert str(refused.value).startswith(expected) and "\n" not in str(refused.value)


@pytest.mark.slow
def test_two_compiled_ranks_train_as_one_eager_process_with_few_graphs(tmp_path):
    """fp32 LoRA, FSDP2: 6 steps of rows of varying length on 2 ranks, every layer compiled, against one eager
    process without FSDP on the same global batch (32 rows)."""
    compiled, eager = tmp_path / "compiled", tmp_path / "eager"
    result = launch_recipe("llama_lora", *SHORT, "--compile", "true", "--output_dir", str(compiled))
    single = [sys.executable, str(REPO / "recipes" / "llama_lora.py"), *SHORT, "--output_dir", str(eager)]
    reference = run_launch([*single, "--per_device_train_batch_size", "32"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    losses, expected = logged_losses(compiled), logged_losses(eager)
    assert len(losses) == len(expected) == 6
    worst = max(abs(losses[s] - expected[s]) / abs(expected[s]) for s in expected)
    assert worst <= 1e-5, (losses, expected)  # the suite's fp32 LoRA bound for 2 ranks against one process
    report = read_json(compiled / "results.json")["compiled"]
    assert report["layers"] == 4 and 1 <= report["graphs"] <= GRAPH_BOUND and report["compile_seconds"] > 0, report
    assert f"compiled: 4 layers, {report['graphs']} graphs" in result.stdout + result.stderr
    assert "recompile_limit" not in result.stderr
