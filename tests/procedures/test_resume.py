"""Resuming from a sharded checkpoint continues the run exactly (fp32 LoRA, 2 gloo ranks; FSDP2, and FSDP1).

The interrupted run stops after step 6 (``max_steps 6``) with a checkpoint at step 5; a constant
learning rate keeps its first leg identical to the uninterrupted run's first 6 steps.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
from safetensors.torch import load_file

from conftest import ACCELERATE_CPU_FSDP2, REPO, free_port, launch_recipe, logged_losses, read_json, run_command

COMMON = [
    "--logging_steps",
    "1",
    "--generate_samples",
    "0",
    "--generate_eval_samples",
    "0",
    "--warmup_steps",
    "0",
    "--lr_scheduler_type",
    "constant",
    "--save_strategy",
    "steps",
    "--save_steps",
    "5",
    "--per_device_train_batch_size",
    "16",
]

EVA = ["--init_lora_weights", "eva"]  # the FSDP2 runs start from EVA: the resumed leg must skip its data pass

RESUMED: dict[str, str] = {}  # what the interrupted run's two legs printed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    full, interrupted = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("interrupted")
    launch_recipe("llama_lora", "--output_dir", str(full), "--max_steps", "10", *COMMON, *EVA)
    first = launch_recipe("llama_lora", "--output_dir", str(interrupted), "--max_steps", "6", *COMMON, *EVA)
    shutil.rmtree(interrupted / "checkpoint-6")  # the run "died" after step 6; step 5 is the last checkpoint
    other_world = tmp_path_factory.mktemp("one_rank")
    shutil.copytree(interrupted / "checkpoint-5", other_world / "checkpoint-5")
    resume = ["--max_steps", "10", *COMMON, *EVA]
    resumed = launch_recipe(
        "llama_lora",
        "--output_dir",
        str(interrupted),
        *resume,
        "--resume_from_checkpoint",
        str(interrupted / "checkpoint-5"),
    )
    launch_recipe(
        "llama_lora",
        "--output_dir",
        str(other_world),
        *resume,
        "--per_device_train_batch_size",
        "32",
        "--resume_from_checkpoint",
        str(other_world / "checkpoint-5"),
        processes=1,
    )
    RESUMED.update({"first leg": first.stdout, "resumed": resumed.stdout})
    return full, interrupted, other_world


def test_resumed_run_repeats_the_uninterrupted_losses_and_adapter(runs):
    full, resumed, _ = runs
    eva_pass = re.search(r"eva: lora_A of 28 layers from the SVD of their inputs.*", RESUMED["first leg"])
    print(f"first leg: {eva_pass[0]}")
    assert (
        "[fsdp-peft] eva: resuming, the checkpoint's adapter is loaded; the EVA pass is skipped" in RESUMED["resumed"]
    )
    assert "eva: lora_A" not in RESUMED["resumed"]
    want, got = logged_losses(full), logged_losses(resumed)
    assert sorted(got) == list(range(1, 11))
    for step in range(6, 11):
        assert abs(got[step] - want[step]) <= 1e-6 * abs(want[step]), (step, got[step], want[step])
    reference = load_file(full / "adapter" / "adapter_model.safetensors")
    adapter = load_file(resumed / "adapter" / "adapter_model.safetensors")
    for key, tensor in reference.items():
        assert (adapter[key] - tensor).abs().max() <= 1e-6 * tensor.abs().max(), key


def test_a_two_rank_checkpoint_resumes_on_one_rank(runs):
    full, _, one_rank = runs
    want, got = logged_losses(full), logged_losses(one_rank)
    assert read_json(one_rank / "fsdp_layout.json")["world_size"] == 1
    for step in range(6, 11):
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])


def test_fsdp1_resume_repeats_the_uninterrupted_losses_and_adapter(tmp_path, tiny_model_dir):
    """FSDP1 checkpoints hold the adapter and its optimizer state (accelerate alone saves neither), trainable
    token rows included (a unit of their own, `fsdp_peft.parallel.fsdp_policies.fsdp1_wrap_policy`)."""
    fsdp1 = {"accelerate_config": REPO / "configs" / "accelerate" / "cpu_fsdp1.yaml"}
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    common = [*COMMON, "--trainable_token_indices", "3", "5", "7"]
    launch_recipe("llama_lora", "--output_dir", str(full), "--max_steps", "10", *common, **fsdp1)
    launch_recipe("llama_lora", "--output_dir", str(interrupted), "--max_steps", "6", *common, **fsdp1)
    shutil.rmtree(interrupted / "checkpoint-6")
    launch_recipe(
        "llama_lora",
        "--output_dir",
        str(interrupted),
        "--max_steps",
        "10",
        *common,
        "--resume_from_checkpoint",
        str(interrupted / "checkpoint-5"),
        **fsdp1,
    )
    want, got = logged_losses(full), logged_losses(interrupted)
    for step in range(6, 11):
        assert abs(got[step] - want[step]) <= 1e-6 * abs(want[step]), (step, got[step], want[step])
    reference = load_file(full / "adapter" / "adapter_model.safetensors")
    adapter = load_file(interrupted / "adapter" / "adapter_model.safetensors")
    for key, tensor in reference.items():
        assert (adapter[key] - tensor).abs().max() <= 1e-6 * tensor.abs().max(), key
    from fsdp_peft.model.adapter_files import read_sharded_adapter

    assert sorted(read_sharded_adapter(interrupted / "checkpoint-5")) == sorted(reference)  # FSDP2's keys
    assert "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta" in reference


def test_resuming_with_another_global_batch_or_fsdp_version_fails_at_once(runs):
    _, interrupted, _ = runs
    checkpoint = interrupted / "checkpoint-5"
    base = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port())]
    recipe = [
        str(REPO / "recipes" / "llama_lora.py"),
        "--output_dir",
        str(interrupted),
        "--max_steps",
        "10",
        *COMMON,
        *EVA,
        "--resume_from_checkpoint",
        str(checkpoint),
    ]
    one_rank = run_command([*base, "--config_file", str(ACCELERATE_CPU_FSDP2), "--num_processes", "1", *recipe])
    assert (
        f"resume_from_checkpoint: {checkpoint} was written with FSDP2, global batch 32 = 2 ranks x 16 per device "
        "x 1 accumulation; this run has FSDP2, global batch 16 = 1 ranks x 16 per device x 1 accumulation"
    ) in _our_error(one_rank)
    assert "keep the global batch: --per_device_train_batch_size 32" in _our_error(one_rank)

    fsdp1 = run_command(
        [
            *base,
            "--config_file",
            str(REPO / "configs" / "accelerate" / "cpu_fsdp1.yaml"),
            *recipe,
            "--save_strategy",
            "no",
        ]
    )
    assert "Its sharded state is only readable under FSDP2 (e.g. configs/accelerate/cpu_fsdp2.yaml)" in _our_error(
        fsdp1
    )


def _our_error(result) -> str:
    """Our one ``error:`` line (printed once, before any weights load); the launcher's report follows it."""
    assert result.returncode != 0 and "Loading weights" not in result.stdout + result.stderr
    ours = result.stderr.partition("Traceback (most recent call last)")[0]
    errors = [line for line in ours.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


KILL_STEPS = ["--max_steps", "16", *COMMON, "--save_steps", "4"]


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory, tiny_model_dir):
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    launch_recipe("llama_lora", "--output_dir", str(output_dir), *KILL_STEPS, "--save_total_limit", "2")
    return output_dir


