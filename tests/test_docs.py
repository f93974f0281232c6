"""Every shell command shown in README.md and docs/*.md runs here, as written or through a named stand-in.

The commands are the lines of the fenced ``bash``, ``sh`` and ``console`` blocks (``$ `` lines in a
``console`` block), with ``\\`` continuations joined, ``# comments`` dropped and ``&&`` chains split into
their commands. Each one is covered by exactly one rule:

- ``fsdp-peft ...``: run verbatim.
- a launch that runs on CPUs (``accelerate launch`` with a ``configs/accelerate/cpu_*`` config,
  single-node ``torchrun``, ``python recipes/X.py``): run verbatim on a free rendezvous port, a recipe
  launch with `QUICK` appended (2 steps, no sample generation, the eval loss on 16 rows, no checkpoints
  unless it asks for them).
- anything else (GPUs, several nodes, Slurm, ``pip``, an editor, this test suite): `INSTEAD` maps the
  exact documented command to what runs in its place, and says why.

Each command runs in a fresh directory that links the checkout's ``recipes/`` and ``configs/`` and copies
``benchmarks/`` (its scripts write results beside themselves), so relative paths work as in a checkout and
everything a command writes stays there. Placeholders become real: ``my.yaml`` and the prompt files are
written first, ``outputs/<run>`` is the output of the documented launch that `PRODUCERS` names, and hub
ids resolve offline to the real models' ``config.json`` (`HUB_CONFIGS`). A documented command that no rule
covers fails `test_every_documented_command_is_covered`: make it runnable here or add its stand-in.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field, replace
from pathlib import Path
from unittest import mock

import pytest
import yaml

from conftest import REPO, free_port
from fsdp_peft.model.paths import HUB_CONFIGS as SHIPPED_HUB_CONFIGS
from fsdp_peft.model.paths import tiny_model_path

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_FENCES = {"bash", "sh", "console"}

QUICK = "--max_steps 2 --generate_samples 0 --generate_eval_samples 0 --eval_strategy no --max_eval_samples 16"
QUICK_NO_CHECKPOINTS = "--save_strategy no"  # appended unless the launch sets save_strategy itself

QUICK_START = "accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/llama_qlora.py"
GENERATION_RUN = (
    "accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/llama_lora.py"
    " --save_strategy steps --save_steps 200 --export_merged true"
)
# ``outputs/<run>`` in a command that reads it is the output of this documented launch (run once).
SFT_START = (
    "accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/llama_lora.py --max_steps 130"
    " --output_dir outputs/llama_lora_short --generate_samples 0"
)
VISION_START = "accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/qwen_vl_lora.py"
REAL_TASK_START = (
    "accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/llama_lora.py"
    " --config configs/llama_lora/smollm2_iso_dates.yaml"
)
PRODUCERS = {
    "llama_qlora_tiny": QUICK_START,
    "llama_lora_tiny": GENERATION_RUN,
    "llama_lora_short": SFT_START,
    "qwen_vl_lora_tiny": VISION_START,
    "smollm2_iso_dates": REAL_TASK_START,
}
# A 400-step run's last checkpoint is checkpoint-400; the same launch with QUICK ends at checkpoint-2.
PLACEHOLDERS = {"checkpoint-400": "checkpoint-2"}

# What `fsdp-peft cp qwen_qlora/qwen2_5_7b.yaml my.yaml` writes: the README's copy-edit-launch loop.
MY_YAML = (REPO / "configs" / "qwen_qlora" / "qwen2_5_7b.yaml").read_text()


def _png_bytes(color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buffer, format="PNG")
    return buffer.getvalue()


PLACEHOLDER_FILES = {
    "my.yaml": MY_YAML,
    "prompts.txt": "reverse: hello\nreverse: abcde\n",
    "prompts.jsonl": '{"prompt": "reverse: hello"}\n{"prompt": "reverse: abcde"}\n',
    "my_image.png": _png_bytes((220, 30, 30)),  # a red 32x32 image (docs/vision.md)
}

# The config.json of each hub model a documented command reads: the published ones the package keeps for the
# shipped configs' models (`fsdp_peft.model.paths.shipped_hub_config`), here also as a hub cache for `validate`.
HUB_CONFIGS = {
    path.stem.replace("--", "/"): json.loads(path.read_text()) for path in sorted(SHIPPED_HUB_CONFIGS.glob("*.json"))
}


def _fenced_blocks(page: Path, languages: set[str]):
    """``(language, first line number, [lines])`` of each fenced block of ``page`` in one of ``languages``."""
    language, start, lines = None, 0, []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            if language is None:
                language, start, lines = line.strip()[3:].strip(), number + 1, []
            else:
                if language in languages:
                    yield language, start, lines
                language = None
        elif language is not None:
            lines.append(line)


def _without_comment(line: str) -> str:
    """``line`` up to a ``#`` that starts a word outside quotes, as the shell reads it."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip()
    return line.rstrip()


def _split_and(command: str) -> list[str]:
    """The commands of an ``a && b`` chain (``&&`` outside quotes)."""
    parts, quote, current, index = [], None, "", 0
    while index < len(command):
        char = command[index]
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif command.startswith("&&", index):
            parts.append(current.strip())
            current, index = "", index + 2
            continue
        current += char
        index += 1
    return [part for part in [*parts, current.strip()] if part]


