"""The memory planner (`fsdp_peft.tools.plan`, ``fsdp-peft plan``) and the measured accounting
(`fsdp_peft.procedures.memory`)."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from pathlib import Path

import pytest
import torch

from conftest import REPO, launch_recipe, read_json
from fsdp_peft.cli import _environment, launcher_environment, main
from fsdp_peft.procedures.registry import plan_config

CPU_FSDP2 = REPO / "configs" / "accelerate" / "cpu_fsdp2.yaml"
RECIPES = {
    "lora": "llama_lora",
    "qlora": "llama_qlora",
    "qwen-vl-qlora": "qwen_vl_qlora",
    "gemma3-vl-qlora": "gemma3_vl_qlora",
}


def recipe_config(tmp_path: Path, method: str, **overrides) -> Path:
    """A recipe YAML: the recipe's embedded default plus ``overrides``."""
    values = {"include": str(REPO / "configs" / RECIPES[method] / "tiny.yaml"), **overrides}
    path = tmp_path / f"{method}.yaml"
    path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in values.items()))
    return path


def plan_for(config: Path, world_size: int, gpu_memory: int = 80 * 2**30):
    launcher = launcher_environment(CPU_FSDP2) if world_size > 1 else {}
    with _environment(launcher):
        return plan_config(config, world_size, gpu_memory)


@pytest.fixture(scope="module")
def loaded_models(tiny_model_dir):
    """The tiny model as each recipe really loads it: base (4-bit for QLoRA) plus LoRA adapters."""
    from fsdp_peft.model.modeling import attach_lora, load_base_model
    from fsdp_peft.settings.config import resolve_recipe_config

    models = {}
    for method, recipe in RECIPES.items():
        config = REPO / "configs" / recipe / "tiny.yaml"
        args, training, _ = resolve_recipe_config(["--config", str(config)], config, "outputs")
        training_args = type("Flags", (), {"bf16": bool(training.get("bf16")), "fp16": bool(training.get("fp16"))})
        models[method] = attach_lora(load_base_model(args), args, training_args)
    return models


def first_shard_bytes(tensor: torch.Tensor, world_size: int) -> int:
    """Bytes of rank 0's FSDP2 shard: the first ``torch.chunk`` along dim 0."""
    shard = torch.chunk(tensor.detach(), world_size, dim=0)[0] if tensor.dim() else tensor
    return shard.numel() * shard.element_size()


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("method", list(RECIPES))
def test_planned_parameter_bytes_per_rank_equal_those_of_the_loaded_model(loaded_models, tmp_path, method, world_size):
    model = loaded_models[method]
    plan = plan_for(recipe_config(tmp_path, method), world_size)
    frozen = sum(first_shard_bytes(p, world_size) for p in model.parameters() if not p.requires_grad)
    trainable = sum(first_shard_bytes(p, world_size) for p in model.parameters() if p.requires_grad)
    assert plan.gpu["base weights (shard)"] == frozen
    assert plan.gpu["adapter weights (shard)"] == trainable
    assert plan.gpu["gradients (shard)"] == trainable
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    assert plan.gpu["optimizer states (shard)"] == 2 * trainable + 4 * tensors  # AdamW: 2 moments + a step


def test_planned_quantization_constants_equal_those_of_the_loaded_model(loaded_models, tmp_path):
    from fsdp_peft.procedures.memory import quantization_constant_bytes

    plan = plan_for(recipe_config(tmp_path, "qlora"), 2)
    assert plan.gpu["quantization constants (whole)"] == quantization_constant_bytes(loaded_models["qlora"])


def test_sharding_over_two_ranks_halves_planned_weights_gradients_and_optimizer(tmp_path):
    config = recipe_config(tmp_path, "lora")
    one, two = plan_for(config, 1), plan_for(config, 2)
    assert 0.5 <= two.parameter_gradient_optimizer_bytes / one.parameter_gradient_optimizer_bytes <= 0.51


