"""Launch the suite's recipe configurations again and again; count exit codes and aborts at exit.

A run that trained and saved must exit 0 on every rank: a rank that aborts at interpreter exit
("terminate called without an active exception", SIGABRT) makes the launcher, Slurm or a pipeline report
a failed job. Such aborts are intermittent, so one green suite proves little; this launches each
configuration the suite uses (FSDP1 and FSDP2, LoRA and QLoRA, checkpoints and resume, variants, DPO and
KTO, trust-remote-code, generation, export) several times, each as a user launches it, and reports:

    python benchmarks/exit_stress.py --repeat 5            # every configuration 5 times
    python benchmarks/exit_stress.py --only resume qlora_fsdp1 --repeat 10

Each launch runs in a directory of its own with core dumps enabled (a ``core`` file there names the rank
that aborted; ``gdb python core`` shows its threads). Figures: ``benchmarks/results/exit_stress.json``.
Each rank also names process-group threads that outlive its process group (they are what the aborts came
from: `fsdp_peft.core._compat.torch_patches.process_groups_released`); those count as failures too. Exits 1 when any
launch failed, printed an abort, or left such threads."""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "exit_stress.json"
ABORT = "terminate called"
LIVE_THREADS = "native threads of the process group outlived it"  # fsdp_peft.core.distributed.release_process_group
SHORT = ["--max_steps", "4", "--logging_steps", "1", "--per_device_train_batch_size", "8", "--warmup_steps", "0"]
QUIET = ["--generate_samples", "0", "--generate_eval_samples", "0"]
CHECKPOINTS = ["--save_strategy", "steps", "--save_steps", "2"]


@dataclass
class Configuration:
    """One way the suite launches a recipe; ``legs`` > 1: launched again into the same directory to resume."""

    name: str
    recipe: str
    overrides: list[str]
    version: int = 2
    processes: int = 2
    legs: int = 1
    launcher_settings: dict[str, str] = field(default_factory=dict)
    remote_code: bool = False


