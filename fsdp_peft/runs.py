"""Run identity and ``output_dir`` ownership: runs never mix and never vanish silently.

Every run records itself in ``output_dir/fsdp_peft_run.json`` (an id, and the config that decides what it
trains) and every checkpoint carries the id. Starting a recipe into an ``output_dir``:

- that holds another run: refused unless ``overwrite_output_dir`` (then that run's checkpoints, adapter and
  merged export are removed first, and the run says so) or a resume of that same run;
- with ``--resume_from_checkpoint auto``: only checkpoints of a run with the same config are resumed;
- while a live run uses it: refused. Every rank of a run holds a shared ``flock`` on
  ``output_dir/.fsdp_peft.lock`` for its whole life, and a new run needs it exclusively. The kernel drops
  the lock of a killed process, so a killed run never leaves it stuck; ranks orphaned by a killed launcher
  are killed with it (Linux ``PR_SET_PDEATHSIG``), so none keeps writing into a directory a new run uses.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import uuid
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch.distributed as dist
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from fsdp_peft.errors import ConfigError
from fsdp_peft.launch import ranks
from fsdp_peft.log import logger

RUN_FILE = "fsdp_peft_run.json"
EVA_INIT_FILE = "eva_init.safetensors"  # init_lora_weights: eva's initial lora_A rows (fsdp_peft.eva)
LOCK_FILE = ".fsdp_peft.lock"
RUN_OUTPUTS = (  # what a run leaves besides its checkpoints
    "adapter",
    "merged",
    "results.json",
    "trainer_state.json",
    "samples.jsonl",
    "eval_samples.jsonl",
    "loss_curve.png",
    "fsdp_layout.json",
    "memory.json",
    EVA_INIT_FILE,
)
NOT_IDENTITY = {  # keys that do not change what a run trains: they may differ when it is resumed
    "output_dir",
    "overwrite_output_dir",
    "resume_from_checkpoint",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "logging_steps",
    "logging_strategy",
    "logging_first_step",
    "report_to",
    "disable_tqdm",
    "log_level",
    "log_level_replica",
    "save_steps",
    "save_strategy",
    "save_total_limit",
    "eval_steps",
    "eval_strategy",
    "dataloader_num_workers",
    "use_cpu",
    "generate_samples",
    "generate_max_new_tokens",
    "generate_batch_size",
    "generate_gather_budget",
    "generate_eval_samples",
    "export_merged",
    "export_dtype",
    "run_name",
    "include_num_input_tokens_seen",
}
_held_locks: list = []  # open lock files: the flock lives as long as they stay open


@dataclass(frozen=True)
class Run:
    """This run's identity: its id and the config it trains with."""

    run_id: str
    config: dict

    @property
    def fingerprint(self) -> str:
        return config_fingerprint(self.config)


def _plain(value):
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def identity_config(recipe: dict, training: dict) -> dict:
    """The config keys that decide what a run trains (model, data, adapter, optimizer, FSDP), JSON-ready."""
    merged = {**training, **recipe}
    return {key: _plain(merged[key]) for key in sorted(merged) if key not in NOT_IDENTITY}


