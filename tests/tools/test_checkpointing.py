"""Activation checkpointing chosen by the plan (`fsdp_peft.settings.checkpointing`,
`fsdp_peft.tools.plan.choose_checkpointing`).

References outside the code under test: transformers' own ``activation_checkpointing_enable`` says which layers a
choice checkpoints; autograd's saved-tensor hooks measure what a forward leaves for backward; a run with every layer
checkpointed gives the losses a partly checkpointed run must repeat.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_plan import recipe_config

from conftest import REPO, launch_recipe, logged_losses, read_json
from fsdp_peft.settings.checkpointing import (
    AUTO,
    NONE,
    Checkpointing,
    CheckpointingChoice,
    apply_checkpointing,
    candidates,
    every,
    requested,
)
from fsdp_peft.tools.plan import activation_peak_and_saved, load_model_config

LORA_TINY = REPO / "configs" / "llama_lora" / "tiny.yaml"
ROWS, LENGTH, CHUNK = 16, 64, 512  # the tiny LoRA config's batch per rank and max_seq_length; its loss chunk


def checkpointed_layers(model) -> list[bool]:
    return [bool(layer.gradient_checkpointing) for layer in model.model.layers]


def tiny_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=layers)
    return LlamaForCausalLM(config)


def test_auto_offers_every_count_fewest_first_then_offload_where_a_device_can_take_it():
    found = candidates(7, offload_possible=True)
    assert [c.count for c in found] == [0, 1, 2, 3, 4, 5, 6, 7, 7] and found[-1] == every(7, offload=True)
    assert candidates(7, offload_possible=False)[-1] == every(7)  # no device to offload from (CPU)


@pytest.mark.parametrize("count", [0, 1, 3, 7])
def test_the_recipe_checkpoints_the_first_layers_of_the_plans_count(count):
    model = tiny_llama(7)
    choice = CheckpointingChoice(Checkpointing(count), 7, "test", by_the_recipe=True)
    assert apply_checkpointing(model, choice) == count
    assert checkpointed_layers(model) == [index < count for index in range(7)]


def test_a_configs_own_setting_is_left_to_the_trainer():
    model = tiny_llama(7)
    assert apply_checkpointing(model, CheckpointingChoice(every(7), 7, "as the config sets it")) == 0
    assert checkpointed_layers(model) == [False] * 7


@pytest.mark.parametrize("spacing", [1, 2, 3, 7])
def test_a_configs_every_n_layers_counts_the_layers_transformers_checkpoints(spacing):
    model = tiny_llama(7)
    model.activation_checkpointing_enable(every_n_layers=spacing)  # transformers' own placement: the reference
    values = {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"every_n_layers": spacing}}
    asked = requested(values, 7)
    assert asked.count == sum(checkpointed_layers(model))
    assert asked.top() == max(i for i, on in enumerate(checkpointed_layers(model)) if on)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, AUTO),
        ({"activation_checkpointing": "auto"}, AUTO),
        ({"gradient_checkpointing": "auto"}, AUTO),
        ({"activation_checkpointing": False}, NONE),
        ({"activation_checkpointing": True}, every(32)),
        ({"gradient_checkpointing": True}, every(32)),
        (
            {
                "activation_checkpointing": True,
                "activation_checkpointing_kwargs": {"every_n_layers": 3, "offload": True},
            },
            Checkpointing(11, 3, offload=True),
        ),
    ],
)
def test_the_config_asks_for_auto_unless_it_says_true_false_or_a_spacing(values, expected):
    assert requested(values, 32) == expected


def test_a_choice_is_described_as_the_summary_and_the_plan_print_it():
    assert Checkpointing(11, 3).describe(32) == "11 of 32 layers (every 3rd)"
    assert Checkpointing(20).describe(32) == "20 of 32 layers" and every(4).describe(4) == "all 4 layers"
    assert every(4, offload=True).describe(4) == "all 4 layers, inputs offloaded to host memory"
    assert NONE.describe(4) == "none"


def measured_saved_bytes(model, count: int) -> int:
    """What one forward of the tiny config's batch leaves for backward: autograd's saved tensors (the hooks see the
    layers that are not checkpointed, the final norm and the loss), plus the inputs the checkpointed layers hold
    for their recomputation (invisible to the hooks); each storage once, parameters left out."""
    from fsdp_peft.model.loss import head_computes_loss

    base = model.get_base_model()
    base.activation_checkpointing_disable()
    apply_checkpointing(model, CheckpointingChoice(Checkpointing(count), len(base.model.layers), "test", True))
    ids = torch.randint(0, base.config.vocab_size, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def keep(tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()

    def pack(tensor):
        keep(tensor)
        return tensor

    def layer_input(module, args, kwargs):
        if module.gradient_checkpointing:
            keep(args[0] if args else kwargs["hidden_states"])

    handles = [layer.register_forward_pre_hook(layer_input, with_kwargs=True) for layer in base.model.layers]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), head_computes_loss(base, ids, CHUNK):
            loss = model(input_ids=ids, labels=ids).loss
    finally:
        for handle in handles:
            handle.remove()
    del loss
    return sum(seen.values())


def test_the_saved_bytes_of_every_choice_are_the_plans_within_10_percent(tiny_model_dir):
    """Tiny LoRA model as the recipe configures it (fp32, LoRA r 32 on every linear layer, chunked loss), one rank's
    batch of 16 x 64 tokens: for 0 to 4 layers checkpointed, measured against the plan's saved part."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fsdp_peft.settings.config import RecipeArguments

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(base, LoraConfig(r=32, lora_alpha=128, target_modules="all-linear")).train()
    recipe = RecipeArguments(lora_dropout=0.0, loss_chunk_tokens=CHUNK)
    model_config = load_model_config(str(tiny_model_dir))
    figures = {}
    for choice in candidates(model_config.num_hidden_layers, offload_possible=False):
        _, planned = activation_peak_and_saved(model_config, recipe, ROWS * LENGTH, 4, choice, CHUNK, 7 * 32)
        figures[choice.count] = (measured_saved_bytes(model, choice.count), planned)
    assert sorted(figures) == [0, 1, 2, 3, 4]
    print("layers checkpointed: (measured, planned) saved bytes", figures)
    for layers, (measured, planned) in figures.items():
        assert abs(measured - planned) <= 0.10 * measured, (layers, figures)
    measured = [figures[count][0] for count in range(5)]
    assert measured == sorted(measured, reverse=True) and len(set(measured)) == 5  # each checkpointed layer saves


