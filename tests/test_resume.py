"""Resuming from a sharded FSDP2 checkpoint continues the run exactly (fp32 LoRA, 2 gloo ranks).

The interrupted run stops after step 6 (``max_steps 6``) with a checkpoint at step 5; a constant
learning rate keeps its first leg identical to the uninterrupted run's first 6 steps.
"""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file

from conftest import launch_recipe, read_json

COMMON = [
    "--logging_steps", "1", "--generate_samples", "0", "--warmup_steps", "0", "--lr_scheduler_type", "constant",
    "--save_strategy", "steps", "--save_steps", "5", "--per_device_train_batch_size", "16",
]  # fmt: skip

pytestmark = pytest.mark.slow


def _losses(output_dir) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_json(output_dir / "trainer_state.json")["log_history"] if "loss" in e}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    full, interrupted = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("interrupted")
    launch_recipe("llama_lora", "--output_dir", str(full), "--max_steps", "10", *COMMON)
    launch_recipe("llama_lora", "--output_dir", str(interrupted), "--max_steps", "6", *COMMON)
    shutil.rmtree(interrupted / "checkpoint-6")  # the run "died" after step 6; step 5 is the last checkpoint
    other_world = tmp_path_factory.mktemp("one_rank")
    shutil.copytree(interrupted / "checkpoint-5", other_world / "checkpoint-5")
    resume = ["--max_steps", "10", *COMMON]
    launch_recipe("llama_lora", "--output_dir", str(interrupted), *resume,
                  "--resume_from_checkpoint", str(interrupted / "checkpoint-5"))  # fmt: skip
    launch_recipe("llama_lora", "--output_dir", str(other_world), *resume, "--per_device_train_batch_size", "32",
                  "--resume_from_checkpoint", str(other_world / "checkpoint-5"), processes=1)  # fmt: skip
    return full, interrupted, other_world


def test_resumed_run_repeats_the_uninterrupted_losses_and_adapter(runs):
    full, resumed, _ = runs
    want, got = _losses(full), _losses(resumed)
    assert sorted(got) == list(range(1, 11))
    for step in range(6, 11):
        assert abs(got[step] - want[step]) <= 1e-6 * abs(want[step]), (step, got[step], want[step])
    reference = load_file(full / "adapter" / "adapter_model.safetensors")
    adapter = load_file(resumed / "adapter" / "adapter_model.safetensors")
    for key, tensor in reference.items():
        assert (adapter[key] - tensor).abs().max() <= 1e-6 * tensor.abs().max(), key


def test_a_two_rank_checkpoint_resumes_on_one_rank(runs):
    full, _, one_rank = runs
    want, got = _losses(full), _losses(one_rank)
    assert read_json(one_rank / "fsdp_layout.json")["world_size"] == 1
    for step in range(6, 11):
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])


def test_killed_rank_then_automatic_resume_ends_with_the_uninterrupted_adapter(tmp_path, tiny_model_dir):
    """kill -9 one rank once a checkpoint exists; relaunching with ``resume_from_checkpoint auto`` finishes
    the run from the last complete checkpoint, and the final adapter equals an uninterrupted run's."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from conftest import ACCELERATE_CPU_FSDP2, REPO, free_port

    steps = ["--max_steps", "16", *COMMON, "--save_steps", "4"]
    launch_recipe("llama_lora", "--output_dir", str(tmp_path / "full"), *steps)

    crashed = tmp_path / "crashed"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CPU_FSDP2),
        "--main_process_port", str(free_port()), str(REPO / "recipes" / "llama_lora.py"),
        "--output_dir", str(crashed), *steps,
    ]  # fmt: skip
    launcher = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (crashed / "checkpoint-4").is_dir() and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.02)
    ranks = [p for p in psutil.Process(launcher.pid).children(recursive=True) if "llama_lora.py" in " ".join(p.cmdline())]
    assert launcher.poll() is None and ranks, "the run ended before a rank could be killed"
    ranks[-1].send_signal(signal.SIGKILL)
    assert launcher.wait(timeout=120) != 0
    assert not (crashed / "adapter").exists()

    launch_recipe("llama_lora", "--output_dir", str(crashed), *steps, "--resume_from_checkpoint", "auto")
    reference = load_file(tmp_path / "full" / "adapter" / "adapter_model.safetensors")
    adapter = load_file(crashed / "adapter" / "adapter_model.safetensors")
    for key, tensor in reference.items():
        assert (adapter[key] - tensor).abs().max() <= 1e-6 * tensor.abs().max(), key
    assert not [p for p in crashed.iterdir() if p.name.endswith(".partial")]