def _where(page: Path) -> str:
    return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else page.name


def documented_commands(pages: list[Path] = PAGES) -> dict[str, list[str]]:
    """Every shell command in ``pages``, each with the ``page:line`` places that show it."""
    commands: dict[str, list[str]] = {}
    for page in pages:
        for language, start, lines in _fenced_blocks(page, SHELL_FENCES):
            pending, first = "", start
            for offset, line in enumerate(lines):
                if not pending:
                    first = start + offset
                    if line.startswith("$ "):
                        line = line[2:]
                    elif language == "console":
                        continue  # output shown in a console block
                text = _without_comment(line).strip()
                if text.endswith("\\"):
                    pending += text[:-1].strip() + " "
                    continue
                command, pending = (pending + text).strip(), ""
                for part in _split_and(command):
                    commands.setdefault(part, []).append(f"{_where(page)}:{first}")
    return commands


def documented_output(page: str, after: str) -> list[str]:
    """The lines of the first plain fenced block that follows the line containing ``after`` in ``page``."""
    text = (REPO / page).read_text()
    rest = text[text.index(after) :]
    block = rest[rest.index("\n```\n") + 5 :]
    return block[: block.index("\n```")].splitlines()


def page_yaml(page: str) -> str:
    """The first ``yaml`` block of ``page``: a config the page goes on to launch as ``my.yaml``."""
    return "\n".join(next(_fenced_blocks(REPO / page, {"yaml"}))[2]) + "\n"


# Files a page defines before the command that reads them (instead of PLACEHOLDER_FILES).
PAGE_FILES = {
    "torchrun --nproc_per_node 2 recipes/llama_lora.py --config my.yaml": {
        "my.yaml": page_yaml("docs/fsdp-settings.md")
    },
}


@dataclass(frozen=True)
class Run:
    """What runs for a documented command: a shell command in a fresh workspace, after writing ``files``."""

    command: str
    files: tuple[tuple[str, str], ...] = ()
    why: str = field(default="", compare=False)  # a stand-in's reason: why the documented command cannot run here


def _validate(config: str, accelerate_config: str, why: str, **files: str) -> Run:
    return Run(f"fsdp-peft validate {config} --accelerate-config {accelerate_config}", tuple(files.items()), why)


def _edited(text: str, old: str, new: str) -> str:
    assert old in text, f"nothing to edit: {old!r} not found"
    return text.replace(old, new)


def _accelerate_config_with(name: str, key: str, value: str) -> str:
    """A shipped accelerate config with ``key`` set as an ``accelerate launch --key value`` option sets it."""
    text = (REPO / "configs" / "accelerate" / name).read_text()
    changed = re.sub(rf"(?m)^(\s*{key}:) \S+", rf"\1 {value}", text)
    assert changed != text, f"{name} has no {key} to set"
    return changed


GPU = "needs GPUs: checked as the launch would start it, without weights"
NODES = (
    "needs several machines: checked as node 0 would start it; tests/parallel/test_multinode.py runs it on 2 CPU "
    "'nodes'"
)
SLURM = (
    "needs Slurm: the script's dry run prints each node's launcher (tests/parallel/test_multinode.py::test_dry_run_*)"
)
TPU_ENVIRONMENT = "the TPU environment (torch 2.9.0 + torch-xla 2.9.0): .ci/run runs the documented line verbatim"
TPU = "needs a TPU and the TPU environment"
TORCHRUN_2X8 = "distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 16\nmachine_rank: 0\n"