@pytest.mark.slow
def test_auto_under_a_memory_cap_checkpoints_the_plans_layers_and_trains_as_every_layer_checkpointed(tmp_path):
    """2 ranks, FSDP2, fp32 LoRA: a device_memory cap under which the plan takes 2 of 4 layers; the run checkpoints
    those (memory.json counts the flags in force on each rank), says why, and its losses are the fully checkpointed
    run's (recomputation changes no number)."""
    from fsdp_peft.procedures.sft import SFT_PROCEDURE
    from fsdp_peft.settings.config import resolve_recipe_config
    from fsdp_peft.tools.plan import plan_recipe

    short = {"max_steps": 4, "logging_steps": 1, "generate_samples": 0, "generate_eval_samples": 0}
    config = recipe_config(tmp_path, "lora", **short)
    recipe, training, _ = resolve_recipe_config(["--config", str(config)], config, str(tmp_path))
    plan = plan_recipe(recipe, training, SFT_PROCEDURE, str(config), 2, 2**40, offload_possible=False)
    peaks = {choice["checkpointing"]: choice["peak"] for choice in plan.checkpointing_choices}
    cap = math.ceil(peaks["2 of 4 layers"] / 0.9)  # within 90%: the fewest layers that fit it
    assert peaks["1 of 4 layers"] > 0.9 * cap  # ... and one layer is not enough

    runs = {}
    for name, setting in (("auto", ["--device_memory", str(cap)]), ("all", ["--activation_checkpointing", "true"])):
        out = tmp_path / name
        launch_recipe("llama_lora", "--config", str(config), "--output_dir", str(out), *setting)
        runs[name] = out
    chosen = read_json(runs["auto"] / "results.json")["activation_checkpointing"]
    assert (chosen["layers"], chosen["of"], chosen["spacing"], chosen["offload"]) == (2, 4, 1, False)
    assert chosen["reason"].startswith("auto: the fewest whose planned peak")
    assert read_json(runs["all"] / "results.json")["activation_checkpointing"]["reason"] == "as the config sets it"
    for name, layers in (("auto", 2), ("all", 4)):
        ranks = read_json(runs[name] / "memory.json")["ranks"]
        assert [r["checkpointed_layers"] for r in ranks] == [layers, layers], json.dumps(ranks)[:500]
    auto, every = logged_losses(runs["auto"]), logged_losses(runs["all"])
    assert len(auto) == len(every) == 4
    assert max(abs(auto[s] - every[s]) / abs(every[s]) for s in every) <= 1e-6, (auto, every)