def config_fingerprint(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def read_run(output_dir: Path) -> dict | None:
    path = Path(output_dir) / RUN_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def checkpoints_in(output_dir: Path) -> list[Path]:
    """Complete and interrupted checkpoints (``checkpoint-N``, ``.checkpoint-N.partial``) in ``output_dir``."""
    directory = Path(output_dir)
    if not directory.is_dir():
        return []
    found = list(directory.glob(f"{PREFIX_CHECKPOINT_DIR}-*")) + list(
        directory.glob(f".{PREFIX_CHECKPOINT_DIR}-*.partial")
    )
    return sorted(path for path in found if path.is_dir())


def _run_outputs(output_dir: Path) -> list[Path]:
    return checkpoints_in(output_dir) + [
        Path(output_dir) / name for name in RUN_OUTPUTS if (Path(output_dir) / name).exists()
    ]


def _differing_keys(saved: dict, current: dict) -> list[str]:
    return sorted(key for key in set(saved) | set(current) if saved.get(key) != current.get(key))


def _describe(record: dict | None, output_dir: Path) -> str:
    checkpoints = [p.name for p in checkpoints_in(output_dir) if not p.name.startswith(".")]
    started = f" started {record['started']}" if record and record.get("started") else ""
    who = f"run {record['run_id']}{started}" if record else "a run fsdp-peft did not record"
    finished = ", adapter/ saved" if (Path(output_dir) / "adapter").is_dir() else ""
    return f"{who} ({len(checkpoints)} checkpoints{finished})"


def _lock_holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "pid unknown"
    except OSError:
        return "pid unknown"


def _take_exclusive_lock(output_dir: Path):
    """Open and exclusively lock ``output_dir/.fsdp_peft.lock`` (non-blocking); refuse while another run holds it."""
    path = Path(output_dir) / LOCK_FILE
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ConfigError(
            f"output_dir: {output_dir} is in use by a live run ({_lock_holder(path)}); wait for it to end or stop "
            "it, or choose another output_dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return handle


def _decide(output_dir: Path, current: dict, resume: str | None, overwrite: bool) -> tuple[str, list[Path], str | None]:
    """``(run id, outputs to remove, message)`` for a start into ``output_dir``; raises `ConfigError` to refuse."""
    record = read_run(output_dir)
    outputs = _run_outputs(output_dir)
    occupied = record is not None or bool(outputs)
    if resume is not None and str(resume).lower() not in ("auto", "true"):  # an explicit checkpoint
        return (record or {}).get("run_id") or uuid.uuid4().hex[:12], [], None
    if resume is not None:  # auto
        if record is None and outputs:
            raise ConfigError(
                f"resume_from_checkpoint: auto: {output_dir} holds {_describe(record, output_dir)}, so which run and "
                "config it belongs to is unknown; name the checkpoint (--resume_from_checkpoint DIR) to resume it, "
                "or set overwrite_output_dir: true to start afresh"
            )
        if record is not None and record["config"] != current:
            keys = _differing_keys(record["config"], current)
            raise ConfigError(
                f"resume_from_checkpoint: auto: {output_dir} holds {_describe(record, output_dir)} "
                "trained with another "
                f"config (differs in {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}); resume with that config, "
                "set overwrite_output_dir: true to replace it, or choose another output_dir"
            )
        return (record or {}).get("run_id") or uuid.uuid4().hex[:12], [], None
    if not occupied:
        return uuid.uuid4().hex[:12], [], None
    if not overwrite:
        raise ConfigError(
            f"output_dir: {output_dir} holds {_describe(record, output_dir)}; resume it with --resume_from_checkpoint "
            "auto, replace it with --overwrite_output_dir true (its checkpoints are removed), "
            "or choose another output_dir"
        )
    names = ", ".join(p.name for p in outputs) or "its run record"
    return (
        uuid.uuid4().hex[:12],
        outputs,
        f"overwrite_output_dir: removing the previous run's {names} from {output_dir}",
    )


def start_run(recipe: dict, training, resume: str | None) -> Run:
    """Claim ``training.output_dir`` for this run on every rank (collective once a process group exists).

    Rank 0 takes the directory's lock exclusively, decides (refusing, or removing a replaced run's outputs),
    and records the run; then every rank holds the lock shared until it exits.
    """
    output_dir = Path(training.output_dir)
    current = identity_config(
        recipe, {f.name: getattr(training, f.name) for f in dataclasses.fields(training) if f.init}
    )
    distributed = dist.is_available() and dist.is_initialized()
    decision: list = [None]
    if ranks().is_main:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            handle = _take_exclusive_lock(output_dir)
            run_id, remove, message = _decide(output_dir, current, resume, bool(recipe.get("overwrite_output_dir")))
            if message:
                logger.info(message)
            for path in remove:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            _write_run(output_dir, run_id, current, resume)
            fcntl.flock(handle, fcntl.LOCK_SH)  # others may join; a new run (exclusive) may not
            _held_locks.append(handle)
            decision[0] = ("ok", run_id)
        except ConfigError as error:
            decision[0] = ("refused", str(error))
    if distributed:
        dist.broadcast_object_list(decision, src=0)
    outcome, value = decision[0]
    if outcome == "refused":
        raise ConfigError(value)
    if not ranks().is_main:
        handle = open(output_dir / LOCK_FILE, "a+")
        fcntl.flock(handle, fcntl.LOCK_SH)
        _held_locks.append(handle)
    return Run(value, current)


def _write_run(output_dir: Path, run_id: str, config: dict, resume: str | None) -> None:
    record = read_run(output_dir)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if record is None or record.get("run_id") != run_id:
        record = {
            "run_id": run_id,
            "started": now,
            "config": config,
            "fingerprint": config_fingerprint(config),
            "legs": [],
        }
    record["legs"].append({"started": now, "resumed_from": resume})
    staged = output_dir / f".{RUN_FILE}.tmp"
    staged.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(staged, output_dir / RUN_FILE)


def release_output_dir() -> None:
    """Drop this process's hold on its ``output_dir`` (also dropped by the kernel when it exits)."""
    while _held_locks:
        _held_locks.pop().close()


PR_SET_PDEATHSIG = 1


def die_with_the_launcher() -> bool:
    """Have the kernel kill this rank if its launcher dies (Linux); returns whether it was arranged.

    A launcher killed with SIGKILL cannot stop its ranks; without this they would live on, blocked in a
    collective or still writing checkpoints into the run's ``output_dir``.
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    launcher = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != launcher:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True