@pytest.fixture(scope="module")
def uninterrupted_16_steps(uninterrupted_run):
    return load_file(uninterrupted_run / "adapter" / "adapter_model.safetensors")


def test_save_total_limit_keeps_the_latest_complete_checkpoints(uninterrupted_run):
    assert sorted(p.name for p in uninterrupted_run.iterdir() if "checkpoint" in p.name) == [
        "checkpoint-12",
        "checkpoint-16",
    ]


def _start_run(output_dir):
    """The 16-step run under ``accelerate launch``."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ACCELERATE_CPU_FSDP2),
        "--main_process_port",
        str(free_port()),
        str(REPO / "recipes" / "llama_lora.py"),
        "--output_dir",
        str(output_dir),
        *KILL_STEPS,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _kill_job(launcher) -> None:
    """SIGKILL the launcher and every rank at once (the ranks run in process groups of their own)."""
    job = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
    for process in job:
        process.send_signal(signal.SIGKILL)
    psutil.wait_procs(job, timeout=60)
    launcher.wait(timeout=60)


def _step(checkpoint) -> int:
    return int(checkpoint.name.removesuffix(".partial").split("-")[1])


def _resume_and_compare(output_dir, reference) -> str:
    result = launch_recipe(
        "llama_lora", "--output_dir", str(output_dir), *KILL_STEPS, "--resume_from_checkpoint", "auto"
    )
    adapter = load_file(output_dir / "adapter" / "adapter_model.safetensors")
    for key, tensor in reference.items():
        assert (adapter[key] - tensor).abs().max() <= 1e-6 * tensor.abs().max(), (key, result.stdout[-2000:])
    assert not [p for p in output_dir.iterdir() if p.name.endswith(".partial")]
    return result.stdout


def test_killed_rank_then_automatic_resume_ends_with_the_uninterrupted_adapter(tmp_path, uninterrupted_16_steps):
    """kill -9 one rank once a checkpoint exists; relaunching with ``resume_from_checkpoint auto`` finishes
    the run from the last complete checkpoint, and the final adapter equals an uninterrupted run's."""
    crashed = tmp_path / "crashed"
    launcher = _start_run(crashed)
    deadline = time.time() + 300
    while not (crashed / "checkpoint-4").is_dir() and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.02)
    ranks = [
        p for p in psutil.Process(launcher.pid).children(recursive=True) if "llama_lora.py" in " ".join(p.cmdline())
    ]
    assert launcher.poll() is None and ranks, "the run ended before a rank could be killed"
    ranks[-1].send_signal(signal.SIGKILL)
    assert launcher.wait(timeout=120) != 0
    assert not (crashed / "adapter").exists()
    _resume_and_compare(crashed, uninterrupted_16_steps)