# Documented commands that cannot run on this machine as written, and what runs in their place.
INSTEAD: dict[str, Run] = {
    "pip install -e .": Run(
        f"python -c 'import fsdp_peft; assert fsdp_peft.__file__.startswith(\"{REPO}/\")' && fsdp-peft ls",
        why="installs: this environment has the editable install of this checkout (.ci/run makes it)",
    ),
    'pip install -e ".[test]"': Run(
        "python -c 'import pytest; assert int(pytest.__version__.split(\".\")[0]) >= 8'",
        why="installs: the test extra (pytest>=8) is what runs this test",
    ),
    "python -m pytest -q": Run(
        "grep -qxF 'pip install -e \".[test]\" && python -m pytest -q' .ci/run",
        why="is this test suite: .ci/run runs the documented line verbatim",
    ),
    "lm_eval --model hf --model_args pretrained=outputs/llama_lora_tiny/merged --include_path fsdp_peft/harness_tasks "
    "--tasks tiny_reverse_em --batch_size 16 --apply_chat_template": Run(
        "lm_eval --model hf --model_args pretrained=outputs/llama_lora_tiny/merged --include_path "
        f"{REPO}/fsdp_peft/harness_tasks --tasks tiny_reverse_em --batch_size 16 --apply_chat_template",
        why="the harness's own command as written; its task directory is the checkout's (no fsdp_peft/ in workspaces)",
    ),
    "lm_eval --model hf --model_args pretrained=merged_smollm2 --include_path fsdp_peft/harness_tasks --tasks "
    "iso_dates_em --batch_size 50 --apply_chat_template": Run(
        "fsdp-peft export outputs/smollm2_iso_dates --out merged_smollm2/ --dtype fp32 && lm_eval --model hf "
        f"--model_args pretrained=merged_smollm2 --include_path {REPO}/fsdp_peft/harness_tasks --tasks iso_dates_em "
        "--batch_size 50 --apply_chat_template",
        why="the harness's own command as written, after the export the page shows before it (each documented command "
        "runs in a workspace of its own), written in fp32, the dtype the run trained in: on a CPU without AVX512-BF16 "
        "the harness takes 4.7x as long on the default bf16 export (docs/real_model.md); the page's export command "
        "runs as written; its task directory is the checkout's",
    ),
    "$EDITOR my.yaml": Run(
        "fsdp-peft validate my.yaml --recipe qwen_qlora",
        (("my.yaml", _edited(MY_YAML, "lora_r: 16 ", "lora_r: 8 ")),),
        why="an editor: the copy with lora_r changed, validated",
    ),
    "accelerate launch --config_file configs/accelerate/fsdp2.yaml recipes/qwen_qlora.py --config my.yaml": _validate(
        "my.yaml", "configs/accelerate/fsdp2.yaml", GPU
    ),
    "accelerate launch --config_file configs/accelerate/fsdp2.yaml recipes/llama_qlora.py "
    "--config configs/llama_qlora/llama3_1_8b.yaml --learning_rate 1e-4": _validate(
        "launched.yaml",
        "configs/accelerate/fsdp2.yaml",
        GPU,
        **{"launched.yaml": "include: llama_qlora/llama3_1_8b.yaml\nlearning_rate: 1.0e-4\n"},
    ),
    "accelerate launch --config_file configs/accelerate/fsdp2.yaml recipes/qwen_grpo.py "
    "--config configs/qwen_grpo/qwen2_5_7b_gsm8k_qlora.yaml": _validate(
        "configs/qwen_grpo/qwen2_5_7b_gsm8k_qlora.yaml", "configs/accelerate/fsdp2.yaml", GPU
    ),
    "accelerate launch --config_file configs/accelerate/fsdp2.yaml recipes/llama_lora.py "
    "--config configs/llama_lora/llama3_1_8b.yaml": _validate(
        "configs/llama_lora/llama3_1_8b.yaml", "configs/accelerate/fsdp2.yaml", GPU
    ),
    "accelerate launch --config_file configs/accelerate/fsdp2.yaml --fsdp_cpu_ram_efficient_loading true "
    "recipes/llama_qlora.py --config configs/llama_qlora/llama3_1_8b.yaml": _validate(
        "configs/llama_qlora/llama3_1_8b.yaml",
        "launcher.yaml",
        GPU,
        **{"launcher.yaml": _accelerate_config_with("fsdp2.yaml", "fsdp_cpu_ram_efficient_loading", "true")},
    ),
    "accelerate launch --config_file configs/accelerate/multinode_fsdp2.yaml --num_machines 2 --num_processes 16 "
    "--machine_rank 0 --main_process_ip node0.cluster --main_process_port 29500 recipes/llama_qlora.py "
    "--config configs/llama_qlora/llama3_1_8b.yaml": _validate(
        "configs/llama_qlora/llama3_1_8b.yaml", "configs/accelerate/multinode_fsdp2.yaml", NODES
    ),
    "torchrun --nnodes 2 --nproc_per_node 8 --node_rank 0 --master_addr node0.cluster --master_port 29500 "
    'recipes/llama_qlora.py --config configs/llama_qlora/llama3_1_8b.yaml --fsdp "full_shard auto_wrap" '
    '--fsdp_config \'{"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}\'': _validate(
        "launched.yaml",
        "torchrun.yaml",
        NODES + "; torchrun's 2 x 8 ranks as a launcher config without FSDP",
        **{
            "launched.yaml": "include: llama_qlora/llama3_1_8b.yaml\nfsdp: full_shard auto_wrap\n"
            'fsdp_config: {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}\n',
            "torchrun.yaml": TORCHRUN_2X8,
        },
    ),
    "accelerate launch --config_file configs/accelerate/hsdp_fsdp2.yaml --machine_rank 0 "
    "--main_process_ip node0.cluster recipes/llama_qlora.py --config configs/llama_qlora/llama3_1_8b.yaml": _validate(
        "configs/llama_qlora/llama3_1_8b.yaml", "configs/accelerate/hsdp_fsdp2.yaml", NODES
    ),
    "sbatch configs/slurm/recipe.sbatch": Run(
        "DRY_RUN=1 SLURM_JOB_NODELIST=node1,node2 bash configs/slurm/recipe.sbatch", why=SLURM
    ),
    "sbatch --nodes 4 configs/slurm/recipe.sbatch --learning_rate 1e-4": Run(
        "DRY_RUN=1 SLURM_JOB_NODELIST=node1,node2,node3,node4 bash configs/slurm/recipe.sbatch --learning_rate 1e-4",
        why=SLURM,
    ),
    "RECIPE=recipes/llama_lora.py CONFIG=configs/llama_lora/llama3_1_8b.yaml "
    "ACCELERATE_CONFIG=configs/accelerate/hsdp_fsdp2.yaml sbatch configs/slurm/recipe.sbatch": Run(
        "RECIPE=recipes/llama_lora.py CONFIG=configs/llama_lora/llama3_1_8b.yaml "
        "ACCELERATE_CONFIG=configs/accelerate/hsdp_fsdp2.yaml DRY_RUN=1 SLURM_JOB_NODELIST=node1,node2 "
        "bash configs/slurm/recipe.sbatch",
        why=SLURM,
    ),
    **{
        line: Run(f"grep -qxF '{line}' .ci/run", why=TPU_ENVIRONMENT)
        for line in (
            "python3 -m venv .venv-xla",
            ".venv-xla/bin/python -m pip install -q -r requirements-tpu.txt",
            ".venv-xla/bin/python -m pip install -q --no-deps -e .",
            ".venv-xla/bin/python -m pytest -q -p no:cacheprovider tests/xla",
        )
    },
    "PJRT_DEVICE=TPU python recipes/llama_lora.py --config configs/llama_lora/tpu_v5e_8.yaml": Run(
        f"grep -qF 'tpu_*.yaml' {REPO}/tests/xla/test_xla_recipes.py",
        why=TPU + "; tests/xla validates it there and runs the same recipe on simulated devices",
    ),
    "PJRT_DEVICE=TPU fsdp-peft plan configs/llama_lora/tpu_v5e_8.yaml --gpus 8 --gpu-memory 16GiB": Run(
        f"grep -qF 'PJRT_DEVICE=TPU fsdp-peft plan (' {REPO}/tests/xla/test_xla_recipes.py",
        why="runs in tests/xla (the TPU configs' headers against it), keeping the main suite's time",
    ),
    "python benchmarks/cpu_bf16_products.py": Run(
        "python benchmarks/cpu_bf16_products.py --repeats 1", why="as written, one timed call a case (about 15 s)"
    ),
    "python benchmarks/train_cpu.py": Run(
        "python benchmarks/train_cpu.py --models tiny --methods lora --steps 1",
        why="10-20 minutes: the same benchmark on the tiny model, LoRA, 1 step",
    ),
    "python benchmarks/variants.py": Run(
        "python benchmarks/variants.py --variants embedding_lora --methods qlora --versions 1",
        why="25 minutes: one variant the suite's combined runs leave out (QLoRA, embedding LoRA, FSDP1)",
    ),
    "python benchmarks/eval_speed.py": Run(
        "python benchmarks/eval_speed.py --steps 2 --repeats 1 --results eval_speed.json",
        why="5 minutes: a 2-step adapter, each evaluation once, timed and compared the same way",
    ),
    "python benchmarks/exit_stress.py --repeat 6": Run(
        "python benchmarks/exit_stress.py --only remote_code --repeat 1 --results exit_stress.json",
        why="50 minutes: one configuration (2 ranks, a model with remote code) once, counted the same way",
    ),
    "python benchmarks/activations.py": Run(
        "python benchmarks/activations.py --tokens 128 --vocab 4096",
        why="4 minutes: the same measurement and planner check on a 128-token, 4096-word shape",
    ),
    "python benchmarks/sequence_parallel.py": Run(
        "python benchmarks/sequence_parallel.py --lengths 256 --cap-tokens 256",
        why="a minute: the same measurement and planner check on 256-token rows",
    ),
    "bash benchmarks/gpu_check.sh": Run(
        "bash benchmarks/gpu_check.sh --dry-run", why="needs a GPU: its documented CPU dry run, same code"
    ),
}
# A launch checked in its place is checked for the recipe it launches (`fsdp-peft validate --recipe`): its procedure.
for _documented, _run in INSTEAD.items():
    if (_launched := re.search(r"recipes/(\w+)\.py", _documented)) and _run.command.startswith("fsdp-peft validate "):
        INSTEAD[_documented] = replace(_run, command=f"{_run.command} --recipe {_launched[1]}")