def test_activation_checkpointing_lowers_planned_activations_and_leaves_the_suggestions(tmp_path):
    plain = plan_for(recipe_config(tmp_path, "qlora", max_seq_length=2048), 2)
    checkpointed = plan_for(recipe_config(tmp_path, "qlora", max_seq_length=2048, gradient_checkpointing=True), 2)
    assert checkpointed.gpu["activations (est.)"] < plain.gpu["activations (est.)"]
    assert plain.gpu["activations (est.)"] - checkpointed.gpu["activations (est.)"] == next(
        s["saves"] for s in plain.suggestions if s["switch"].startswith("activation_checkpointing")
    )
    assert not any(s["switch"].startswith("activation_checkpointing") for s in checkpointed.suggestions)


def test_plan_of_a_missing_config_is_a_one_line_error_with_exit_code_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(tmp_path / "missing.yaml"), "--gpus", "2"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error:") and "missing.yaml" in error and len(error.splitlines()) == 1


def test_plan_says_it_fits_with_room_to_spare_and_exits_0(capsys, tmp_path):
    main(["plan", str(recipe_config(tmp_path, "qlora")), "--gpus", "2", "--gpu-memory", "24GiB"])
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith("fits in 24 GiB per GPU with") and "to spare" in verdict


def test_plan_that_does_not_fit_names_the_switches_and_exits_1(capsys, tmp_path):
    config = recipe_config(
        tmp_path, "lora", max_seq_length=4096, per_device_train_batch_size=64, activation_checkpointing=False
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(config), "--accelerate-config", str(CPU_FSDP2), "--gpu-memory", "4GiB", "--json"])
    assert exit_info.value.code == 1
    plan = json.loads(capsys.readouterr().out)
    assert plan["world_size"] == 2 and plan["fits"] is False
    assert plan["gpu_total"] == sum(plan["gpu"].values()) > 4 * 2**30
    assert (
        plan["verdict"].startswith("does not fit in 4 GiB per GPU")
        and "activation_checkpointing: true" in plan["verdict"]
    )


@pytest.mark.slow
def test_two_rank_run_writes_memory_json_matching_the_plan(tmp_path):
    """QLoRA under FSDP2 on 2 ranks: each rank's measured bytes are the planner's, and the shards add up."""
    config = recipe_config(
        tmp_path, "qlora", max_steps=2, generate_samples=0, generate_eval_samples=0, output_dir=str(tmp_path / "out")
    )
    launch_recipe("llama_qlora", "--config", str(config))
    report = read_json(tmp_path / "out" / "memory.json")
    assert report["world_size"] == 2 and [r["rank"] for r in report["ranks"]] == [0, 1]
    plan, whole = plan_for(config, 2), plan_for(config, 1)
    rank0 = report["ranks"][0]
    assert rank0["parameter_bytes"] == plan.gpu["base weights (shard)"] + plan.gpu["adapter weights (shard)"]
    assert rank0["gradient_bytes"] == plan.gpu["gradients (shard)"]
    assert rank0["optimizer_state_bytes"] == plan.gpu["optimizer states (shard)"]
    assert rank0["quantization_constant_bytes"] == plan.gpu["quantization constants (whole)"]
    both = sum(r["parameter_bytes"] for r in report["ranks"])
    assert both == whole.gpu["base weights (shard)"] + whole.gpu["adapter weights (shard)"]
    assert all(r["peak_rss_bytes"] >= r["peak_rss_after_loading_bytes"] > 0 for r in report["ranks"])
    assert math.isclose(rank0["parameter_gradient_optimizer_bytes"], plan.parameter_gradient_optimizer_bytes)


