"""Every Trainer-native FSDP form trains like the accelerate-config route: same units, same losses.

Each form is a recipe YAML setting ``fsdp``/``fsdp_config`` (as the transformers FSDP guide, older guides and
other tools write them), launched with torchrun, or with ``accelerate launch`` and an accelerate config that
holds no FSDP. Its reference is the same recipe launched with an accelerate config holding the same FSDP
settings. 3 steps on 2 gloo ranks each; units from ``fsdp_layout.json``, losses from ``trainer_state.json``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import (
    REPO,
    launch_recipe,
    logged_losses,
    read_json,
    recipe_torchrun_command,
    run_command,
    run_launch,
    tiny_llama_in_4bit,
)

pytestmark = pytest.mark.slow

STEPS = 3
COMMON = [
    "--max_steps",
    str(STEPS),
    "--logging_steps",
    "1",
    "--warmup_steps",
    "0",
    "--per_device_train_batch_size",
    "4",
    "--generate_samples",
    "0",
    "--generate_eval_samples",
    "0",
    "--eval_strategy",
    "no",
    "--save_strategy",
    "no",
]
ACCELERATE = REPO / "configs" / "accelerate"

# The FSDP config file of the transformers FSDP2 guide, as printed there.
GUIDE_JSON = """{
  "version": 2,
  "reshard_after_forward": true,
  "cpu_offload": false,
  "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
  "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
  "state_dict_type": "FULL_STATE_DICT",
  "cpu_ram_efficient_loading": true,
  "activation_checkpointing": true
}
"""
# The same settings as an accelerate config (the guide's other route).
GUIDE_ACCELERATE = (
    (ACCELERATE / "cpu_fsdp2.yaml")
    .read_text()
    .replace(
        "  fsdp_state_dict_type: SHARDED_STATE_DICT        # checkpoints stay sharded\n"
        "  fsdp_cpu_ram_efficient_loading: false\n",
        "  fsdp_state_dict_type: FULL_STATE_DICT\n"
        "  fsdp_cpu_ram_efficient_loading: true\n"
        "  fsdp_activation_checkpointing: true\n"
        "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n",
    )
)
# CPU offload, as an accelerate config.
OFFLOAD_ACCELERATE = (
    (ACCELERATE / "cpu_fsdp2.yaml").read_text().replace("  fsdp_offload_params: false", "  fsdp_offload_params: true")
)
NO_FSDP = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 1
num_processes: 2
machine_rank: 0
mixed_precision: 'no'
rdzv_backend: static
same_network: true
"""

# name: (recipe, reference accelerate config, launcher ("torchrun" or an accelerate config text), recipe YAML lines)
ROUTES = {
    "guide-json-file": ("llama_lora", "guide", "torchrun", "fsdp: true\nfsdp_config: {json}\n"),
    "bool-and-mapping": ("llama_lora", "fsdp2", "torchrun", "fsdp: true\nfsdp_config:\n  version: 2\n"),
    "string-prefixed-keys-qlora": (
        "llama_qlora",
        "fsdp2",
        "torchrun",
        "fsdp: full_shard auto_wrap\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n",
    ),
    "shard-grad-op-list": ("llama_lora", "fsdp2", "torchrun", "fsdp: [shard_grad_op, auto_wrap]\n"),
    "fsdp1-list-accelerate-spellings": (
        "llama_lora",
        "fsdp1",
        "torchrun",
        "fsdp: [full_shard, auto_wrap]\nfsdp_config:\n  fsdp_version: 1\n  fsdp_sharding_strategy: FULL_SHARD\n"
        "  fsdp_offload_params: false\n  fsdp_use_orig_params: false\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n",
    ),
    "fsdp1-string-qlora": (
        "llama_qlora",
        "fsdp1",
        "torchrun",
        'fsdp: full_shard auto_wrap\nfsdp_config: \'{{"version": 1, "use_orig_params": false}}\'\n',
    ),
    "accelerate-without-fsdp": ("llama_lora", "fsdp2", NO_FSDP, "fsdp: true\n"),
    "accelerate-and-recipe-agree": ("llama_lora", "fsdp2", "fsdp2", "fsdp: true\nfsdp_config:\n  version: 2\n"),
    "offload-string": (
        "llama_lora",
        "offload",
        "torchrun",
        "fsdp: full_shard offload auto_wrap\nfsdp_config:\n  transformer_layer_cls_to_wrap: LlamaDecoderLayer\n",
    ),
}

_references: dict = {}


def _accelerate_config(name: str, tmp_path_factory) -> Path:
    if name in ("guide", "offload"):
        path = tmp_path_factory.mktemp(name) / f"{name}_fsdp2.yaml"
        path.write_text(GUIDE_ACCELERATE if name == "guide" else OFFLOAD_ACCELERATE)
        return path
    return ACCELERATE / f"cpu_{name}.yaml"


def reference_run(recipe: str, config: str, tmp_path_factory) -> Path:
    """The recipe under an accelerate config with the same FSDP settings (cached per recipe and config)."""
    if (recipe, config) not in _references:
        out = tmp_path_factory.mktemp(f"reference_{recipe}_{config}")
        launch_recipe(
            recipe, *COMMON, "--output_dir", str(out), accelerate_config=_accelerate_config(config, tmp_path_factory)
        )
        _references[recipe, config] = out
    return _references[recipe, config]