def test_job_killed_while_writing_a_checkpoint_resumes_from_the_last_complete_one(tmp_path, uninterrupted_16_steps):
    """kill -9 the whole job while ``checkpoint-8`` (or a later one) is being written: the staged
    directory is left behind, never chosen, and removed; resuming starts from the checkpoint before it."""
    crashed = tmp_path / "crashed"
    launcher = _start_run(crashed)
    deadline, staged = time.time() + 300, None
    while staged is None and time.time() < deadline and launcher.poll() is None:
        complete = [_step(p) for p in crashed.glob("checkpoint-*")]
        partial = [p for p in crashed.glob(".checkpoint-*.partial") if complete and _step(p) > max(complete)]
        staged = partial[0] if partial else None
        if staged is None:
            time.sleep(0.005)
    assert staged is not None, "the run ended before a checkpoint write after checkpoint-4 could be caught"
    _kill_job(launcher)
    step = _step(staged)
    assert staged.is_dir() and not (crashed / f"checkpoint-{step}").exists(), "the kill came after the save finished"
    last_complete = max(_step(p) for p in crashed.glob("checkpoint-*"))
    assert last_complete < step

    stdout = _resume_and_compare(crashed, uninterrupted_16_steps)
    assert f"removing {staged}" in stdout
    assert f"resuming from {crashed / f'checkpoint-{last_complete}'}" in stdout
