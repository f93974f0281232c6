"""The shipped recipes and configs: every config validates, includes resolve, --print-config round-trips,
the end-of-run report, and every real-model config trains 2 steps with its family's tiny model."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

from conftest import launch_recipe, procedure_of, read_json, run_launch
from fsdp_peft import cli
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.procedures.ending import plot_loss_curve, summary
from fsdp_peft.procedures.procedure import exact_match_lines
from fsdp_peft.procedures.registry import recipe_procedure, recognised
from fsdp_peft.procedures.sft import SFT_PROCEDURE
from fsdp_peft.procedures.vision_sft import VISION_SFT_PROCEDURE
from fsdp_peft.recipe import parse_recipe_config
from fsdp_peft.settings.catalog import CONFIGS, RECIPES
from fsdp_peft.settings.config import read_yaml_config
from fsdp_peft.settings.families import family_for, tiny_family

# TPU configs (configs/<recipe>/tpu_*.yaml) run in the TPU environment: tests/xla/ checks them there.
RECIPE_CONFIGS = sorted(
    p for p in CONFIGS.glob("*/*.yaml") if p.parent.name != "accelerate" and not p.name.startswith("tpu_")
)
# GPU configs of real models; the CPU configs (tiny.yaml, and SmolLM2's, a real model run on 2 CPU processes:
# tests/test_docs.py runs them as docs/real_model.md shows them) make no GPU promise
REAL_CONFIGS = [p for p in RECIPE_CONFIGS if "\n# Hardware: any CPU" not in p.read_text()]
# DPO: tests/procedures/test_preference.py; GRPO: tests/procedures/test_grpo.py; vision-language SFT: its own test below
VISION_REAL_CONFIGS = [p for p in REAL_CONFIGS if "_vl_" in p.parent.name]
SFT_REAL_CONFIGS = [
    p for p in REAL_CONFIGS if not p.parent.name.endswith(("_dpo", "_grpo")) and "_vl_" not in p.parent.name
]
GPU_ACCELERATE_CONFIGS = ["fsdp2.yaml", "fsdp2_offload.yaml", "fsdp1.yaml"]
MOE_RECIPES = ("qwen_moe_", "mixtral_")
ROW_TOKENS = 24  # every tiny-reverse row: bos, <|user|>, "reverse: abcde", eos, <|assistant|>, 5 letters, eos
REQUIRED_REAL = {
    "llama_qlora/llama3_1_8b.yaml": "2 x 24 GB",
    "llama_qlora/llama3_3_70b.yaml": "2 x 80 GB",
    "llama_lora/llama3_1_8b.yaml": "2 x 80 GB",
    "qwen_qlora/qwen2_5_7b.yaml": "2 x 24 GB",
    "mistral_qlora/mistral_7b.yaml": "2 x 24 GB",
    "qwen_vl_qlora/qwen2_5_vl_7b.yaml": "2 x 24 GB",
    "gemma3_vl_qlora/gemma3_12b.yaml": "2 x 24 GB",
}


def _name(path: Path) -> str:
    return path.relative_to(CONFIGS).as_posix()


def _family_prefix(recipe: str) -> str:
    return recipe.split("_")[0]  # llama_qlora -> llama; qwen covers qwen2 and qwen3


def test_every_recipe_defaults_to_a_tiny_config_of_its_family_and_flavour(tmp_path):
    recipes = sorted(p.stem for p in RECIPES.glob("*.py"))
    families = ("llama", "mistral", "qwen", "qwen_moe", "mixtral", "qwen_vl", "gemma3_vl")
    sft = [f"{f}_{k}" for f in families for k in ("lora", "qlora")]
    assert recipes == sorted([*sft, "llama_dpo", "qwen_dpo", "llama_grpo", "qwen_grpo"])
    for recipe in recipes:
        assert f'CONFIGS / "{recipe}" / "tiny.yaml"' in (RECIPES / f"{recipe}.py").read_text()
        config = CONFIGS / recipe / "tiny.yaml"
        argv, procedure = ["--config", str(config), "--output_dir", str(tmp_path)], recipe_procedure(recipe)
        assert procedure is procedure_of(config)  # validate and plan take a config under configs/<recipe>/ as its
        if procedure is not SFT_PROCEDURE:  # the recipe launches the procedure it names
            assert "run_recipe(" in (text := (RECIPES / f"{recipe}.py").read_text()) and "procedure=PROCEDURE)" in text
        # a vision-language model's SFT: its rows have images (docs/vision.md); a loose copy of any other recipe's
        # tiny config is taken as its recipe's by its keys
        expected = VISION_SFT_PROCEDURE if "_vl_" in recipe else recognised(read_yaml_config(config))
        assert procedure is expected, recipe
        args, _ = parse_recipe_config(argv, config, "unused", procedure=procedure)
        assert tiny_family(args.model_name_or_path).name.startswith(_family_prefix(recipe)), recipe
        assert args.load_in_4bit is recipe.endswith("qlora"), recipe


@pytest.fixture
def offline_hub(monkeypatch):
    """No network, as on a login node (and here): the hub's data refused at once rather than after retries."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1, read at import
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def _eval_tasks(config: Path) -> list[str]:
    return read_yaml_config(config).get("eval_tasks") or []