def test_preference_plans_count_trls_fused_head_tile_not_the_sft_loss(tmp_path):
    """DPO's log-probs come from TRL's fused head: the planner's tile is TRL's own (checked against the installed
    TRL), the transient row is one tile, and the chunked-loss switch is not suggested (it does not apply)."""
    from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    from fsdp_peft.tools.plan import TRL_TOKEN_TILE, TRL_VOCAB_TILE, load_model_config

    assert (TRL_TOKEN_TILE, TRL_VOCAB_TILE) == (TOKEN_CHUNK_SIZE, _CHUNKED_LOGPROB_CHUNK_SIZE)
    config = tmp_path / "dpo.yaml"
    config.write_text(f"include: {REPO / 'configs' / 'llama_dpo' / 'tiny.yaml'}\nloss_chunk_tokens: 0\n")
    plan = plan_for(config, 1)
    vocab, c = load_model_config("tiny-llama").vocab_size, 4  # the tiny DPO config computes in fp32
    assert plan.mixed_precision is None and vocab < TRL_VOCAB_TILE
    assert plan.preference and plan.tokens_per_rank <= TRL_TOKEN_TILE
    assert plan.gpu["loss logits, transient (est.)"] == plan.tokens_per_rank * vocab * c
    assert not any("loss_chunk_tokens" in s["switch"] for s in plan.suggestions)
    assert any("TRL's fused head" in note for note in plan.notes)


SHIPPED_CONFIGS = sorted(p for p in (REPO / "configs").glob("*/*.yaml") if p.parent.name != "accelerate")


