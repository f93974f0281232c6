"""Shared fixtures: the embedded model in a per-session cache, and launching recipes as users do."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# tests/xla/ needs the TPU environment (torch-xla, docs/tpu.md); .ci/run builds it and runs them there.
collect_ignore = [] if importlib.util.find_spec("torch_xla") else ["xla"]
ACCELERATE_CPU_FSDP2 = REPO / "configs" / "accelerate" / "cpu_fsdp2.yaml"


# The files whose tests take longest (--durations=0 on 2 cores, 2026-12-06, launches warm), longest first: with
# two test processes (pyproject.toml's -n 2 --dist loadfile) a long file started last would run alone at the end.
LONGEST_FIRST = [
    "test_docs.py",
    "test_vision.py",
    "test_smollm2.py",
    "test_recipes_catalog.py",
    "test_runs.py",
    "test_resume.py",
    "test_eval.py",
    "test_recipes_fsdp.py",
    "test_generate_cli.py",
    "test_variants.py",
    "test_config_fuzz.py",
    "test_export_guards.py",
    "test_multinode.py",
    "test_grpo.py",
    "test_fsdp_routes.py",
    "test_moe.py",
    "test_preference.py",
    "test_sequence_parallel.py",
    "test_plan.py",
    "test_compat.py",
    "test_four_bit.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


@pytest.fixture(scope="session", autouse=True)
def tiny_cache(tmp_path_factory) -> Path:
    """A fresh cache for the embedded model, so the tests also cover building it from the seed: one for the run of
    the suite, shared by its xdist workers (building is safe when processes race), so SmolLM2 is built once."""
    shared = os.environ.get("PYTEST_XDIST_WORKER") and tmp_path_factory.getbasetemp().parent / "fsdp_peft_cache"
    cache = Path(os.environ.get("FSDP_PEFT_TEST_CACHE") or shared or tmp_path_factory.mktemp("fsdp_peft_cache"))
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["FSDP_PEFT_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session", autouse=True)
def cpu_products_as_the_runs_compute() -> None:
    """The test processes multiply bf16 matrices as the runs they launch do: on a CPU without native bf16 products
    in fp32, rounded once (`fsdp_peft.core._compat.torch_patches.cpu_bf16_products_in_fp32`, which a bf16 run on
    such a CPU installs when it loads its model). Installed at the start, so no test's figures depend on whether an
    earlier test of its process loaded a bf16 model; a CPU with native bf16 products is left as it is."""
    from fsdp_peft.core._compat.torch_patches import cpu_bf16_products_in_fp32

    cpu_bf16_products_in_fp32()


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_cache) -> Path:
    from fsdp_peft.model.paths import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def smollm2_dir(tiny_cache) -> Path:
    """SmolLM2-135M-Instruct built into the session's cache (`fsdp_peft.model.smollm2`): once per run of the suite."""
    from fsdp_peft.model.paths import smollm2_path

    return smollm2_path()


def write_tiny_model(directory: Path, config_class, **architecture) -> Path:
    """A 4-layer, width-128 model of ``config_class`` (``architecture``: its own keys, or other sizes) with the
    embedded tokenizer, weights from the seed, written into ``directory``: a model with no family entry, for the
    generic path, or a family's architecture in other sizes."""
    from transformers import AutoTokenizer

    from fsdp_peft.model import tiny

    tokenizer = AutoTokenizer.from_pretrained(tiny.TINY_MODEL_ASSETS)
    sizes = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4)
    config = config_class(
        **{**sizes, **architecture},
        max_position_embeddings=128,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    directory.mkdir(parents=True, exist_ok=True)
    tiny.write_checkpoint(directory, config, tokenizer)
    return directory


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory) -> Path:
    """A tiny Gemma-2 (no family entry; no SDPA in transformers), random weights from the seed, the embedded
    tokenizer: the architecture whose attention ``auto`` must run eager. Sliding window 32 < the tiny data's
    64 tokens, and tied embeddings as in the real checkpoints."""
    from transformers import Gemma2Config

    return write_tiny_model(
        tmp_path_factory.mktemp("gemma2"),
        Gemma2Config,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=32,
        architectures=["Gemma2ForCausalLM"],
    )