@pytest.mark.parametrize("config", RECIPE_CONFIGS, ids=_name)
def test_shipped_config_validates_and_opens_with_its_header(config, capsys, offline_hub):
    cli.main(["validate", str(config)])
    printed = capsys.readouterr()
    assert printed.out.strip() == f"{config}: ok"
    for task in _eval_tasks(config):  # hub data out of reach here: noted, not refused (a launch refuses it)
        assert f"eval_tasks: {task}: " in printed.err and "is out of reach from here" in printed.err
    header = config.read_text().split("\n\n")[0]
    assert all(line.startswith("#") for line in header.splitlines() if not line.startswith("include:"))
    assert "# Hardware: " in header and f"recipes/{config.parent.name}.py" in header
    if config in REAL_CONFIGS:  # a GPU config: what the plan expects of the GPUs it names
        assert "Expected memory per GPU: about " in header and "An estimate, not a measurement" in header


def test_real_configs_name_standard_harness_tasks_and_say_what_to_expect():
    """Some real configs evaluate with lm-evaluation-harness at the end: its own task names (gsm8k, mmlu), and
    a header that says what the run should show and how to measure the base for the comparison."""
    from lm_eval.tasks import TaskManager

    named = {_name(config): _eval_tasks(config) for config in REAL_CONFIGS if _eval_tasks(config)}
    assert named == {"llama_qlora/llama3_3_70b.yaml": ["mmlu"], "qwen_grpo/qwen2_5_7b_gsm8k_qlora.yaml": ["gsm8k"]}
    harness = TaskManager(include_defaults=True).all_tasks
    for name, tasks in named.items():
        header = (CONFIGS / name).read_text().split("\n\n")[0]
        assert "# Evaluation (eval_tasks): " in header, name
        output_dir = read_yaml_config(CONFIGS / name)["output_dir"]
        assert f"`fsdp-peft eval {output_dir}/adapter --tasks {tasks[0]} --base-only`" in header, name
        assert set(tasks) <= set(harness), name


def test_the_required_real_configs_ship_for_their_hardware():
    for name, hardware in REQUIRED_REAL.items():
        assert f"# Hardware: {hardware} GPUs" in (CONFIGS / name).read_text(), name


