"""Both recipes end to end under FSDP2 on 2 real gloo ranks, checked against an unsharded reference."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import launch_recipe, read_json
from fsdp_peft.config import RecipeArguments
from fsdp_peft.data import IGNORE_INDEX, data_files, read_examples, tokenized_dataset

STEPS = 30
SAMPLES = 16
TINY_LAYERS = 4
EXPECTED_UNITS = [
    "",
    "base_model.model.model.embed_tokens",
    *[f"base_model.model.model.layers.{i}" for i in range(TINY_LAYERS)],
    "base_model.model.lm_head",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["llama_lora", "llama_qlora"])
def run(request, tmp_path_factory, tiny_model_dir):
    """One short 2-rank run of the recipe; the tests below read what it left in ``output_dir``."""
    output_dir = tmp_path_factory.mktemp(request.param)
    result = launch_recipe(
        request.param,
        "--output_dir", str(output_dir), "--max_steps", str(STEPS), "--logging_steps", "5",
        "--warmup_steps", "0", "--generate_samples", str(SAMPLES),
    )  # fmt: skip
    return {"recipe": request.param, "dir": output_dir, "stdout": result.stdout, "model": tiny_model_dir}


def test_decoder_layers_are_fsdp_units_and_every_parameter_is_sharded(run):
    layout = read_json(run["dir"] / "fsdp_layout.json")
    assert layout["world_size"] == 2
    assert layout["units"] == EXPECTED_UNITS
    for parameter in layout["parameters"]:
        assert parameter["placements"] == ["S(0)"], parameter["name"]
        assert parameter["local_shape"][0] == math.ceil(parameter["shape"][0] / 2), parameter["name"]
    trainable = [p for p in layout["parameters"] if p["trainable"]]
    assert trainable and all(".lora_" in p["name"] for p in trainable)
    if run["recipe"] == "llama_qlora":
        packed = [p for p in layout["parameters"] if p["name"].endswith("q_proj.base_layer.weight")]
        assert packed and all(p["dtype"] == "bfloat16" and p["shape"][1] == 1 for p in packed)  # 4-bit, bf16 storage


def test_training_loss_decreases(run):
    state = read_json(run["dir"] / "trainer_state.json")
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert state["global_step"] == STEPS
    assert len(losses) == STEPS // 5
    assert losses[-1] < 0.95 * losses[0], losses


def _reference_model(run, recipe_name):
    """Base + saved adapter in one plain process, loaded by transformers and peft alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if recipe_name == "llama_qlora":
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16,
        )  # fmt: skip
        base = AutoModelForCausalLM.from_pretrained(run["model"], dtype=torch.bfloat16, quantization_config=quantization)
    else:
        base = AutoModelForCausalLM.from_pretrained(run["model"], dtype=torch.float32)
    for module in base.modules():  # the reference must not take bitsandbytes' CPU repacking path either
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return PeftModel.from_pretrained(base, run["dir"] / "adapter").eval()


def test_saved_adapter_on_a_fresh_unsharded_base_reproduces_the_eval_loss(run):
    from transformers import AutoTokenizer

    model = _reference_model(run, run["recipe"])
    tokenizer = AutoTokenizer.from_pretrained(run["model"])
    recipe = RecipeArguments(max_seq_length=64)
    _, eval_path = data_files(recipe)
    rows = tokenized_dataset(read_examples(eval_path), tokenizer, recipe, eval_path)
    total, count = 0.0, 0
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=run["recipe"] == "llama_qlora")
    with torch.no_grad(), autocast:
        for row in rows:
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1].float()
            labels = torch.tensor(row["labels"][1:])
            keep = labels != IGNORE_INDEX
            total += torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
            count += int(keep.sum())
    reference = total / count
    results = read_json(run["dir"] / "results.json")
    assert results["fsdp"] is True
    assert abs(results["eval_loss"] - reference) <= 1e-4, (results["eval_loss"], reference)


def test_generation_from_the_sharded_model_is_reported(run):
    samples = [json.loads(line) for line in (run["dir"] / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == SAMPLES
    _, eval_path = data_files(RecipeArguments())
    expected = read_examples(eval_path)[:SAMPLES]
    assert [s["prompt"] for s in samples] == [e.prompt for e in expected]
    assert [s["expected"] for s in samples] == [e.completion for e in expected]
    results = read_json(run["dir"] / "results.json")
    assert results["exact_match_after"] == sum(s["exact"] for s in samples) / SAMPLES
    assert results["exact_match_before"] == 0.0
    assert "exact match on 16 held-out prompts: before training 0.000" in run["stdout"]


def test_sharded_greedy_generation_matches_the_unsharded_model(run):
    from transformers import AutoTokenizer

    from fsdp_peft.generation import generate_completions
    from fsdp_peft.data import render_prompt

    model = _reference_model(run, run["recipe"])
    tokenizer = AutoTokenizer.from_pretrained(run["model"])
    samples = [json.loads(line) for line in (run["dir"] / "samples.jsonl").read_text().splitlines()]
    prompts = [render_prompt(tokenizer, s["prompt"], use_chat_template=True) for s in samples]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=run["recipe"] == "llama_qlora")
    with autocast:
        unsharded = generate_completions(model, tokenizer, prompts, 8, 50, torch.device("cpu"))
    assert unsharded == [s["generated"] for s in samples]