@pytest.fixture(scope="module", params=sorted(ROUTES))
def route(request, tmp_path_factory, tiny_model_dir):
    recipe, reference, launcher, yaml_lines = ROUTES[request.param]
    work = tmp_path_factory.mktemp(request.param)
    (work / "fsdp.json").write_text(GUIDE_JSON)
    config = work / "recipe.yaml"
    tiny = REPO / "configs" / recipe / "tiny.yaml"
    config.write_text(f"include: {tiny}\n" + yaml_lines.format(json=work / "fsdp.json"))
    out = work / "out"
    argv = ["--config", str(config), *COMMON, "--output_dir", str(out)]
    if launcher == "torchrun":
        command = recipe_torchrun_command(recipe, *argv)
        result = run_launch(command)
        assert result.returncode == 0, result.stderr[-6000:]
    else:
        accelerate = work / "accelerate.yaml"
        accelerate.write_text(
            launcher if "distributed_type" in launcher else (ACCELERATE / f"cpu_{launcher}.yaml").read_text()
        )
        result = launch_recipe(recipe, *argv, accelerate_config=accelerate)
    return {
        "name": request.param,
        "out": out,
        "reference": reference_run(recipe, reference, tmp_path_factory),
        "stdout": result.stdout,
    }


def test_the_route_shards_the_same_units_as_the_accelerate_config(route):
    units = read_json(route["out"] / "fsdp_layout.json")["units"]
    assert units == read_json(route["reference"] / "fsdp_layout.json")["units"]
    assert len(units) >= 5  # root and 4 decoder layers at least


def test_the_route_trains_with_the_losses_of_the_accelerate_config(route):
    losses, reference = logged_losses(route["out"]), logged_losses(route["reference"])
    assert sorted(losses) == sorted(reference) == list(range(1, STEPS + 1))
    worst = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in reference)
    print(f"{route['name']}: largest relative loss difference {worst:.1e}")
    assert worst <= 1e-6, (losses, reference)
    assert read_json(route["out"] / "results.json")["fsdp"] is True


def test_the_route_records_its_fsdp_version_like_the_accelerate_config(route):
    ours = read_json(route["out"] / "fsdp_layout.json")
    theirs = read_json(route["reference"] / "fsdp_layout.json")
    assert [p["placements"] for p in ours["parameters"]] == [p["placements"] for p in theirs["parameters"]]
    assert [p["dtype"] for p in ours["parameters"]] == [p["dtype"] for p in theirs["parameters"]]


def test_a_recipe_and_an_accelerate_config_that_disagree_are_refused_in_one_line(tmp_path):
    config = tmp_path / "v2.yaml"
    config.write_text(
        f"include: {REPO / 'configs' / 'llama_lora' / 'tiny.yaml'}\nfsdp: true\nfsdp_config:\n  version: 2\n"
    )
    result = run_command(
        ["fsdp-peft", "validate", str(config), "--accelerate-config", str(ACCELERATE / "cpu_fsdp1.yaml")], timeout=300
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: fsdp_config: version is 2 in the recipe but 1 in the accelerate config (FSDP_VERSION); make them "
        "agree, or set FSDP in one place only"
    ]
    assert "Traceback" not in result.stderr


def test_fsdp2_full_state_dict_checkpoints_hold_whole_adapter_tensors_and_resume_exactly(tmp_path, tiny_model_dir):
    """accelerate 1.15 saves FSDP2 FULL_STATE_DICT adapters whole (the rank-0-shard bug of accelerate #4206 is
    fixed in the pinned version), so fsdp-peft accepts them: a resume repeats the uninterrupted run."""
    from safetensors.torch import load_file

    quick = [  # the common options, then these (the command line's last value of a key wins)
        *COMMON,
        *("--max_steps", "4", "--lr_scheduler_type", "constant", "--save_strategy", "steps", "--save_steps", "2"),
        *("--fsdp", "true", "--fsdp_config", '{"state_dict_type": "FULL_STATE_DICT"}'),
    ]
    full, resumed = tmp_path / "full", tmp_path / "resumed"

    def torchrun_recipe(*argv: str):
        command = recipe_torchrun_command("llama_lora", *quick, *argv)
        result = run_launch(command)
        assert result.returncode == 0, result.stderr[-4000:]
        return result

    torchrun_recipe("--output_dir", str(full))
    final = load_file(full / "adapter" / "adapter_model.safetensors")
    checkpoint = load_file(full / "checkpoint-2" / "adapter_model.safetensors")
    assert checkpoint.keys() == final.keys()
    assert all(checkpoint[key].shape == final[key].shape for key in final)  # whole tensors, not one rank's half

    shutil.copytree(full, resumed, ignore=shutil.ignore_patterns("checkpoint-4", "adapter"))
    torchrun_recipe("--output_dir", str(resumed), "--resume_from_checkpoint", "auto")
    want, got = logged_losses(full), logged_losses(resumed)
    assert [got[s] for s in (3, 4)] == pytest.approx([want[s] for s in (3, 4)], rel=1e-6)
    adapter = load_file(resumed / "adapter" / "adapter_model.safetensors")
    assert max((adapter[k] - final[k]).abs().max().item() for k in final) <= 1e-6


def test_a_prequantized_4bit_base_trains_like_quantizing_on_load(tmp_path_factory, tiny_model_dir):
    """A bitsandbytes 4-bit checkpoint (bf16 storage) as the base: the same losses as the 16-bit base quantized
    on load under the same accelerate config."""
    work = tmp_path_factory.mktemp("prequantized")
    tiny_llama_in_4bit(tiny_model_dir).save_pretrained(work / "base")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, work / "base")
    out = work / "out"
    launch_recipe("llama_qlora", *COMMON, "--model_name_or_path", str(work / "base"), "--output_dir", str(out))
    reference = reference_run("llama_qlora", "fsdp2", tmp_path_factory)
    losses, want = logged_losses(out), logged_losses(reference)
    assert [losses[s] for s in sorted(want)] == pytest.approx([want[s] for s in sorted(want)], rel=1e-6)
    assert read_json(out / "fsdp_layout.json")["units"] == read_json(reference / "fsdp_layout.json")["units"]