@pytest.mark.parametrize("accelerate_config", GPU_ACCELERATE_CONFIGS)
def test_real_configs_pass_the_fsdp_rules_of_the_gpu_accelerate_configs(accelerate_config, capsys, offline_hub):
    """Every real config validates under each GPU accelerate config (DPO and GRPO included, FSDP1 too)."""
    accelerate = CONFIGS / "accelerate" / accelerate_config
    for config in REAL_CONFIGS:
        command = ["validate", str(config), "--accelerate-config", str(accelerate)]
        if config.parent.name.startswith(MOE_RECIPES) and accelerate_config == "fsdp1.yaml":
            with pytest.raises(SystemExit):  # LoRA on expert parameters needs FSDP2 (docs/moe.md)
                cli.main(command)
            assert "FSDP1 cannot run LoRA on expert parameters" in capsys.readouterr().err
            continue
        if "_vl_" in config.parent.name and accelerate_config == "fsdp1.yaml":
            with pytest.raises(SystemExit):  # the vision tower runs before the embeddings' unit (docs/vision.md)
                cli.main(command)
            assert "is a vision-language model; under FSDP1" in capsys.readouterr().err
            continue
        if read_yaml_config(config).get("sequence_parallel_size", 1) > 1 and accelerate_config == "fsdp1.yaml":
            with pytest.raises(SystemExit):  # the split shards over its mesh with FSDP2 (docs/long-context.md)
                cli.main(command)
            assert "FSDP1 cannot shard over the sequence mesh" in capsys.readouterr().err
            continue
        cli.main(command)
        assert capsys.readouterr().out.strip().endswith(f"ok under {accelerate}")


def test_include_reads_the_base_first_and_the_including_file_wins(tmp_path):
    (tmp_path / "base.yaml").write_text("lora_r: 4\nlora_alpha: 8\nlearning_rate: 1.0e-3\n")
    (tmp_path / "mid.yaml").write_text("include: base.yaml\nlora_alpha: 16\n")
    (tmp_path / "top.yaml").write_text("include: mid.yaml\nlearning_rate: 5.0e-4\n")
    assert read_yaml_config(tmp_path / "top.yaml") == {"lora_r": 4, "lora_alpha": 16, "learning_rate": 5.0e-4}


def test_include_falls_back_to_shipped_config_names_so_copies_keep_working(tmp_path):
    copy = tmp_path / "mine.yaml"
    copy.write_text((CONFIGS / "qwen_qlora" / "tiny.yaml").read_text() + "lora_r: 8\n")
    values = read_yaml_config(copy)
    base = read_yaml_config(CONFIGS / "llama_qlora" / "tiny.yaml")
    assert values == {**base, "model_name_or_path": "tiny-qwen2", "output_dir": "outputs/qwen_qlora_tiny", "lora_r": 8}