def _recipe_launch(command: str) -> str | None:
    """The recipe a launch starts (``llama_qlora``), or None."""
    match = re.match(r"^(?:accelerate launch|torchrun|python) (?:.* )?recipes/(\w+)\.py(?: |$)", command)
    return match.group(1) if match else None


def _runs_on_cpus(command: str) -> bool:
    """A launch this machine runs as written: a CPU accelerate config, one-node torchrun, or one process."""
    if command.startswith("accelerate launch "):
        return "--config_file configs/accelerate/cpu_" in command and "--machine_rank" not in command
    if command.startswith("torchrun "):
        return not re.search(r"--nnodes|--node_rank|--rdzv", command)
    return command.startswith("python recipes/")


def coverage(command: str) -> Run | None:
    """What runs for a documented command, or None when nothing covers it."""
    documented = command
    if command in INSTEAD:
        return INSTEAD[command]
    if re.match(r"^(cat \S+ \| )?fsdp-peft \S", command) or re.search(r"(^|\s)(DRY_RUN=1|--dry-run)(\s|$)", command):
        return Run(command)  # the command line tool, and the dry runs of the Slurm and GPU-check scripts
    if command.startswith(("accelerate launch ", "torchrun ", "python recipes/")) and _runs_on_cpus(command):
        if _recipe_launch(command) and "--print-config" not in command:
            quick = QUICK if "--save_strategy" in command else f"{QUICK} {QUICK_NO_CHECKPOINTS}"
            command = f"{command} {quick}"
        return Run(command, tuple(PAGE_FILES.get(documented, {}).items()))
    return None