def tiny_llama_in_4bit(tiny_model_dir: Path):
    """The tiny Llama loaded as the QLoRA recipes load it: nf4, double quantization, bf16 compute and storage."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16, quantization_config=quantization)
    return model


def command_environment() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def run_command(command: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a user-facing command the way a user would, capturing its output."""
    env = command_environment()
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_launch(command: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """`run_command` for a run expected to succeed, whose numbers or files the test checks: an ``accelerate launch`` or
    ``torchrun`` of a script, ``python script.py``, ``python -m fsdp_peft.cli`` or ``fsdp-peft`` runs as forked ranks of
    a process that has already imported the stack (`warm_ranks`): the same script, over the same process group, in the
    environment its launcher gives, without the imports (docs/tests.md, "Warm launches"). Other commands run as
    `run_command` runs them, as does every command under ``FSDP_PEFT_TEST_COLD_LAUNCHES=1`` or where the warm process
    cannot start. A warm launch that fails is the answer (its output says so): a failure of the warm ranks alone is a
    failure of this file to fix, not a reason to hide it behind a second, cold run."""
    import warm_ranks

    launch = None if os.environ.get("FSDP_PEFT_TEST_COLD_LAUNCHES") == "1" else warm_ranks.launch_of(command)
    if launch is not None:
        try:
            result = warm_ranks.run(launch, command_environment(), REPO, timeout)
        except warm_ranks.NotStarted as why:
            print(f"{why}; launching cold", file=sys.stderr)
        else:
            if result.returncode != 0:
                result.stderr += (
                    "\n(warm ranks, tests/warm_ranks.py: FSDP_PEFT_TEST_COLD_LAUNCHES=1 launches it cold)\n"
                )
            return result
    return run_command(command, timeout)


def recipe_launch_command(
    recipe: str, *overrides: str, processes: int = 2, accelerate_config: Path = ACCELERATE_CPU_FSDP2
) -> list[str]:
    """``accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/<recipe>.py ...``."""
    return script_launch_command(
        REPO / "recipes" / f"{recipe}.py", *overrides, processes=processes, accelerate_config=accelerate_config
    )


def script_launch_command(
    script: Path, *arguments: str, processes: int = 2, accelerate_config: Path = ACCELERATE_CPU_FSDP2
) -> list[str]:
    """``accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml <script> ...``."""
    launcher = ["-m", "accelerate.commands.launch", "--config_file", str(accelerate_config)]
    ranks = ["--num_processes", str(processes), "--main_process_port", str(free_port())]
    return [sys.executable, *launcher, *ranks, str(script), *arguments]


def torchrun_command(*arguments: str, processes: int = 2) -> list[str]:
    """``torchrun --nproc_per_node 2 --master_port <free> ARGUMENTS`` (a script or ``-m module``, then its own)."""
    ranks = ["--nproc_per_node", str(processes), "--master_port", str(free_port())]
    return [sys.executable, "-m", "torch.distributed.run", *ranks, *arguments]


def recipe_torchrun_command(recipe: str, *overrides: str, processes: int = 2) -> list[str]:
    """``torchrun --nproc_per_node 2 recipes/<recipe>.py ...`` (no accelerate config)."""
    return torchrun_command(str(REPO / "recipes" / f"{recipe}.py"), *overrides, processes=processes)


def launch_recipe(
    recipe: str, *overrides: str, processes: int = 2, accelerate_config: Path = ACCELERATE_CPU_FSDP2
) -> subprocess.CompletedProcess:
    """Run `recipe_launch_command`; fails the test if any rank fails."""
    result = run_launch(
        recipe_launch_command(recipe, *overrides, processes=processes, accelerate_config=accelerate_config)
    )
    assert result.returncode == 0, f"{recipe} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def procedure_of(config: Path):
    """The `fsdp_peft.procedures.procedure.Procedure` that trains a config (its recipe's, or its keys')
    (`fsdp_peft.procedures.registry.config_procedure`)."""
    from fsdp_peft.procedures.registry import config_procedure

    return config_procedure(config)[0]


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def logged_losses(output_dir: Path) -> dict[int, float]:
    """``{step: training loss}`` as Trainer logged them in ``output_dir/trainer_state.json``."""
    return {
        e["step"]: e["loss"] for e in read_json(Path(output_dir) / "trainer_state.json")["log_history"] if "loss" in e
    }


def held_out_token_loss(model, rows) -> float:
    """Plain transformers: each tokenized row (``input_ids``, ``labels``) alone through ``model``, the losses of its
    labelled tokens summed and counted: the held-out tokens' mean cross-entropy, as the recipes define the eval loss
    (docs/checkpoints.md), computed without them."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1].float()
            labels = torch.tensor(row["labels"][1:])
            keep = labels != -100
            total += torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
            count += int(keep.sum())
    return total / count


def torchrun(script: Path, *args: str, processes: int = 2) -> subprocess.CompletedProcess:
    """Run ``script`` on ``processes`` gloo ranks with torchrun; fails the test if any rank fails."""
    result = run_launch(torchrun_command(str(script), *args, processes=processes))
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def last_json_line(text: str):
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
