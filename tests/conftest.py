"""Shared fixtures: the embedded model in a per-session cache, and launching recipes as users do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ACCELERATE_CPU_FSDP2 = REPO / "configs" / "accelerate" / "cpu_fsdp2.yaml"


@pytest.fixture(scope="session", autouse=True)
def tiny_cache(tmp_path_factory) -> Path:
    """A fresh cache for the embedded model, so the tests also cover building it from the seed."""
    cache = Path(os.environ.get("FSDP_PEFT_TEST_CACHE") or tmp_path_factory.mktemp("fsdp_peft_cache"))
    os.environ["FSDP_PEFT_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_cache) -> Path:
    from fsdp_peft.tiny import tiny_model_path

    return tiny_model_path()


def run_command(command: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a user-facing command the way a user would, capturing its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def launch_recipe(
    recipe: str, *overrides: str, processes: int = 2, accelerate_config: Path = ACCELERATE_CPU_FSDP2
) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/<recipe>.py ...``."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(accelerate_config), "--num_processes", str(processes),
        "--main_process_port", str(free_port()),
        str(REPO / "recipes" / f"{recipe}.py"), *overrides,
    ]  # fmt: skip
    result = run_command(command)
    assert result.returncode == 0, f"{recipe} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def logged_losses(output_dir: Path) -> dict[int, float]:
    """``{step: training loss}`` as Trainer logged them in ``output_dir/trainer_state.json``."""
    return {e["step"]: e["loss"] for e in read_json(Path(output_dir) / "trainer_state.json")["log_history"] if "loss" in e}


def torchrun(script: Path, *args: str, processes: int = 2) -> subprocess.CompletedProcess:
    """Run ``script`` on ``processes`` gloo ranks with torchrun; fails the test if any rank fails."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
        "--master_port", str(free_port()), str(script), *args,
    ]  # fmt: skip
    result = run_command(command)
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def last_json_line(text: str):
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
