"""Beyond one machine: the Slurm script's launchers on loopback, FSDP2 over 2 "nodes" and HSDP (2 replicas
x 2 shards) against one node, checkpoints across node counts, and the script's dry run.

Each "node" is one ``accelerate launch`` started by ``configs/slurm/recipe.sbatch`` itself: a stand-in for
``srun`` (there is no scheduler here) runs the script's own srun line once per node on this machine, and
the ranks rendezvous on 127.0.0.1 as they would on the first node of an allocation. The "nodes" share one
output_dir, as nodes share a filesystem on a cluster. A constant learning rate makes the first 3 steps of
the 5-step reference those of a 3-step run.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, free_port, launch_recipe, logged_losses, read_json

SBATCH = REPO / "configs" / "slurm" / "recipe.sbatch"
MULTINODE = REPO / "configs" / "accelerate" / "multinode_fsdp2.yaml"
HSDP = REPO / "configs" / "accelerate" / "hsdp_fsdp2.yaml"
COMMON = [
    "--logging_steps",
    "1",
    "--generate_samples",
    "0",
    "--warmup_steps",
    "0",
    "--lr_scheduler_type",
    "constant",
]
GLOBAL_BATCH = 32
SCRIPT_VARIABLES = {
    "RECIPE",
    "CONFIG",
    "ACCELERATE_CONFIG",
    "GPUS_PER_NODE",
    "MAIN_PROCESS_IP",
    "MAIN_PROCESS_PORT",
    "NODES",
    "DRY_RUN",
    "SLURM_JOB_NODELIST",
    "SLURM_GPUS_ON_NODE",
    "SLURM_CPUS_PER_TASK",
}
STAND_IN_SRUN = """#!/usr/bin/env bash
# srun on one machine: the command once per node of the step, concurrently, each with its SLURM_NODEID.
nodes=1
while [[ "$1" == --* ]]; do
    [[ "$1" == --nodes=* ]] && nodes=${1#--nodes=}
    shift
done
for ((node = 0; node < nodes; node++)); do
    SLURM_NODEID=$node "$@" &
done
status=0
for job in $(jobs -p); do wait "$job" || status=1; done
exit $status
"""


def run_sbatch(env: dict[str, str], *recipe_args: str, srun_dir=None) -> subprocess.CompletedProcess:
    """``bash configs/slurm/recipe.sbatch`` with Slurm-like variables, from the repository root."""
    path = [str(srun_dir)] if srun_dir else []
    path += [os.path.dirname(sys.executable), os.environ["PATH"]]  # `accelerate` of this interpreter
    full_env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PATH": os.pathsep.join(path),
        **env,
    }
    for key in SCRIPT_VARIABLES - env.keys():  # only what the test sets, not this machine's own
        full_env.pop(key, None)
    return subprocess.run(
        ["bash", str(SBATCH), *recipe_args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600
    )


def loopback_nodes(tmp_path_factory, name: str, config, processes_per_node: int, *recipe_args: str):
    """The recipe on 2 "nodes" of this machine through the Slurm script; returns the output_dir."""
    srun_dir = tmp_path_factory.mktemp("srun")
    (srun_dir / "srun").write_text(STAND_IN_SRUN)
    (srun_dir / "srun").chmod(0o755)
    output_dir = tmp_path_factory.mktemp(name)
    env = {
        "NODES": "127.0.0.1,127.0.0.1",
        "GPUS_PER_NODE": str(processes_per_node),
        "MAIN_PROCESS_PORT": str(free_port()),
        "ACCELERATE_CONFIG": str(config),
        "RECIPE": "recipes/llama_lora.py",
        "CONFIG": "",
    }
    result = run_sbatch(env, "--output_dir", str(output_dir), *recipe_args, srun_dir=srun_dir)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return output_dir


def _worst_relative_difference(losses: dict[int, float], reference: dict[int, float], steps) -> float:
    return max(abs(losses[step] - reference[step]) / abs(reference[step]) for step in steps)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, tiny_model_dir):
    """The reference: 1 node x 2 processes, plain FSDP2, 5 steps."""
    output_dir = tmp_path_factory.mktemp("one_node")
    batch = ["--per_device_train_batch_size", str(GLOBAL_BATCH // 2)]
    launch_recipe("llama_lora", "--output_dir", str(output_dir), "--max_steps", "5", *COMMON, *batch)
    return output_dir


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, tiny_model_dir):
    """2 nodes x 1 process, FSDP2 over both (configs/accelerate/multinode_fsdp2.yaml), 5 steps."""
    batch = ["--per_device_train_batch_size", str(GLOBAL_BATCH // 2)]
    return loopback_nodes(tmp_path_factory, "two_nodes", MULTINODE, 1, "--max_steps", "5", *COMMON, *batch)


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory, tiny_model_dir):
    """2 nodes x 2 processes, HSDP (configs/accelerate/hsdp_fsdp2.yaml), 3 steps, checkpoint at step 3."""
    batch = ["--per_device_train_batch_size", str(GLOBAL_BATCH // 4)]
    save = ["--save_strategy", "steps", "--save_steps", "3"]
    return loopback_nodes(tmp_path_factory, "hsdp", HSDP, 2, "--max_steps", "3", *COMMON, *batch, *save)


@pytest.mark.slow
def test_two_nodes_train_like_one_node(two_nodes, one_node):
    losses, reference = logged_losses(two_nodes), logged_losses(one_node)
    assert sorted(losses) == sorted(reference) == [1, 2, 3, 4, 5]
    worst = _worst_relative_difference(losses, reference, range(1, 6))
    print(f"2 nodes x 1 process vs 1 node x 2: largest relative loss difference over 5 steps {worst:.2e}")
    assert worst <= 1e-6, (losses, reference)
    layout = read_json(two_nodes / "fsdp_layout.json")
    assert layout["world_size"] == 2 and layout["mesh"]["shape"] == [2]
    adapter = load_file(two_nodes / "adapter" / "adapter_model.safetensors")
    for key, want in load_file(one_node / "adapter" / "adapter_model.safetensors").items():
        assert (adapter[key] - want).abs().max() <= 1e-6 * want.abs().max(), key


@pytest.mark.slow
def test_hsdp_shards_within_a_node_replicates_across_and_trains_like_fsdp(hsdp, one_node):
    losses, reference = logged_losses(hsdp), logged_losses(one_node)
    assert sorted(losses) == [1, 2, 3]
    worst = _worst_relative_difference(losses, reference, range(1, 4))
    print(
        f"HSDP 2 replicas x 2 shards vs FSDP on 2 processes: largest relative loss difference over 3 steps {worst:.2e}"
    )
    assert worst <= 1e-5, (losses, reference)

    layout = read_json(hsdp / "fsdp_layout.json")
    assert layout["world_size"] == 4
    # replicas across the 2 nodes; ranks 0-1 (node 0) and 2-3 (node 1) each shard one copy
    assert layout["mesh"] == {"dim_names": ["dp_replicate", "dp_shard_cp"], "shape": [2, 2], "ranks": [[0, 1], [2, 3]]}
    for parameter in layout["parameters"]:
        assert parameter["placements"] == ["R", "S(0)"], parameter["name"]
        full, local = math.prod(parameter["shape"]), math.prod(parameter["local_shape"])
        assert local == math.ceil(parameter["shape"][0] / 2) * full // parameter["shape"][0], parameter["name"]


@pytest.mark.slow
def test_hsdp_checkpoint_resumes_on_one_node(hsdp, one_node, tmp_path):
    """Written by 2 nodes x 2 processes (HSDP), resumed on 1 node x 2 (FSDP) with the same global batch."""
    shutil.copytree(hsdp / "checkpoint-3", tmp_path / "checkpoint-3")
    batch = ["--per_device_train_batch_size", str(GLOBAL_BATCH // 2)]
    launch_recipe(
        "llama_lora",
        "--output_dir",
        str(tmp_path),
        "--max_steps",
        "5",
        *COMMON,
        *batch,
        "--resume_from_checkpoint",
        str(tmp_path / "checkpoint-3"),
    )
    losses, reference = logged_losses(tmp_path), logged_losses(one_node)
    assert read_json(tmp_path / "fsdp_layout.json")["mesh"]["shape"] == [2]
    worst = _worst_relative_difference(losses, reference, (4, 5))
    print(f"HSDP checkpoint resumed on one node: largest relative loss difference, steps 4-5: {worst:.2e}")
    assert worst <= 1e-5, (losses, reference)


@pytest.mark.slow
def test_hsdp_checkpoint_exports_like_the_final_adapter(hsdp, tmp_path):
    from fsdp_peft.tools.export import export_merged

    from_checkpoint = export_merged(hsdp / "checkpoint-3", tmp_path / "checkpoint", dtype="fp32", progress=False)
    from_adapter = export_merged(hsdp / "adapter", tmp_path / "adapter", dtype="fp32", progress=False)
    merged, reference = load_file(from_checkpoint / "model.safetensors"), load_file(from_adapter / "model.safetensors")
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[key], tensor) for key, tensor in reference.items())


@pytest.mark.slow
def test_hsdp_sizes_that_do_not_fill_the_launch_are_refused_before_training(tmp_path, tiny_model_dir):
    """hsdp_fsdp2.yaml says 2 replicas x 8 shards; a 2-process launch gets the one-line error, exit 2."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(HSDP),
        "--num_machines",
        "1",
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        str(REPO / "recipes" / "llama_lora.py"),
        "--output_dir",
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert (
        "error: parallelism_config: dp_replicate_size 2 x dp_shard_size 8 = 16 ranks, but this launch has 2"
        in result.stderr
    )
    assert "Traceback" not in result.stderr.split("error: parallelism_config")[0]
    assert not (tmp_path / "fsdp_layout.json").exists()


def test_slurm_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _dry_run_commands(result: subprocess.CompletedProcess) -> list[tuple[str, list[str]]]:
    """(host, argv) per ``node <rank> <host>: <command>`` line of a dry run."""
    assert result.returncode == 0, result.stderr
    nodes = []
    for line in result.stdout.splitlines():
        if line.startswith("node "):
            head, command = line.split(": ", 1)
            nodes.append((head.split()[2], shlex.split(command)))
    return nodes


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_dry_run_prints_one_launcher_per_node_with_its_rank_and_the_first_node_as_rendezvous():
    env = {"DRY_RUN": "1", "NODES": "gpu-a,gpu-b,gpu-c", "GPUS_PER_NODE": "4", "MAIN_PROCESS_PORT": "29511"}
    nodes = _dry_run_commands(run_sbatch(env, "--max_steps", "10", "--output_dir", "/shared/run 1"))
    assert [host for host, _ in nodes] == ["gpu-a", "gpu-b", "gpu-c"]
    for rank, (_, argv) in enumerate(nodes):
        assert argv[:2] == ["accelerate", "launch"]
        assert _flag(argv, "--machine_rank") == str(rank)
        assert _flag(argv, "--num_machines") == "3" and _flag(argv, "--num_processes") == "12"
        assert _flag(argv, "--main_process_ip") == "gpu-a" and _flag(argv, "--main_process_port") == "29511"
        assert _flag(argv, "--rdzv_backend") == "static"
        assert _flag(argv, "--config_file") == "configs/accelerate/multinode_fsdp2.yaml"
        assert "--parallelism_config_dp_replicate_size" not in argv
        recipe = argv.index("recipes/llama_qlora.py")
        assert argv[recipe + 1 :] == [
            "--config",
            "configs/llama_qlora/llama3_1_8b.yaml",
            "--max_steps",
            "10",
            "--output_dir",
            "/shared/run 1",
        ]


def test_dry_run_with_an_hsdp_config_makes_one_replica_per_node_from_slurm_variables():
    env = {"DRY_RUN": "1", "SLURM_JOB_NODELIST": "n1,n2", "SLURM_GPUS_ON_NODE": "8", "ACCELERATE_CONFIG": str(HSDP)}
    nodes = _dry_run_commands(run_sbatch(env))
    assert [host for host, _ in nodes] == ["n1", "n2"]
    for rank, (_, argv) in enumerate(nodes):
        assert _flag(argv, "--machine_rank") == str(rank) and _flag(argv, "--num_processes") == "16"
        assert _flag(argv, "--parallelism_config_dp_replicate_size") == "2"
        assert _flag(argv, "--parallelism_config_dp_shard_size") == "8"


@pytest.mark.skipif(shutil.which("scontrol") is not None, reason="scontrol expands the list itself")
def test_dry_run_without_scontrol_refuses_a_node_range_it_cannot_expand():
    result = run_sbatch({"DRY_RUN": "1", "SLURM_JOB_NODELIST": "gpu[01-04]"})
    assert result.returncode == 2
    assert "cannot expand SLURM_JOB_NODELIST=gpu[01-04] without scontrol; set NODES=host1,host2" in result.stderr