DOCUMENTED = documented_commands()
RUNS: dict[Run, list[str]] = {}
for _command in DOCUMENTED:
    if (_run := coverage(_command)) is not None:
        RUNS.setdefault(_run, []).append(_command)


def _slow(run: Run) -> bool:
    """Runs that start several processes: launches, readers of a launch's outputs, the benchmarks."""
    return bool(re.match(r"^(accelerate launch|torchrun) |.*(outputs|benchmarks)/", run.command))


def _run_id(run: Run) -> str:
    """The first place that documents it, and how the command starts."""
    return f"{DOCUMENTED[RUNS[run][0]][0]} {' '.join(RUNS[run][0].split()[:3])}"


# `fsdp-peft` commands that start no process group run in this process: the console script's `main` with
# the same arguments, without paying for a fresh torch import (seconds) each time.
IN_PROCESS = re.compile(r"^fsdp-peft (ls|cp|validate|plan|tiny-model)( [\w./=-]+)*$")


@dataclass
class Outcome:
    workspace: Path
    command: str  # as it ran: rendezvous port and placeholders filled in
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return f"{self.stdout}\n{self.stderr}"


@dataclass
class Workspaces:
    """Fresh directories to run documented commands in; each run happens once per module."""

    base: Path
    hub: Path  # the offline hub cache
    outcomes: dict[Run, Outcome] = field(default_factory=dict)

    def run(self, run: Run) -> Outcome:
        if run not in self.outcomes:  # a name of its own now: the run may first need a producer's run (`outputs`)
            workspace = Path(tempfile.mkdtemp(prefix="run", dir=self.base))
            self.outcomes[run] = self._run(run, workspace)
        return self.outcomes[run]

    def outputs(self, name: str) -> Path:
        """``outputs/<name>`` as the documented launch `PRODUCERS` names for it writes it."""
        outcome = self.run(coverage(PRODUCERS[name]))
        assert outcome.returncode == 0, f"{PRODUCERS[name]} failed:\n{outcome.output[-4000:]}"
        return outcome.workspace / "outputs" / name

    def _run(self, run: Run, workspace: Path) -> Outcome:
        for name in ("recipes", "configs", ".ci"):
            (workspace / name).symlink_to(REPO / name)
        shutil.copytree(REPO / "benchmarks", workspace / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
        command = run.command
        for placeholder, value in PLACEHOLDERS.items():
            command = command.replace(placeholder, value)
        for name, text in PLACEHOLDER_FILES.items():
            if re.search(rf"(^|[\s/]){re.escape(name)}(\s|$)", command) and not command.startswith("fsdp-peft cp "):
                path = workspace / name
                path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
        for name, text in run.files:
            (workspace / name).write_text(text)
        # what the command reads: any outputs/<run> it names, or for a launch, the adapter it starts from
        reads = r"--adapter_name_or_path outputs/(\w+)" if _recipe_launch(command) else r"outputs/(\w+)"
        for name in sorted(set(re.findall(reads, command))):
            (workspace / "outputs").mkdir(exist_ok=True)
            (workspace / "outputs" / name).symlink_to(self.outputs(name))
        command = re.sub(r"^accelerate launch ", f"accelerate launch --main_process_port {free_port()} ", command)
        command = re.sub(r"^torchrun ", f"torchrun --master_port {free_port()} ", command)
        if IN_PROCESS.match(command):
            return Outcome(workspace, command, *_fsdp_peft_here(command.split()[1:], workspace, self.hub))
        environment = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_CACHE": str(self.hub),
        }
        result = subprocess.run(
            ["bash", "-c", command], cwd=workspace, env=environment, capture_output=True, text=True, timeout=900
        )
        return Outcome(workspace, command, result.returncode, result.stdout, result.stderr)