@pytest.mark.parametrize(
    "files, message",
    [
        ({"a.yaml": "include: nowhere.yaml\n"}, "a.yaml: include: file not found: "),
        ({"a.yaml": "include: b.yaml\n", "b.yaml": "include: a.yaml\n"}, "b.yaml: include: "),
        ({"a.yaml": "include: [b.yaml]\n"}, "a.yaml: include: expected the path of one YAML file"),
        ({"a.yaml": "lr: 1\nlora_rank: 2\n"}, "unknown key 'lora_rank'"),
    ],
)
def test_include_and_key_errors_name_the_file_and_the_fix(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as error:
        read_yaml_config(tmp_path / "a.yaml")
    assert message in str(error.value)
    if "lora_rank" in message:  # every unknown key at once
        assert "unknown key 'lr'" in str(error.value)
    if "b.yaml: include: " in message:
        assert "includes itself" in str(error.value)


def test_print_config_output_is_a_config_that_resolves_to_the_same_arguments(tmp_path, capsys):
    config = CONFIGS / "mistral_qlora" / "tiny.yaml"
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe_config(["--config", str(config), "--print-config", "--lora_r", "8"], config, str(tmp_path))
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "model_name_or_path: tiny-mistral\n" in printed and "lora_r: 8\n" in printed
    assert "max_steps: 400\n" in printed and "load_in_4bit: true\n" in printed  # from the included file
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(printed)
    again_recipe, again_training = parse_recipe_config(["--config", str(resolved)], resolved, "unused")
    recipe, training = parse_recipe_config(["--config", str(config), "--lora_r", "8"], config, str(tmp_path))
    assert dataclasses.asdict(again_recipe) == dataclasses.asdict(recipe)
    assert again_training.to_dict() == training.to_dict()


def test_recipe_print_config_exits_before_loading_anything():
    result = run_launch([sys.executable, "recipes/qwen_qlora.py", "--print-config", "--max_steps", "3"], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "max_steps: 3\n" in result.stdout and "model_name_or_path: tiny-qwen2\n" in result.stdout
    assert "Loading weights" not in result.stdout + result.stderr


LOG = [{"loss": 3.0, "step": 1}, {"loss": 2.0, "step": 2}, {"eval_loss": 2.5, "step": 2}]


def test_loss_curve_is_skipped_with_one_line_when_no_loss_was_logged(tmp_path):
    assert plot_loss_curve([{"step": 1, "learning_rate": 1e-3}], tmp_path / "curve.png") is None
    assert not (tmp_path / "curve.png").exists()
    results = {
        "recipe": "r",
        "steps": 2,
        "tokens": 1536,
        "train_seconds": 1.0,
        "total_seconds": 2.0,
        "train_loss": 2.5,
        "last_train_loss": 2.0,
        "eval_loss": 2.5,
        "exact_match_after": None,
        "adapter_dir": "a",
        "merged_dir": None,
        "loss_curve": None,
    }
    lines = summary(results, tmp_path, exact_match_lines).splitlines()
    assert lines[0] == "[fsdp-peft] r: 2 steps, 1,536 tokens, 1.0 s training (2.0 s in all)"
    assert lines[1] == "[fsdp-peft] train loss 2.5000 (mean over the run), last logged 2.0000"
    assert [line for line in lines if "loss curve" in line] == [
        "[fsdp-peft] loss curve: not drawn (no loss was logged: lower logging_steps)"
    ]
    assert lines[-1] == f"[fsdp-peft] results: {tmp_path / 'results.json'}"


def test_loss_curve_is_a_png(tmp_path):
    path = plot_loss_curve(LOG, tmp_path / "curve.png")
    assert path == str(tmp_path / "curve.png") and Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# The real configs name hub datasets; no network here, so the tests swap in the embedded data.
LOCAL_DATA = ["--dataset", "tiny-reverse", "--data_format", "auto", "--eval_split", "0"]


def test_real_configs_name_a_public_dataset_in_the_format_they_set():
    for config in SFT_REAL_CONFIGS:
        values = read_yaml_config(config)
        assert "/" in values["dataset"] and values["dataset"] != "tiny-reverse", config
        assert values["data_format"] in ("messages", "sharegpt", "instruction"), config


def _tiny_for(config: Path) -> str:
    model_types = {"meta-llama": "llama", "mistralai": "mistral", "Qwen/Qwen2.5": "qwen2", "Qwen/Qwen3": "qwen3",
                   "Qwen/Qwen2.5-VL": "qwen2_5_vl", "google/gemma-3": "gemma3"}  # fmt: skip
    name = read_yaml_config(config)["model_name_or_path"]
    model_type = model_types[max((p for p in model_types if name.startswith(p)), key=len)]
    return family_for(model_type).tiny_model


@pytest.mark.slow
@pytest.mark.parametrize("config", SFT_REAL_CONFIGS, ids=_name)
def test_real_config_trains_two_steps_with_its_familys_tiny_model(config, tmp_path):
    recipe, values = config.parent.name, read_yaml_config(config)
    tiny_name = _tiny_for(config)
    family = tiny_family(tiny_name)
    result = launch_recipe(
        recipe,
        "--config",
        str(config),
        "--model_name_or_path",
        tiny_name,
        "--output_dir",
        str(tmp_path),
        "--max_steps",
        "2",
        "--logging_steps",
        "1",
        "--max_seq_length",
        "64",
        "--generate_samples",
        "0",
        "--generate_eval_samples",
        "0",
        *LOCAL_DATA,
        *(["--eval_tasks", "tiny_reverse_em"] if _eval_tasks(config) else []),  # the shipped task for the hub's
    )
    results = read_json(tmp_path / "results.json")
    if _eval_tasks(config):  # the harness ran at the end, on the sharded model
        assert results["eval_tasks"]["tiny_reverse_em"]["samples"] == 200
    data_parallel = 2 // values.get("sequence_parallel_size", 1)  # a sequence group's ranks hold the same rows
    global_batch = data_parallel * values["per_device_train_batch_size"] * values["gradient_accumulation_steps"]
    assert (results["steps"], results["tokens"], results["fsdp"]) == (2, 2 * global_batch * ROW_TOKENS, True)
    assert f"[fsdp-peft] {recipe}: 2 steps, {2 * global_batch * ROW_TOKENS:,} tokens" in result.stdout
    losses = [e["loss"] for e in read_json(tmp_path / "trainer_state.json")["log_history"] if "loss" in e]
    assert len(losses) == 2 and all(math.isfinite(x) and 5.0 < x < 6.0 for x in losses)  # ln(263) = 5.57 at init
    layout = read_json(tmp_path / "fsdp_layout.json")
    assert [u for u in layout["units"] if ".layers." in u] == [f"base_model.model.model.layers.{i}" for i in range(4)]
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == sorted(family.lora_target_modules)
    assert adapter["r"] == values["lora_r"] and adapter["base_model_name_or_path"].endswith(f"{tiny_name}-seed1234")
    q_proj = next(p for p in layout["parameters"] if p["name"].endswith("layers.0.self_attn.q_proj.base_layer.weight"))
    packed = [128 * 128 // 4, 1]  # 4-bit values, 4 to a bf16 storage element, in one column
    assert q_proj["shape"] == (packed if values.get("load_in_4bit") else [128, 128])


def test_vision_real_configs_name_a_public_image_dataset_in_the_chat_format():
    assert [_name(config) for config in VISION_REAL_CONFIGS] == [
        "gemma3_vl_qlora/gemma3_12b.yaml",
        "qwen_vl_qlora/qwen2_5_vl_7b.yaml",
    ]
    for config in VISION_REAL_CONFIGS:
        values = read_yaml_config(config)
        assert values["dataset"] == "HuggingFaceH4/llava-instruct-mix-vsft", config  # messages + images, as TRL's
        assert values["load_in_4bit"] and values["activation_checkpointing"], config


@pytest.mark.slow
@pytest.mark.parametrize("config", VISION_REAL_CONFIGS, ids=_name)
def test_vision_real_config_trains_two_steps_with_its_familys_tiny_model(config, tmp_path):
    """The real config's keys (activation checkpointing, accumulation, eval, skipping bad rows) on the tiny model of
    its family and the embedded image task."""
    recipe, values = config.parent.name, read_yaml_config(config)
    tiny_name = _tiny_for(config)
    launch_recipe(recipe, "--config", str(config), "--model_name_or_path", tiny_name, "--output_dir", str(tmp_path),
                  "--max_steps", "2", "--logging_steps", "1", "--max_seq_length", "64", "--eval_steps", "2",
                  "--generate_samples", "0", "--dataset", "tiny-colors")  # fmt: skip
    results = read_json(tmp_path / "results.json")
    assert (results["steps"], results["fsdp"]) == (2, True)
    state = read_json(tmp_path / "trainer_state.json")["log_history"]
    losses = [e["loss"] for e in state if "loss" in e]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert [e["step"] for e in state if "eval_loss" in e] == [2]
    layout = read_json(tmp_path / "fsdp_layout.json")
    layers = [u for u in layout["units"] if ".language_model.layers." in u]
    assert layers == [f"base_model.model.model.language_model.layers.{i}" for i in range(len(layers))] and layers
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == values["lora_r"] and "language_model" in adapter["target_modules"]
