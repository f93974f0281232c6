"""Low-memory loading (FSDP2 ``cpu_ram_efficient_loading``): only rank 0 reads, and the result is exact.

The distributed tests launch ``tests/distributed/loading_check.py`` on 2 gloo ranks with the CPU FSDP2
accelerate config, once with ordinary loading and once with ``--fsdp_cpu_ram_efficient_loading true``,
and compare what every rank holds after training: parameter shards, 4-bit quant states, losses.
"""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import ACCELERATE_CPU_FSDP2, REPO, free_port, last_json_line, run_launch
from fsdp_peft.settings.config import RecipeArguments

CHECK = REPO / "tests" / "distributed" / "loading_check.py"
STEPS = 3
_runs: dict = {}


def launch_loading_check(out, *launch_flags: str, qlora: bool = False, check_args: tuple = ()) -> dict:
    """One ``accelerate launch`` of the check; returns rank 0's report (and leaves per-rank shards in ``out``)."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ACCELERATE_CPU_FSDP2),
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        *launch_flags,
        str(CHECK),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        *(["--qlora"] if qlora else []),
        *check_args,
    ]
    result = run_launch(command)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return {**last_json_line(result.stdout), "stdout": result.stdout}


def loading_run(kind: str, low_memory: bool, tmp_path_factory) -> dict:
    """A cached run: ``kind`` lora (fp32) or qlora (nf4, bf16 storage), ordinary or low-memory loading."""
    key = (kind, low_memory)
    if key not in _runs:
        out = tmp_path_factory.mktemp(f"{kind}_{'low' if low_memory else 'ordinary'}")
        flags = ["--fsdp_cpu_ram_efficient_loading", str(low_memory).lower()]
        _runs[key] = {"report": launch_loading_check(out, *flags, qlora=kind == "qlora"), "dir": out}
    return _runs[key]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits: packed 4-bit weights stored as bf16 hold NaN patterns, which never compare equal."""
    return tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_low_memory_loading_gives_every_rank_the_shards_and_losses_of_ordinary_loading(
    kind, tmp_path_factory, tiny_model_dir
):
    ordinary, low = loading_run(kind, False, tmp_path_factory), loading_run(kind, True, tmp_path_factory)
    assert (ordinary["report"]["low_memory_loading"], low["report"]["low_memory_loading"]) == (False, True)
    assert "[fsdp-peft] low-memory loading: rank 0 read 39 tensors" in low["report"]["stdout"]
    assert "low-memory loading" not in ordinary["report"]["stdout"]
    for rank in (0, 1):
        want = torch.load(ordinary["dir"] / f"shards-rank{rank}.pt")
        got = torch.load(low["dir"] / f"shards-rank{rank}.pt")
        assert got["parameters"].keys() == want["parameters"].keys()
        for name, tensor in want["parameters"].items():
            assert got["parameters"][name].shape == tensor.shape, (rank, name)
            assert torch.equal(_bits(got["parameters"][name]), _bits(tensor)), (rank, name)
        assert len(got["quant_states"]) == len(want["quant_states"]) == (28 if kind == "qlora" else 0)
        for module, state in want["quant_states"].items():
            for key, value in state.items():
                received = got["quant_states"][module][key]
                same = torch.equal(received, value) if torch.is_tensor(value) else received == value
                assert same, (rank, module, key)
    losses, reference = low["report"]["losses"], ordinary["report"]["losses"]
    assert len(losses) == STEPS
    assert losses == reference  # measured bitwise equal for both (fp32 LoRA and bf16 QLoRA)


