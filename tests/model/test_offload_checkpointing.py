"""FSDP2 CPU offload and FSDP's own activation checkpointing in the CPU mode, from the accelerate config.

One 2-rank run with ``--fsdp_offload_params true --fsdp_activation_checkpointing true`` (the keys of
``configs/accelerate/fsdp2_offload.yaml`` and ``fsdp_activation_checkpointing``) against the plain fp32
LoRA run of `test_loading`: each feature is shown to be in force, and training is unchanged by them.
"""

from __future__ import annotations

import pytest
import torch
from test_loading import STEPS, launch_loading_check, loading_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def offload_and_checkpointing(tmp_path_factory, tiny_model_dir) -> dict:
    out = tmp_path_factory.mktemp("offload_checkpointing")
    flags = ["--fsdp_offload_params", "true", "--fsdp_activation_checkpointing", "true"]
    return {"report": launch_loading_check(out, *flags), "dir": out}


def test_cpu_offload_puts_every_sharded_parameter_under_fsdp_offloading(offload_and_checkpointing, tmp_path_factory):
    report = offload_and_checkpointing["report"]
    plain = loading_run("lora", False, tmp_path_factory)["report"]
    parameters = torch.load(offload_and_checkpointing["dir"] / "shards-rank0.pt")["parameters"]
    # without pinned memory: pinning needs an accelerator (`fsdp_peft.parallel.cpu_fsdp.unpinned_cpu_offload`)
    assert report["offload"] == "CPUOffloadPolicy" and plain["offload"] == "OffloadPolicy"
    assert report["offloaded_parameters"] == len(parameters) == 95 and plain["offloaded_parameters"] == 0
    assert report["parameter_devices"] == ["cpu"]


def test_activation_checkpointing_wraps_every_decoder_layer_and_recomputes_its_forward(
    offload_and_checkpointing, tmp_path_factory
):
    report = offload_and_checkpointing["report"]
    plain = loading_run("lora", False, tmp_path_factory)["report"]
    assert report["activation_checkpointing"] is True and report["checkpoint_wrappers"] == 4
    assert plain["checkpoint_wrappers"] == 0
    # layer 0's attention runs once per step, and once more in backward when checkpointed
    assert plain["layer_0_attention_forwards"] == STEPS
    assert report["layer_0_attention_forwards"] == 2 * STEPS


def test_offload_and_checkpointing_train_like_the_plain_run(offload_and_checkpointing, tmp_path_factory):
    losses = offload_and_checkpointing["report"]["losses"]
    reference = loading_run("lora", False, tmp_path_factory)["report"]["losses"]
    assert len(losses) == len(reference) == STEPS
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) <= 1e-6, (losses, reference)