@pytest.mark.parametrize("config", SHIPPED_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_plan_prints_a_table_for_every_shipped_config_without_network(config, capsys, monkeypatch):
    """As on a login node with no network and nothing downloaded: every hub model a shipped config names has its
    published config.json in the package (`fsdp_peft.model.paths.shipped_hub_config`), and the hub is never asked."""
    import fsdp_peft.model.paths as paths
    import fsdp_peft.tools.plan as planner
    from fsdp_peft.model.paths import resolve_model_path

    read_local = paths.local_model_config

    def nothing_downloaded(name, trust_remote_code=False):
        if Path(resolve_model_path(name)).is_dir():  # the embedded tiny models are built, not downloaded
            return read_local(name, trust_remote_code)
        raise OSError(f"{name} is not on this machine")

    class NoHub:  # the planner's AutoConfig: builds configs, never downloads one
        for_model = planner.AutoConfig.for_model

        @staticmethod
        def from_pretrained(name, **kwargs):
            raise AssertionError(f"the hub was asked for {name}")

    monkeypatch.setattr(paths, "local_model_config", nothing_downloaded)
    monkeypatch.setattr(planner, "AutoConfig", NoHub)
    gpus = ["--gpus", "2"]
    if config.name.startswith("tpu_"):  # planned for its TPU chips (without PJRT_DEVICE: the route is assumed)
        gpus = ["--gpus", "8", "--gpu-memory", "16GiB"]
    try:
        main(["plan", str(config), *gpus])
    except SystemExit as exited:
        assert exited.code == 1, capsys.readouterr().err  # 1: does not fit, said in the table's last line
    out = capsys.readouterr().out
    assert "parameters" in out and out.strip().splitlines()[-1].startswith(("fits in ", "does not fit in "))


@pytest.mark.parametrize("config", ["tpu_v5e_8.yaml", "tpu_v5p_8.yaml"])
def test_a_tpu_config_is_planned_per_chip_without_an_xla_device(config, monkeypatch):
    """Planning comes before renting the TPU: without ``PJRT_DEVICE`` the TPU configs are planned as on XLA (chips as
    ranks, SPMD), exactly what the plan gives with it set, and the plan says it assumed the route."""
    path = REPO / "configs" / "llama_lora" / config
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    anywhere = plan_config(path, 8, 16 * 2**30)
    assert "PJRT_DEVICE" not in os.environ  # set for the plan alone
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    on_tpu = plan_config(path, 8, 16 * 2**30)
    assert anywhere.fsdp == on_tpu.fsdp == "XLA FSDP v2 (SPMD)"
    assert anywhere.gpu_total == on_tpu.gpu_total
    assert anywhere.notes == [
        *on_tpu.notes,
        "planned for the TPU route its fsdp_config asks for (PJRT_DEVICE is not set here)",
    ]


def test_the_qwen3_30b_a3b_qlora_plan_stores_its_whole_base_in_at_most_0_3_of_its_bf16_bytes():
    """Qwen3-30B-A3B's experts are 94% of its weights: quantized with them (fsdp_peft.model.moe_quantization), the base
    a GPU holds is its shard of the 4-bit rows and linear layers, the bf16 embeddings and head, and the constants."""
    plan = plan_config(REPO / "configs" / "qwen_moe_qlora" / "qwen3_30b_a3b.yaml", 2, 24 * 2**30)
    counts = plan.counts
    assert counts.expert_parameters / counts.base_parameters > 0.9
    base = counts.base_bytes + counts.quantization_constant_bytes
    bf16 = counts.base_parameters * 2 // 2
    print(f"Qwen3-30B-A3B QLoRA on 2 GPUs: base {base / 2**30:.2f} GiB per GPU, bf16 {bf16 / 2**30:.2f} GiB")
    assert base <= 0.3 * bf16


def test_ordinary_loading_puts_the_whole_model_on_each_gpu_and_the_verdict_says_when_that_decides(monkeypatch):
    """Ordinary loading reads the whole model onto each GPU before FSDP shards it (then frees each unit's weights as
    it is sharded: tests/model/test_loading.py); low-memory loading gives each GPU its shards only."""
    config = REPO / "configs" / "llama_lora" / "llama3_1_8b.yaml"  # Llama 3.1 8B's shipped config: no network
    fsdp2 = REPO / "configs" / "accelerate" / "fsdp2.yaml"
    with _environment(launcher_environment(fsdp2)):
        plan = plan_config(config, 2, 16 * 2**30)
    # from the definition: the whole bf16 base, the fp32 adapters (r 16 on 7 projections x 32 layers), the largest
    # unit's shard (the 128256 x 4096 bf16 head over 2 ranks) and the CUDA context
    adapters = 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336)) * 4
    assert plan.counts.base_parameters == 8_030_261_248
    want = 8_030_261_248 * 2 + adapters + 128256 * 4096 * 2 // 2 + 2**30
    assert plan.gpu_loading == want and plan.gpu_total < 16 * 2**30 < want
    assert not plan.fits and plan.gpu_peak == want
    assert plan.to_json()["verdict"] == (
        f"does not fit in 16 GiB per GPU while loading (needs {want / 2**30:.2f} GiB, estimate): "
        "turn on fsdp_cpu_ram_efficient_loading: true (each GPU receives its shards only)"
    )
    low_memory = launcher_environment(fsdp2)
    low_memory["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"
    with _environment(low_memory):
        plan = plan_config(config, 2, 16 * 2**30)
    assert plan.gpu_loading == 0 and plan.fits


# Real-model configs, as tests/test_recipes_catalog.py lists them (TPU configs: tests/xla/, planned per chip).
REAL_MODEL_CONFIGS = sorted(
    p
    for p in (REPO / "configs").glob("*/*.yaml")
    if p.parent.name != "accelerate" and "\n# Hardware: any CPU" not in p.read_text() and not p.name.startswith("tpu_")
)
GIB = 2**30


def header_promise(config: Path) -> tuple[int, int, float, str]:
    """A real-model config header's GPUs, GB per GPU, expected GiB per GPU and the plan command behind it."""
    header = config.read_text().split("\n\n")[0]
    hardware = re.search(r"^# Hardware: (\d+) x (\d+) GB GPUs", header, re.MULTILINE)
    expected = re.search(r"^# Expected memory per GPU: about (\d+(?:\.\d+)?) GiB", header, re.MULTILINE)
    command = re.search(r"`(fsdp-peft plan [^`]+)`", header)
    assert hardware and expected and command, (
        f"{config}: the header needs '# Hardware: N x SIZE GB GPUs', '# Expected memory per GPU: about X GiB' and "
        "the `fsdp-peft plan ...` command whose output gives X"
    )
    return int(hardware[1]), int(hardware[2]), float(expected[1]), command[1]


def readme_row(config: Path) -> list[str]:
    """The cells of the README's "Real-model configs" row for ``config``."""
    name = f"{config.parent.name}/{config.name}"
    table = (REPO / "README.md").read_text().split("### Real-model configs", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1, f"README.md, Real-model configs: one row for {name} (found {len(rows)})"
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


@pytest.mark.parametrize("config", REAL_MODEL_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_real_config_states_the_memory_its_named_plan_command_prints(config, capsys, monkeypatch):
    """The header's hardware and expected memory per GPU are what the `fsdp-peft plan` command it names prints
    (within 10%), on that hardware, and the plan fits; the README row says the same."""
    monkeypatch.chdir(REPO)  # the commands name paths from the checkout's root
    gpus, size, expected, command = header_promise(config)
    words = shlex.split(command)
    assert words[2] == str(config.relative_to(REPO)), f"{config}: its plan command plans another config: {command}"
    assert f"--gpus {gpus} --gpu-memory {size}GB" in command, f"{config}: plan it on its hardware: {command}"
    try:
        main([*words[1:], "--json"])  # as a shell runs it: the accelerate config, its flags, then plan_config
    except SystemExit as exit:
        assert exit.code == 0, f"{config}: {command} says it does not fit: {capsys.readouterr().out[-600:]}"
    plan = json.loads(capsys.readouterr().out)
    peak = plan["gpu_peak"] / GIB
    assert plan["fits"], f"{config}: {command}: {plan['verdict']}"
    assert abs(expected - peak) <= 0.1 * peak, f"{config}: the header says {expected} GiB, {command} {peak:.2f} GiB"
    cells = readme_row(config)
    assert cells[3] == f"{gpus} x {size} GB", f"README.md: {config.name}'s hardware is {gpus} x {size} GB"
    stated = re.match(r"~(\d+(?:\.\d+)?) GiB", cells[4])
    assert stated and float(stated[1]) == expected, f"README.md: {config.name}'s figure is ~{expected} GiB"
    if "--low-memory-loading" in command:
        assert "--low-memory-loading" in cells[4], f"README.md: {config.name}'s figure assumes --low-memory-loading"


def test_plan_flags_override_the_accelerate_configs_loading_and_offload_and_say_so(capsys):
    """--low-memory-loading and --offload win over the accelerate config's settings; a note names the source."""
    config = str(REPO / "configs" / "mixtral_qlora" / "mixtral_8x7b.yaml")
    fsdp2 = str(REPO / "configs" / "accelerate" / "fsdp2.yaml")
    with pytest.raises(SystemExit) as exit:
        main(["plan", config, "--accelerate-config", fsdp2, "--gpu-memory", "48GB"])
    assert exit.value.code == 1 and "does not fit in 44.70 GiB per GPU while loading" in capsys.readouterr().out
    main(["plan", config, "--accelerate-config", fsdp2, "--gpu-memory", "48GB", "--low-memory-loading", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["low_memory_loading"] and plan["gpu_loading"] == 0
    assert f"assumed: low-memory loading on (from --low-memory-loading), offload off (from {fsdp2})" in plan["notes"]
    main(["plan", config, "--accelerate-config", fsdp2, "--gpu-memory", "48GB", "--low-memory-loading", "--offload"])
    shown = capsys.readouterr().out
    assert "offload on; low-memory loading on" in shown and "offload on (from --offload)" in shown


def test_auto_leaves_every_layer_to_fsdps_own_checkpointing(tmp_path):
    """With fsdp_activation_checkpointing (accelerate's checkpoint wrapper on every layer) the plan does not choose
    layers of its own under auto, however little memory there is: the run would checkpoint them a second time."""
    from fsdp_peft.procedures.sft import SFT_PROCEDURE
    from fsdp_peft.settings.config import resolve_recipe_config
    from fsdp_peft.tools.plan import plan_recipe

    config = recipe_config(tmp_path, "lora")
    recipe, training, _ = resolve_recipe_config(["--config", str(config)], config, str(tmp_path))
    launcher = {**launcher_environment(CPU_FSDP2), "FSDP_ACTIVATION_CHECKPOINTING": "true"}
    with _environment(launcher):
        # tight: auto alone would choose layers
        plan = plan_recipe(recipe, training, SFT_PROCEDURE, str(config), 2, 2**30)
    assert plan.checkpointing.count == plan.checkpointable_layers == 4 and plan.checkpointing_choices == []
    assert plan.checkpointing_reason == "fsdp_activation_checkpointing: true (FSDP's own, every layer)"


# Each embedded text family as a bf16 run computes (weights and adapters in bf16, as FSDP2's mixed precision gathers
# them), 16-bit and 4-bit, a mixture of experts with its experts adapted or frozen: (model, 4-bit, experts adapted)
SAVED_CASES = [
    ("tiny-llama", False, False),
    ("tiny-llama", True, False),
    ("tiny-qwen3", False, False),
    ("tiny-gemma3-vl", False, False),
    ("tiny-qwen3-moe", True, True),
    ("tiny-qwen3-moe", False, False),
    ("tiny-mixtral", True, True),
    ("tiny-mixtral", False, False),
]


@pytest.mark.parametrize(("name", "four_bit", "experts"), SAVED_CASES, ids=lambda v: str(v))
def test_the_planned_activations_are_what_autograd_saves_in_bf16(name, four_bit, experts, tmp_path):
    """One forward of 256 labelled tokens (the model's own loss): every tensor autograd saves for backward that is not
    a parameter or buffer, each storage once, against the plan's activations row (no checkpointing). Dense: within
    1% (measured within 0.3%); a mixture of experts: at most 6% above (measured 2-4%: the router's few tensors);
    Gemma 3 at most 10% below (measured 9.4%: its attention's seq x seq mask and two more head-shaped copies of q,
    not counted)."""
    from transformers import TrainingArguments

    from fsdp_peft.model.modeling import build_model, load_tokenizer
    from fsdp_peft.procedures.sft import SFT_PROCEDURE
    from fsdp_peft.settings.config import RecipeArguments
    from fsdp_peft.tools.plan import plan_recipe

    tokens = 256
    values = {"model_name_or_path": name, "torch_dtype": "bfloat16", "load_in_4bit": four_bit, "lora_dropout": 0.0}
    values |= {"loss_chunk_tokens": 0, "max_seq_length": tokens}
    recipe = RecipeArguments(**values, **({} if experts else {"lora_target_parameters": []}))
    training = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    model = build_model(recipe, training, load_tokenizer(recipe))
    model.train()
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.to(torch.bfloat16)
    kept = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in kept:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(3, 200, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids, use_cache=False)
    step = {"per_device_train_batch_size": 1, "bf16": True, "activation_checkpointing": False}
    planned = plan_recipe(recipe, step, SFT_PROCEDURE, name, 1, 2**40).gpu["activations (est.)"]
    error = planned / sum(saved.values()) - 1
    print(f"{name} 4-bit {four_bit} experts adapted {experts}: planned / saved - 1 = {error:+.4f}")
    if "moe" in name or "mixtral" in name:
        assert 0 <= error <= 0.06, error
    elif "gemma3" in name:
        assert -0.10 <= error < 0, error
    else:
        assert abs(error) <= 0.01, error
