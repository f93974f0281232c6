"""The compiled step (`fsdp_peft.model.compiled`, ``compile: true``): each decoder layer's training forward compiled.

The reference never calls the code under test: one eager process, without FSDP, on the same global batch.
"""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import REPO, launch_recipe, logged_losses, read_json, run_launch
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.model.compiled import compile_layers, eager_layers


def test_each_layer_runs_its_compiled_forward_in_training_and_the_eager_one_otherwise():
    """Otherwise: evaluation, and generation (`eager_layers`: GRPO's rollouts run in training mode)."""
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
    with eager_layers(), torch.no_grad():  # GRPO's rollouts: training mode, a KV cache that grows
        assert torch.equal(model(input_ids=ids).logits, eager)
    assert counters["stats"]["unique_graphs"] == before
    torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, eager, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] > before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nested", [False, True], ids=["scales", "nested-scales"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_a_compiled_4_bit_layer_computes_what_bitsandbytes_computes_and_saves_no_dequantized_weight(
    dtype, nested, bias
):
    """bitsandbytes' own ``Linear4bit`` (eager, its training matmul) against the same layer compiled, where it runs
    `four_bit_linear`: output and input gradient bit for bit (compute and storage in ``dtype``, double quantization
    of the block scales on and off, a bias and none); and what the compiled step keeps for backward: the packed
    weight and its scales, never the dequantized weight (which the compiler, seeing the dequantization in forward and
    backward, would otherwise merge and save)."""
    import bitsandbytes as bnb

    from fsdp_peft.core._compat.bitsandbytes_patches import (
        cpu_4bit_dequantization_block_aligned,
        cpu_weight_repacking_disabled,
    )
    from fsdp_peft.model.compiled import _four_bit_when_compiled

    cpu_4bit_dequantization_block_aligned()  # as a recipe's start applies it: bitsandbytes' CPU kernel mended
    torch.manual_seed(0)
    options = {"compute_dtype": dtype, "compress_statistics": nested, "quant_type": "nf4", "quant_storage": dtype}
    layer = bnb.nn.Linear4bit(96, 64, bias=bias, **options)
    weight = torch.randn(64, 96).to(dtype)
    layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, module=layer, **options | {"compute_dtype": None})
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(64).to(dtype), requires_grad=False)
    layer = layer.to("cpu")
    cpu_weight_repacking_disabled(layer)
    x = torch.randn(6, 96, dtype=dtype, requires_grad=True)
    eager = layer(x)
    eager.float().pow(2).sum().backward()
    eager_gradient, x.grad = x.grad, None
    layer.forward = _four_bit_when_compiled(layer, layer.forward)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        compiled = torch.compile(layer, backend="aot_eager")(x)
    compiled.float().pow(2).sum().backward()
    assert torch.equal(compiled, eager) and torch.equal(x.grad, eager_gradient)
    assert saved and weight.numel() not in saved, saved


@pytest.mark.parametrize(
    ("recipe", "overrides", "expected"),
    [
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


def compiled_against_eager(recipe: str, arguments: list[str], rows: int, steps: int, directory):
    """``recipe`` with ``compile: true`` on 2 FSDP2 ranks of ``rows`` rows each, and eager in one process without
    FSDP on the same global batch: the largest relative loss difference over ``steps`` logged steps and the compiled
    run's ``compiled`` report (the launch did not reach dynamo's recompile limit)."""
    compiled, eager = directory / "compiled", directory / "eager"
    result = launch_recipe(recipe, *arguments, "--per_device_train_batch_size", str(rows), "--compile", "true",
                           "--output_dir", str(compiled))  # fmt: skip
    single = [sys.executable, str(REPO / "recipes" / f"{recipe}.py"), *arguments, "--output_dir", str(eager)]
    reference = run_launch([*single, "--per_device_train_batch_size", str(2 * rows)])
    assert reference.returncode == 0, reference.stderr[-3000:]
    losses, expected = logged_losses(compiled), logged_losses(eager)
    assert len(losses) == len(expected) == steps, (losses, expected)
    assert "recompile_limit" not in result.stderr
    worst = max(abs(losses[s] - expected[s]) / abs(expected[s]) for s in expected)
    return worst, read_json(compiled / "results.json")["compiled"]


# fp32 QLoRA: the 4-bit weights are the same bytes on both sides and every matmul computes in fp32, so what is left
# is compilation's own rounding (in bf16, inductor's fused pointwise ops round differently from eager's: 7.2e-5
# measured on this pair, against 1.8e-5 for the same pair both eager)
FP32_QLORA = ["--torch_dtype", "float32", "--bnb_4bit_compute_dtype", "float32", "--bnb_4bit_quant_storage", "float32"]
MOE_SHORT = ["--max_steps", "3", "--logging_steps", "1", "--warmup_steps", "0", "--lr_scheduler_type", "constant"]
MOE_SHORT += ["--generate_samples", "0", "--generate_eval_samples", "0", "--eval_strategy", "no", "--bf16", "false"]
MOE_SHORT += ["--router_aux_loss_coef", "0", "--lora_target_parameters", "", *FP32_QLORA]


@pytest.mark.slow
def test_two_compiled_ranks_train_a_4_bit_mixture_of_experts_as_one_eager_process(tmp_path):
    """QLoRA on the tiny Qwen3-MoE (attention's 4-bit linear layers adapted, the 4-bit experts frozen), FSDP2, every
    layer compiled (`FourBitLinear` for bitsandbytes' layers), 3 steps on 2 ranks against one eager process without
    FSDP on the same global batch (32 rows)."""
    worst, report = compiled_against_eager("qwen_moe_qlora", MOE_SHORT, 16, 3, tmp_path)
    assert worst <= 1e-5, worst  # fp32 (measured 8.7e-8); the QLoRA bound in bf16 is 1e-4
    # A mixture of experts' layer breaks its graph once, where transformers' hook that records the router's
    # output reads a ContextVar (which dynamo cannot trace): two graphs a layer, and a first layer apart.
    assert report["layers"] == 4 and 1 <= report["graphs"] <= 16, report  # measured 13