def test_low_memory_loading_is_asked_for_by_fsdp2_cpu_ram_efficient_loading_on_several_ranks(monkeypatch):
    from fsdp_peft.model.loading import low_memory_loading_requested

    def requested(**env) -> bool:
        for key in ("FSDP_CPU_RAM_EFFICIENT_LOADING", "ACCELERATE_USE_FSDP", "FSDP_VERSION", "WORLD_SIZE"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return low_memory_loading_requested()

    launcher = {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"}
    assert requested(FSDP_CPU_RAM_EFFICIENT_LOADING="true", FSDP_VERSION="2", **launcher)
    assert not requested(FSDP_CPU_RAM_EFFICIENT_LOADING="true", FSDP_VERSION="1", **launcher)
    assert not requested(FSDP_CPU_RAM_EFFICIENT_LOADING="false", FSDP_VERSION="2", **launcher)
    assert not requested(FSDP_CPU_RAM_EFFICIENT_LOADING="true", FSDP_VERSION="2", **{**launcher, "WORLD_SIZE": "1"})
    recipe_route = {"fsdp": True, "fsdp_config": {"cpu_ram_efficient_loading": True}}  # FSDP2 by default
    assert not requested(WORLD_SIZE="2")
    assert low_memory_loading_requested(recipe_route)
    assert not low_memory_loading_requested(
        {**recipe_route, "fsdp_config": {"fsdp_version": 1, "fsdp_cpu_ram_efficient_loading": "true"}}
    )


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
def test_skeleton_has_the_modules_shapes_and_dtypes_from_pretrained_builds(qlora, tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_peft.model.loading import model_skeleton, pending_checkpoint
    from fsdp_peft.model.modeling import quantization_config

    recipe = RecipeArguments(load_in_4bit=qlora, torch_dtype="bfloat16" if qlora else "float32")
    quantization = quantization_config(recipe, AutoConfig.from_pretrained(tiny_model_dir))
    dtype = getattr(torch, recipe.torch_dtype)
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype, quantization_config=quantization)
    skeleton = model_skeleton(tiny_model_dir, dtype, quantization)
    assert pending_checkpoint(skeleton) == str(tiny_model_dir) and pending_checkpoint(loaded) is None
    classes = [(n, type(m).__name__) for n, m in loaded.named_modules()]
    assert [(n, type(m).__name__) for n, m in skeleton.named_modules()] == classes
    want = {n: (type(p).__name__, p.shape, p.dtype) for n, p in loaded.named_parameters()}
    assert {n: (type(p).__name__, p.shape, p.dtype) for n, p in skeleton.named_parameters()} == want
    assert all(p.is_meta for p in skeleton.parameters())
    assert sum(type(p).__name__ == "Params4bit" for p in skeleton.parameters()) == (28 if qlora else 0)
    for name, buffer in loaded.named_buffers():  # rotary frequencies: computed, so real and equal
        assert torch.equal(dict(skeleton.named_buffers())[name], buffer), name
    assert skeleton.training is loaded.training is False
    assert getattr(skeleton, "is_loaded_in_4bit", False) is getattr(loaded, "is_loaded_in_4bit", False)


def test_skeleton_of_a_tied_model_shares_embeddings_and_head_as_from_pretrained_does(tmp_path, tiny_model_dir):
    """One weight, which the checkpoint stores once: low-memory loading reads it once and ties it again."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    from fsdp_peft.model.loading import model_skeleton

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    skeleton = model_skeleton(tmp_path, torch.float32)
    assert [n for n, _ in skeleton.named_parameters()] == [n for n, _ in loaded.named_parameters()]
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight


def test_adapters_on_a_skeleton_are_the_adapters_of_a_loaded_model(tiny_model_dir):
    """Same random initialisation, on the CPU, and the random stream left where loading leaves it."""
    from transformers import TrainingArguments, set_seed

    from fsdp_peft.model.loading import model_skeleton
    from fsdp_peft.model.modeling import attach_lora, load_base_model

    recipe = RecipeArguments(torch_dtype="float32", lora_r=8)
    training = TrainingArguments(output_dir=str(tiny_model_dir / "unused"), report_to=[])
    set_seed(3)
    loaded = attach_lora(load_base_model(recipe), recipe, training)
    after_loaded = torch.rand(4)
    set_seed(3)
    skeleton = attach_lora(model_skeleton(tiny_model_dir, torch.float32), recipe, training)
    after_skeleton = torch.rand(4)
    want = {n: p for n, p in loaded.named_parameters() if p.requires_grad}
    got = {n: p for n, p in skeleton.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and len(want) == 56
    for name, parameter in want.items():
        assert got[name].device.type == "cpu" and torch.equal(got[name], parameter), name
    assert torch.equal(after_skeleton, after_loaded)
    assert all(p.is_meta for n, p in skeleton.named_parameters() if not p.requires_grad)


def test_reading_plan_goes_largest_first_and_names_what_it_cannot_read(tmp_path, tiny_model_dir):
    from fsdp_peft.model.loading import reading_plan

    with torch.device("meta"):
        missing = {
            "base_model.model.model.norm.weight": torch.empty(128),
            "base_model.model.model.embed_tokens.weight": torch.empty(262, 128),
            "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight": torch.empty(128, 128),
        }
    plan = reading_plan(str(tiny_model_dir), missing)
    assert list(plan.values()) == [[[*missing][1], [*missing][2], [*missing][0]]]  # one file, largest first
    assert reading_plan(str(tmp_path), missing).startswith(f"cpu_ram_efficient_loading: cannot read {tmp_path}")
    extra = {**missing, "base_model.model.extra.weight": torch.empty(1, device="meta")}
    problem = reading_plan(str(tiny_model_dir), extra)
    assert "lacks 1 weights the model needs (e.g. extra.weight)" in problem
    assert "cpu_ram_efficient_loading: false" in problem


@pytest.mark.slow
@pytest.mark.parametrize("low_memory", [False, True], ids=["ordinary", "low_memory"])
def test_the_4bit_weights_each_rank_holds_gather_to_one_process_load_and_decode_to_the_reference(
    low_memory, tmp_path_factory, tiny_model_dir
):
    """Held out: every 4-bit weight of a QLoRA run, its two ranks' shards put together (as FSDP2's all-gather does),
    is byte for byte transformers' own one-process 4-bit load of the base with the same quant state; the reference
    decoder (tests/four_bit_reference.py, the NF4 definition) reads it within 0.1 (relative) of the checkpoint's bf16
    weight, where a right NF4 round trip is 0.09."""
    import bitsandbytes.functional as bnb_functional
    from four_bit_reference import decode, relative_error
    from safetensors.torch import load_file

    from conftest import tiny_llama_in_4bit

    run = loading_run("qlora", low_memory, tmp_path_factory)
    ranks = [torch.load(run["dir"] / f"shards-rank{rank}.pt") for rank in (0, 1)]
    one_process = tiny_llama_in_4bit(tiny_model_dir)
    original = load_file(tiny_model_dir / "model.safetensors")
    checked, worst = 0, 0.0
    for module, state in ranks[0]["quant_states"].items():
        key = module.removeprefix("base_model.model.").replace(".base_layer", "")
        name = f"{module}.weight"
        gathered = torch.cat([rank["parameters"][name] for rank in ranks])
        loaded = one_process.get_submodule(key).weight
        assert torch.equal(_bits(gathered), _bits(loaded.data.reshape(gathered.shape))), key
        quant_state = bnb_functional.QuantState.from_dict(state, torch.device("cpu"))
        weight = decode(gathered, quant_state)
        assert torch.equal(weight, decode(loaded.data, loaded.quant_state)), key
        worst = max(worst, relative_error(weight, original[f"{key}.weight"]))
        checked += 1
    print(f"4-bit weights gathered from 2 ranks vs bf16: largest relative error {worst:.3f}")
    assert checked == 28 and worst <= 0.1


@pytest.mark.slow
def test_ordinary_loading_frees_each_units_weights_as_fsdp2_shards_it(tmp_path):
    """Accelerate holds a state dict of the unsharded model through FSDP2's sharding (read by its low-memory branch
    only): every rank peaked at its whole model plus its shards (one H200: twice the weights on one rank). The
    sharding step frees each unit's weights as it goes
    (`fsdp_peft.core._compat.accelerate_patches.originals_released_while_sharding`). Measured here on this model (517
    MiB in fp32 a rank, 258 MiB of shards): +26 MiB of anonymous memory while sharding; +265 MiB with accelerate's
    behaviour (``--keep-originals``), 2026-12-04."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from fsdp_peft.model.paths import tiny_model_path

    model_dir = tmp_path / "model"
    config = LlamaConfig(
        vocab_size=16000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    weights = sum(p.numel() for p in model.parameters()) * 4  # fp32, as the check reads them
    model.to(torch.bfloat16).save_pretrained(model_dir)  # bf16 read as fp32: each rank's weights its own memory
    AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(model_dir)
    report = launch_loading_check(tmp_path / "out", check_args=("--model", str(model_dir), "--no-train"))
    for samples, called in zip(report["rss_samples"], report["training_called"]):
        before = [anonymous for at, _, anonymous in samples if at <= called][-1]
        sharding = max(anonymous for at, _, anonymous in samples if at > called)
        grown, shards = (sharding - before) / 2**20, weights / 2**21
        print(f"anonymous memory while sharding: +{grown:.0f} MiB; shards {shards:.0f} MiB")
        assert sharding - before < 0.25 * weights / 2  # a unit's shard and Trainer's own, not every unit's weights