def _fsdp_peft_here(argv: list[str], workspace: Path, hub: Path) -> tuple[int, str, str]:
    """``fsdp-peft argv`` run in ``workspace`` by `fsdp_peft.cli.main`, with the offline hub cache ``hub``."""
    import datasets.config
    from huggingface_hub import constants

    from fsdp_peft.cli import main

    stdout, stderr, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    with (
        mock.patch.object(constants, "HF_HUB_OFFLINE", True),
        mock.patch.object(datasets.config, "HF_HUB_OFFLINE", True),  # a harness task's hub data: refused at once
        mock.patch.object(constants, "HF_HUB_CACHE", str(hub)),
        redirect_stdout(stdout),
        redirect_stderr(stderr),
    ):
        os.chdir(workspace)
        try:
            main(argv)
            returncode = 0
        except SystemExit as exit:
            returncode = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
        finally:
            os.chdir(cwd)
    return returncode, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory) -> Workspaces:
    """Workspaces whose hub cache holds the `HUB_CONFIGS`, as a download of each model's config leaves it."""
    hub = tmp_path_factory.mktemp("hub")
    for repo, config in HUB_CONFIGS.items():
        snapshot = hub / f"models--{repo.replace('/', '--')}" / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(config))
        (snapshot.parent.parent / "refs").mkdir()
        (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    return Workspaces(tmp_path_factory.mktemp("docs"), hub)


def check(outcome: Outcome, documented: list[str]) -> None:
    """What each kind of command must have done, beyond exiting 0."""
    command, workspace, output = outcome.command, outcome.workspace, outcome.output
    assert outcome.returncode == 0, f"{command} exited {outcome.returncode}:\n{output[-4000:]}"
    if (recipe := _recipe_launch(command)) and "--print-config" not in command:
        assert re.search(rf"\[fsdp-peft\] {recipe}: 2 steps, ", output), output[-3000:]
        adapter = re.search(r"\[fsdp-peft\] adapter: (\S+)", output).group(1)
        assert json.loads((workspace / adapter / "adapter_config.json").read_text())["peft_type"] == "LORA"
    elif "--print-config > resolved.yaml" in command:
        assert yaml.safe_load((workspace / "resolved.yaml").read_text())["learning_rate"] == 1e-4
    elif match := re.search(r"fsdp-peft validate (\S+)", command):
        assert re.search(rf"(?m)^{re.escape(match.group(1))}: ok\b", outcome.stdout), output[-3000:]
    elif command.startswith("fsdp-peft plan") and "--json" in command:
        assert json.loads(outcome.stdout)["fits"] is True
    elif command.startswith("fsdp-peft plan"):
        assert outcome.stdout.splitlines()[-1].startswith("fits in ")
    elif command == "fsdp-peft ls":
        assert {recipe.stem for recipe in (REPO / "recipes").glob("*.py")} <= set(
            re.findall(r"(?m)^recipe\s+(\w+)", output)
        )
    elif match := re.match(r"fsdp-peft cp (\S+) (\S+)$", command):
        assert (workspace / match.group(2)).read_text() == (REPO / "configs" / match.group(1)).read_text()
    elif "fsdp-peft generate" in command and "--json" in command:
        rows = [json.loads(line) for line in outcome.stdout.splitlines() if line.startswith("{")]
        assert [row["prompt"] for row in rows] == ["reverse: hello", "reverse: abcde"], outcome.stdout
    elif "fsdp-peft generate" in command and "--prompt " in command:  # one prompt: its completion, streamed
        assert ">>> " not in outcome.stdout and re.search(r"\[fsdp-peft\] generating from ", outcome.stderr), output
        # the streamed text is the completion itself: the same source and prompt as one JSON row
        arguments = [*shlex.split(command.partition("#")[0])[1:], "--json"]
        returncode, stdout, stderr = _fsdp_peft_here(arguments, workspace, workspace / "no-hub")
        assert returncode == 0, stderr
        assert outcome.stdout.rstrip("\n") == json.loads(stdout)["completion"], (outcome.stdout, stdout)
    elif "fsdp-peft generate" in command:  # prompts from a file or stdin: each prompt, then its completion
        shown = re.findall(r"(?m)^>>> (.*)$", outcome.stdout)
        assert shown == ["reverse: hello", "reverse: abcde"], output[-3000:]
    elif match := re.search(r"fsdp(?:-peft|_peft\.cli) eval (\S+)", command):
        out = re.search(r"--out (\S+)", command)
        default = Path(match.group(1)) / "eval" / ("base-only" if "--base-only" in command else "")  # in the run
        summary = json.loads((workspace / (out.group(1) if out else default) / "eval.json").read_text())
        assert summary["source"] == match.group(1) and summary["base_only"] == ("--base-only" in command)
        tasks = re.search(r"--tasks (\S+)", command).group(1)
        expected = {"tiny_reverse_em", "tiny_reverse_ll"} if tasks == "tiny_reverse" else set(tasks.split(","))
        assert set(summary["tasks"]) == expected and all(task["samples"] == 200 for task in summary["tasks"].values())
        shown = "tiny_reverse_em" if tasks == "tiny_reverse" else tasks.split(",")[0]
        assert outcome.stdout.count(f"|{shown}|") == 1, output[-3000:]  # the harness's table, printed once
    elif "lm_eval " in command:  # the harness's own command: its table, the task's row once, 200 samples scored
        task = re.search(r"--tasks (\S+)", command).group(1)
        assert outcome.stdout.count(f"|{task}|") == 1 and "|exact_match|" in outcome.stdout, output[-3000:]
    elif match := re.match(r"fsdp-peft export \S+ --out (\S+)", command):
        assert json.loads((workspace / match.group(1) / "config.json").read_text())["model_type"] == "llama"
    elif "bash configs/slurm/recipe.sbatch" in command:
        nodes = re.search(r"(?:NODES|SLURM_JOB_NODELIST)=(\S+)", command).group(1).split(",")
        launchers = re.findall(r"(?m)^node (\d+) (\S+): accelerate launch --machine_rank (\d+) ", outcome.stdout)
        assert launchers == [(str(rank), node, str(rank)) for rank, node in enumerate(nodes)], outcome.stdout
        recipe_args = command.split("recipe.sbatch")[1].strip()
        assert all(line.endswith(recipe_args) for line in outcome.stdout.splitlines()[1:]), outcome.stdout
        if "hsdp_fsdp2.yaml" in command:
            sizes = f"--parallelism_config_dp_replicate_size {len(nodes)} --parallelism_config_dp_shard_size 8"
            assert sizes in outcome.stdout, outcome.stdout
    elif "benchmarks/gpu_check.sh" in command:
        assert "[gpu_check] results: " in output
        root, written = re.search(r"\[gpu_check\] \S+ in (\S+)", output)[1], re.search(r"results: (\S+)", output)[1]
        report = json.loads((Path(root) / written).read_text())
        assert [f"{r['model']} {r['impl']}" for r in report["runs"] if "failed" in r] == [], report["runs"]
        vision = next(r for r in report["runs"] if r["impl"] == "fsdp-peft vlm")
        assert (
            vision["losses_finite"]
            and vision["parameter_gradient_optimizer_bytes"]
            == (vision["planned"]["parameter_gradient_optimizer_bytes"])
        )
        # the SFT pair: fsdp-peft as users launch it (the recipe's auto: nothing checkpointed without a GPU), plain
        # Trainer + peft with every layer checkpointed (the baseline), as memory.json counts the flags in force
        sft = {r["impl"]: r for r in report["runs"] if r["impl"] in ("fsdp-peft", "plain") and r["model"] == "tiny"}
        assert sft["fsdp-peft"]["activation_checkpointing"]["reason"].startswith("auto: no GPU memory"), sft
        assert sft["fsdp-peft"]["checkpointed_layers"] == 0 and sft["plain"]["checkpointed_layers"] == 4, sft
        # the Liger runs (Triton: CUDA only) planned and named as not run, not failed
        liger = [line for line in report["skipped"] if "liger: Liger's Triton kernels need CUDA (planned " in line]
        assert [line.split(":")[0] for line in liger] == ["tiny/qlora/fsdp-peft liger", "tiny/qlora/plain liger"], liger
        assert [r["of"] for r in report["sft_ratios"]] == ["fsdp-peft"], report["sft_ratios"]
        # the GRPO runs' rollouts: the weights a token step reads, the plan's base + adapter (+ 4-bit constants);
        # no bandwidth, so no bound, without a GPU
        grpo = [r for r in report["runs"] if r["impl"].startswith("grpo ")]
        assert len(grpo) == 2 and all(r["rollout_bound_tokens_per_second"] is None for r in grpo), grpo
        for run in grpo:
            weights = [run["planned"]["components"][key] for key in ("base weights (shard)", "adapter weights (shard)")]
            constants = run["planned"]["components"]["quantization constants (whole)"]
            assert run["rollout_weight_bytes_per_token_step"] == sum(weights) + constants > 0, run
        # fsdp-peft generate, compiled and eager: its own timing line, the tiny model's stored bytes less its untied
        # fp32 input embedding (a token step reads a row of it), no bound without a GPU
        generate = {r["impl"]: r for r in report["runs"] if r["impl"].startswith("generate ")}
        assert set(generate) == {"generate --compiled true", "generate --compiled false"}, report["runs"]
        assert [generate[k]["graphs_compiled"] for k in sorted(generate)] == [0, 1], generate
        config = json.loads((tiny_model_path() / "config.json").read_text())
        stored = sum(path.stat().st_size for path in tiny_model_path().glob("*.safetensors"))
        stored -= 0 if config["tie_word_embeddings"] else config["vocab_size"] * config["hidden_size"] * 4
        for run in generate.values():
            assert run["completions"] == run["prompts"] == 4 and run["bound_tokens_per_second"] is None, run
            assert run["weight_bytes_per_token_step"] == stored and run["tokens_per_second"] > 0, run
        assert list(report["generate"]) == ["compiled_over_eager_4_prompts"], report["generate"]
        # the split pair (2 gloo ranks against one process, QLoRA):
        # tests/parallel/test_sequence_parallel.py's QLoRA bound
        assert report["sequence_parallel"]["largest_relative_loss_difference"] <= 1e-4, report["sequence_parallel"]
        split = next(r for r in report["runs"] if r["impl"] == "sp split")
        assert split["parameter_gradient_optimizer_bytes"] == split["planned"]["parameter_gradient_optimizer_bytes"]
    elif "benchmarks/eval_speed.py" in command:
        assert "same figures in every run (perplexity within 1e-5): True" in output
        assert "sharded / one process: median " in output
    elif "benchmarks/activations.py" in command:
        assert "planner within 10% of the saved bytes in all 4 cases: True" in output
    elif "benchmarks/variants.py" in command:
        assert "1 runs: 0 failed or out of bound" in output
    elif "benchmarks/cpu_bf16_products.py" in command:
        assert "49152 x 576   (  1 layers)  96 rows: aten" in output and "native bf16 products on this CPU: " in output
    elif "benchmarks/train_cpu.py" in command:
        assert "per-rank params+grads+optimizer, world size 2 / 1, tiny/lora: 0.500" in output
    for line in (line for text in documented for line in DOCUMENTED_OUTPUT.get(text, [])):
        assert line in [shown.rstrip() for shown in output.splitlines()], f"documented output line missing: {line}"


# Lines the docs show as a command's output that a quick run reproduces exactly.
DOCUMENTED_OUTPUT = {
    QUICK_START: ["[fsdp-peft] FSDP units: 7; sharded parameters: 95/95"],
    "fsdp-peft plan configs/llama_qlora/llama3_1_8b.yaml --gpus 2 --gpu-memory 24GiB "
    "--accelerate-config configs/accelerate/fsdp2.yaml": [
        line.rstrip() for line in documented_output("docs/memory.md", "Here is the output") if "..." not in line
    ],
    "fsdp-peft plan configs/qwen_grpo/qwen2_5_7b_gsm8k_qlora.yaml --accelerate-config configs/accelerate/fsdp2.yaml "
    "--gpus 2 --gpu-memory 24GB": documented_output("docs/memory.md", "prints, among its rows and notes:"),
}


def test_commands_are_read_as_the_shell_reads_them(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\n"
        "fsdp-peft ls   # one line each\n"
        "# a comment line\n"
        "accelerate launch --config_file a.yaml \\\n"
        "    recipes/x.py --prompt 'a # b' \\\n"
        '    --fsdp "full_shard auto_wrap"   # trailing\n'
        "pip install -e . && python -m pytest -q\n"
        "```\n"
        "```\nnot a command\n```\n"
        "```console\n$ fsdp-peft ls\nrecipe  llama_lora  ...\n```\n"
        "```yaml\nkey: value\n```\n"
    )
    assert documented_commands([page]) == {
        "fsdp-peft ls": ["page.md:2", "page.md:13"],
        "accelerate launch --config_file a.yaml recipes/x.py --prompt 'a # b' --fsdp \"full_shard auto_wrap\"": [
            "page.md:4"
        ],
        "pip install -e .": ["page.md:7"],
        "python -m pytest -q": ["page.md:7"],
    }


def test_every_documented_command_is_covered():
    uncovered = [
        f"{', '.join(places)}: {command}" for command, places in DOCUMENTED.items() if coverage(command) is None
    ]
    assert not uncovered, (
        "documented commands that no test runs (make them run here, or add a stand-in to INSTEAD):\n"
        + "\n".join(uncovered)
    )
    stale = [
        command
        for command in [*INSTEAD, *PAGE_FILES, *PRODUCERS.values(), *DOCUMENTED_OUTPUT]
        if command not in DOCUMENTED
    ]
    assert not stale, "mapped here but no longer documented:\n" + "\n".join(stale)


@pytest.mark.parametrize(
    "run", [pytest.param(run, marks=[pytest.mark.slow] if _slow(run) else []) for run in RUNS], ids=_run_id
)
def test_documented_command_runs_and_does_what_it_says(run, workspaces):
    check(workspaces.run(run), RUNS[run])


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page``."""
    headings = re.findall(r"(?m)^#{1,6} (.+)$", re.sub(r"(?ms)^```.*?^```", "", page.read_text()))
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_every_link_between_the_pages_and_into_them_resolves():
    """Relative links in the README and docs/, and ``README.md#...``/``docs/...md#...`` anywhere in the
    code, configs and tests, name a file that exists and a heading it has."""
    links = [
        (page, page.parent, target) for page in PAGES for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    ]
    folders = ("fsdp_peft", "recipes", "configs", "benchmarks", "tests", ".ci")
    for path in (path for folder in folders for path in (REPO / folder).rglob("*") if path.is_file()):
        if path.suffix in {".py", ".yaml", ".sbatch", ".sh", ".md", ""}:
            links += [
                (path, REPO, target) for target in re.findall(r"(?:README|docs/[\w-]+)\.md#[\w-]+", path.read_text())
            ]
    broken = []
    for source, base, target in links:
        if re.match(r"^[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (base / file).resolve() if file else source
        if not resolved.exists() or (anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved)):
            broken.append(f"{_where(source)}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readmes_layout_names_every_module_of_the_package():
    """A newcomer finds every module of ``fsdp_peft/`` and each of its rooms (subpackages) in the README's layout
    table; each room's docstring names its own modules (tests/test_imports.py)."""
    layout = (REPO / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    modules = [p for p in (REPO / "fsdp_peft").glob("*.py") if p.name != "__init__.py"]
    packages = [p for p in (REPO / "fsdp_peft").iterdir() if (p / "__init__.py").is_file()]
    missing = [p.name for p in modules if f"fsdp_peft/{p.name}" not in layout]
    missing += [p.name for p in packages if f"fsdp_peft/{p.name}/" not in layout]
    assert not missing, f"README's layout table does not name: {missing}"


RUN_OUTPUT_NAMES = re.compile(r"(^|/)((outputs|eval_results|merged)/|__tmp__)")  # what runs and tests write


def test_no_tracked_file_lies_where_runs_write():
    """A run's output tracked in git is overwritten by the next run in the checkout (``eval_results/eval.json``
    once was); ``.gitignore`` keeps them out."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    tracked = [path for path in listed.splitlines() if RUN_OUTPUT_NAMES.search(path)]
    assert not tracked, "run outputs tracked in git (git rm --cached them; .gitignore their folder):\n" + "\n".join(
        tracked
    )


def test_every_module_path_the_configs_mention_exists():
    """A config's comment that points at ``fsdp_peft/....py`` sends a reader to a module that is there."""
    mentions = [
        (config, path)
        for config in sorted((REPO / "configs").rglob("*"))
        if config.is_file()
        for path in re.findall(r"\bfsdp_peft/[\w/]+\.py\b", config.read_text())
    ]
    assert mentions, "the configs point at modules; a pattern that finds none checks nothing"
    missing = [f"{config.relative_to(REPO)}: {path}" for config, path in mentions if not (REPO / path).is_file()]
    assert not missing, "configs name modules that do not exist:\n" + "\n".join(missing)