CONFIGURATIONS = [
    Configuration(
        "lora_fsdp2", "llama_lora", [*SHORT, *CHECKPOINTS, "--generate_samples", "4", "--export_merged", "true"]
    ),
    Configuration("qlora_fsdp2", "llama_qlora", [*SHORT, *CHECKPOINTS, "--generate_samples", "4"]),
    Configuration("lora_fsdp1", "llama_lora", [*SHORT, "--generate_samples", "4"], version=1),
    Configuration("qlora_fsdp1", "llama_qlora", [*SHORT, "--generate_samples", "4"], version=1),
    Configuration("resume", "llama_lora", [*SHORT, *QUIET, *CHECKPOINTS, "--init_lora_weights", "eva"], legs=2),
    Configuration(
        "tokens_low_memory",
        "llama_lora",
        [*SHORT, *CHECKPOINTS, "--trainable_token_indices", "3", "5", "7", "--init_lora_weights", "olora"],
        launcher_settings={"fsdp_cpu_ram_efficient_loading": "true"},
    ),
    Configuration("qdora_fsdp1", "llama_qlora", [*SHORT, *QUIET, "--use_dora", "true"], version=1),
    Configuration("dpo", "llama_dpo", [*SHORT, *QUIET, *CHECKPOINTS]),
    Configuration("kto", "llama_dpo", [*SHORT, *QUIET, "--loss_type", "kto"]),
    Configuration("remote_code", "llama_lora", [*SHORT, *QUIET, "--trust_remote_code", "true"], remote_code=True),
    Configuration("one_rank", "llama_lora", [*SHORT, *QUIET, *CHECKPOINTS], processes=1),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accelerate_config(configuration: Configuration, directory: Path) -> Path:
    """The CPU accelerate config of the FSDP version, with the configuration's launcher settings."""
    path = REPO / "configs" / "accelerate" / f"cpu_fsdp{configuration.version}.yaml"
    if not configuration.launcher_settings:
        return path
    text = path.read_text()
    for key, value in configuration.launcher_settings.items():
        text = re.sub(rf"^  {key}: .*$", f"  {key}: {value}", text, count=1, flags=re.MULTILINE)
    written = directory / "accelerate.yaml"
    written.write_text(text)
    return written


def remote_code_model(directory: Path) -> Path:
    """The embedded Llama as a model whose code lives in its directory (as tests/tools/test_runs.py builds it)."""
    from fsdp_peft.model.paths import tiny_model_path
    from fsdp_peft.model.tiny import write_remote_code_copy

    return write_remote_code_copy(tiny_model_path(), directory / "remote-code-llama")


def allow_core_dumps() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def launch(configuration: Configuration, directory: Path, leg: int) -> dict:
    """One launch of the configuration as a user launches it; its exit code, aborts and time."""
    overrides = [*configuration.overrides, "--output_dir", str(directory / "out")]
    if configuration.remote_code:
        overrides += [
            "--model_name_or_path",
            str(remote_code_model(directory) if leg == 0 else directory / "remote-code-llama"),
        ]
    if configuration.legs > 1:
        overrides += ["--max_steps", str(4 * (leg + 1)), "--resume_from_checkpoint", "auto"]
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(accelerate_config(configuration, directory)),
        "--num_processes",
        str(configuration.processes),
        "--main_process_port",
        str(free_port()),
        str(REPO / "recipes" / f"{configuration.recipe}.py"),
        *overrides,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    result = subprocess.run(
        command, cwd=directory, env=env, capture_output=True, text=True, timeout=900, preexec_fn=allow_core_dumps
    )
    output = result.stdout + result.stderr
    (directory / f"leg{leg}.log").write_text(output)
    return {
        "configuration": configuration.name,
        "leg": leg,
        "returncode": result.returncode,
        "aborts": output.count(ABORT),
        "live_threads": output.count(LIVE_THREADS),
        "cores": sorted(p.name for p in directory.iterdir() if p.name.startswith("core")),
        "seconds": round(time.monotonic() - started, 1),
        "directory": str(directory),
    }


def summary_of(launches: list[dict], chosen: list[Configuration]) -> dict:
    """Counts over ``launches`` so far, per configuration, and the launches that failed."""
    failures = [r for r in launches if r["returncode"] != 0 or r["aborts"] or r["live_threads"]]
    return {
        "launches": len(launches),
        "failed": len(failures),
        "aborts": sum(r["aborts"] for r in launches),
        "ranks_with_live_threads": sum(r["live_threads"] for r in launches),
        "per_configuration": {
            c.name: {
                "launches": sum(r["configuration"] == c.name for r in launches),
                "failed": sum(r["configuration"] == c.name for r in failures),
            }
            for c in chosen
        },
        "seconds": round(sum(r["seconds"] for r in launches)),
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="launches of each configuration")
    parser.add_argument("--only", nargs="*", choices=[c.name for c in CONFIGURATIONS], help="these configurations")
    parser.add_argument("--work-dir", type=Path, help="where runs go (default: a temporary directory, kept on failure)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.setdefault("FSDP_PEFT_CACHE", tempfile.mkdtemp(prefix="fsdp_peft_cache_"))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="exit_stress_"))
    chosen = [c for c in CONFIGURATIONS if not args.only or c.name in args.only]
    args.results.parent.mkdir(parents=True, exist_ok=True)
    launches: list[dict] = []
    for repeat in range(args.repeat):
        for configuration in chosen:
            directory = work / f"{configuration.name}-{repeat}"
            directory.mkdir(parents=True)
            for leg in range(configuration.legs):
                record = launch(configuration, directory, leg)
                launches.append(record)
                failed = record["returncode"] != 0 or record["aborts"] or record["live_threads"]
                print(
                    f"{configuration.name:18} #{repeat} leg {leg}: exit {record['returncode']}, "
                    f"{record['aborts']} aborts, {record['live_threads']} ranks with live threads, "
                    f"{record['seconds']:.0f} s" + (f"  <- {directory}" if failed else ""),
                    flush=True,
                )
                # after every launch: a stopped stress check still leaves its figures
                args.results.write_text(json.dumps(summary_of(launches, chosen), indent=1) + "\n")
                if not failed and leg == configuration.legs - 1:
                    shutil.rmtree(directory)
    summary = summary_of(launches, chosen)
    print(
        f"{summary['launches']} launches, {summary['failed']} failed, {summary['aborts']} aborts at exit, "
        f"{summary['ranks_with_live_threads']} ranks with process-group threads left at exit, "
        f"{summary['seconds']} s; {args.results}"
    )
    if not summary["failures"] and not args.work_dir:
        shutil.rmtree(work)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
