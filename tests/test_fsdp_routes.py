"""FSDP from the accelerate config and from ``fsdp``/``fsdp_config`` in the recipe YAML train identically,
and both match one unsharded process with the same global batch (fp32 LoRA)."""

from __future__ import annotations

import sys

import pytest
from safetensors.torch import load_file

from conftest import REPO, launch_recipe, read_json, run_command, _free_port

STEPS = 8
COMMON = ["--max_steps", str(STEPS), "--logging_steps", "1", "--generate_samples", "0", "--warmup_steps", "0"]
FSDP_YAML_ROUTE = [
    "--fsdp", "full_shard auto_wrap",
    "--fsdp_config", '{"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}',
]  # fmt: skip

pytestmark = pytest.mark.slow


def _losses(output_dir) -> list[float]:
    history = read_json(output_dir / "trainer_state.json")["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def test_yaml_fsdp_route_accelerate_route_and_one_process_agree(tmp_path, tiny_model_dir):
    accelerate_dir, yaml_dir, single_dir = tmp_path / "accelerate", tmp_path / "yaml", tmp_path / "single"
    launch_recipe("llama_lora", "--output_dir", str(accelerate_dir), *COMMON)

    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
        str(REPO / "recipes" / "llama_lora.py"), "--output_dir", str(yaml_dir), *COMMON, *FSDP_YAML_ROUTE,
    ]  # fmt: skip
    yaml_run = run_command(command)
    assert yaml_run.returncode == 0, yaml_run.stderr[-4000:]
    assert read_json(yaml_dir / "fsdp_layout.json")["units"] == read_json(accelerate_dir / "fsdp_layout.json")["units"]

    batch = str(2 * 16)  # the same global batch as 2 ranks x 16
    single = run_command(
        [sys.executable, str(REPO / "recipes" / "llama_lora.py"), "--output_dir", str(single_dir), *COMMON,
         "--per_device_train_batch_size", batch]  # fmt: skip
    )
    assert single.returncode == 0, single.stderr[-4000:]
    assert read_json(single_dir / "results.json")["fsdp"] is False

    reference = _losses(single_dir)
    reference_adapter = load_file(single_dir / "adapter" / "adapter_model.safetensors")
    assert len(reference) == STEPS
    for route in (accelerate_dir, yaml_dir):
        assert read_json(route / "results.json")["fsdp"] is True
        losses = _losses(route)
        assert len(losses) == STEPS
        worst = max(abs(got - want) / abs(want) for got, want in zip(losses, reference))
        print(f"{route.name}: largest relative loss difference to one process over {STEPS} steps: {worst:.2e}")
        assert worst <= 1e-5, (route.name, losses, reference)
        adapter = load_file(route / "adapter" / "adapter_model.safetensors")
        assert adapter.keys() == reference_adapter.keys()
        for key, want in reference_adapter.items():
            assert adapter[key].shape == want.shape, key  # gathered from both shards, not rank 0's half
            assert (adapter[key] - want).abs().max() <= 1e-5 * want.abs().max(), key
