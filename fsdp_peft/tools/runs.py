"""Run identity and ``output_dir`` ownership: runs never mix, never vanish silently, and a failed start owns nothing.

Every run records itself in ``output_dir/fsdp_peft_run.json`` (an id, and the config that decides what it
trains) and every checkpoint carries the id. Starting a recipe into an ``output_dir``:

- that holds another run: refused unless ``overwrite_output_dir`` (then that run's checkpoints, adapter and
  merged export are removed once the new run takes its first optimizer step, and the run says so) or a resume
  of that same run;
- with ``--resume_from_checkpoint auto``: only checkpoints of a run with the same config are resumed;
- while a live run uses it: refused. Every rank of a run holds a shared ``flock`` on
  ``output_dir/.fsdp_peft.lock`` for its whole life, and a new run needs it exclusively. The kernel drops
  the lock of a killed process, so a killed run never leaves it stuck; ranks orphaned by a killed launcher
  are killed with it (Linux ``PR_SET_PDEATHSIG``), so none keeps writing into a directory a new run uses.

A start owns nothing until its first optimizer step. Claiming ``output_dir`` (`start_run`) journals what it
found (``.fsdp_peft_start.json``: the names the directory held, the directories and lock file the claim
created) and moves what the run replaces (an overwritten run's outputs, a resumed run's half-written
checkpoints) into ``.fsdp_peft_replaced/``. At the first optimizer step (`RunBegins`) the run is recorded,
the journal deleted and what was set aside removed. A start that ends before (a bad data row, an unreadable
model, an exception, SIGTERM from the launcher) is undone by rank 0 on its way out: what appeared is removed,
what was set aside is put back, a directory or lock file the claim created is removed. A start killed
outright (SIGKILL, the OOM killer) leaves its journal, and the next start into that ``output_dir`` undoes it
first.
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
import threading
import uuid
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from fsdp_peft.core.distributed import ranks
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import counted, logger
from fsdp_peft.core.run_file_names import EVAL_SAMPLES_FILE, HARNESS_DIR, LOSS_CURVE_FILE, RESULTS_FILE, SAMPLES_FILE

RUN_FILE = "fsdp_peft_run.json"
EVA_INIT_FILE = "eva_init.safetensors"  # init_lora_weights: eva's initial lora_A rows (fsdp_peft.procedures.eva)
LOCK_FILE = ".fsdp_peft.lock"
START_FILE = ".fsdp_peft_start.json"  # the journal of a start that has not taken its first step yet
SET_ASIDE_DIR = ".fsdp_peft_replaced"  # what a start replaces, until its first step
PREFERENCE_DATA_DIR = (
    ".preference_data"  # fsdp_peft.procedures.preference: the data TRL reads, written anew by every start
)
RUN_OUTPUTS = (  # what a run leaves besides its checkpoints
    "adapter",
    "merged",
    RESULTS_FILE,
    "trainer_state.json",
    SAMPLES_FILE,
    EVAL_SAMPLES_FILE,
    HARNESS_DIR,
    LOSS_CURVE_FILE,
    "fsdp_layout.json",
    "memory.json",
    "held_out_before.jsonl",
    "held_out_after.jsonl",
    PREFERENCE_DATA_DIR,
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
    "generate_merged_adapter",
    "generate_compiled",
    "generate_eval_samples",
    "max_eval_samples",
    "eval_tasks",
    "eval_tasks_steps",
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
    return f"{who} ({counted(len(checkpoints), 'checkpoint')}{finished})"


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


def _decide(
    output_dir: Path, current: dict, resume: str | None, overwrite: bool
) -> tuple[str, list[Path], tuple[str, ...]]:
    """``(run id, what the run replaces, what to say when it is removed)`` for a start into ``output_dir``;
    raises `ConfigError` to refuse."""
    record = read_run(output_dir)
    outputs = _run_outputs(output_dir)
    occupied = record is not None or bool(outputs)
    if resume is not None and str(resume).lower() not in ("auto", "true"):  # an explicit checkpoint
        return ((record or {}).get("run_id") or uuid.uuid4().hex[:12], *_redone_by_a_new_leg(output_dir))
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
        return ((record or {}).get("run_id") or uuid.uuid4().hex[:12], *_redone_by_a_new_leg(output_dir))
    if not occupied:
        return uuid.uuid4().hex[:12], [], ()
    if not overwrite:
        raise ConfigError(
            f"output_dir: {output_dir} holds {_describe(record, output_dir)}; resume it with --resume_from_checkpoint "
            "auto, replace it with --overwrite_output_dir true (its checkpoints are removed), "
            "or choose another output_dir"
        )
    names = ", ".join(p.name for p in outputs) or "its run record"
    return (
        uuid.uuid4().hex[:12],
        outputs + ([output_dir / RUN_FILE] if record is not None else []),
        (f"overwrite_output_dir: removing the previous run's {names} from {output_dir}",),
    )


def _redone_by_a_new_leg(output_dir: Path) -> tuple[list[Path], tuple[str, ...]]:
    """What a resumed run's new leg replaces: checkpoints a crash left half-written, and the preference data
    (every start writes its own)."""
    partial = [path for path in checkpoints_in(output_dir) if path.name.startswith(".")]
    notes = tuple(f"removing {path}: an incomplete checkpoint left by an interrupted save" for path in partial)
    data = [output_dir / PREFERENCE_DATA_DIR] if (output_dir / PREFERENCE_DATA_DIR).exists() else []
    return partial + data, notes


@dataclass(frozen=True)
class Start:
    """What claiming ``output_dir`` changed; journaled in ``START_FILE`` until the run's first optimizer step."""

    found: tuple[str, ...]  # the names output_dir held when claimed: an undo removes none of them
    set_aside: tuple[str, ...]  # what the run replaces, moved into SET_ASIDE_DIR until its first step
    created: tuple[str, ...]  # directories the claim created (absolute), outermost first
    lock_text: str | None  # the lock file's earlier holder line; None when the claim created the file
    notes: tuple[str, ...] = ()  # said when what was set aside is removed

    @classmethod
    def read(cls, output_dir: Path) -> Start | None:
        path = output_dir / START_FILE
        if not path.is_file():
            return None
        values = json.loads(path.read_text())
        return cls(**{key: tuple(value) if isinstance(value, list) else value for key, value in values.items()})

    def write(self, output_dir: Path) -> None:
        _write_atomically(output_dir / START_FILE, json.dumps(dataclasses.asdict(self), indent=1))


@dataclass
class _Claim:
    """Rank 0's claim on ``output_dir`` while its start is not final: undone if the process ends first."""

    output_dir: Path
    run: Run
    resume: str | None
    start: Start
    sigterm: object  # the SIGTERM handler the claim replaced (None: not replaced, off the main thread)


_claims: list[_Claim] = []  # rank 0: starts that have not taken their first step


def _missing_directories(path: Path) -> tuple[str, ...]:
    """``path`` and each of its missing parents, outermost first: what ``mkdir(parents=True)`` creates."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(str(path))
        path = path.parent
    return tuple(reversed(missing))


def _names(output_dir: Path) -> tuple[str, ...]:
    return tuple(sorted(entry.name for entry in output_dir.iterdir() if entry.name != START_FILE))


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def _written_by_a_run(name: str) -> bool:
    """Whether a run writes ``name`` into its ``output_dir``: the only names an undo removes from a directory it
    did not create."""
    return name in RUN_OUTPUTS or name.startswith(
        (RUN_FILE, f".{RUN_FILE}", f"{PREFIX_CHECKPOINT_DIR}-", f".{PREFIX_CHECKPOINT_DIR}-")
    )


def _restore(output_dir: Path, start: Start) -> None:
    """Put ``output_dir``'s content back as ``start`` found it: remove what a run wrote since, move back what was
    set aside, then drop the journal."""
    for entry in sorted(output_dir.iterdir()):
        if entry.name not in start.found and _written_by_a_run(entry.name):
            _remove(entry)
    aside = output_dir / SET_ASIDE_DIR
    for name in start.set_aside:
        if (aside / name).exists() or (aside / name).is_symlink():
            if (output_dir / name).exists() or (output_dir / name).is_symlink():
                _remove(output_dir / name)  # written by the start over the name of what it replaced
            os.rename(aside / name, output_dir / name)
    if aside.exists():
        shutil.rmtree(aside)
    (output_dir / START_FILE).unlink(missing_ok=True)


def _release(output_dir: Path, start: Start) -> None:
    """Undo the claim itself: a directory it created goes whole, else its lock file goes (or gets its holder line
    back); then the parents it created, while empty."""
    if str(output_dir.absolute()) in start.created:
        shutil.rmtree(output_dir)
    elif start.lock_text is None:
        (output_dir / LOCK_FILE).unlink(missing_ok=True)
    else:
        (output_dir / LOCK_FILE).write_text(start.lock_text)
    for directory in reversed(start.created):
        try:
            os.rmdir(directory)
        except FileNotFoundError:
            continue
        except OSError:  # not empty: something else was put there; it stays
            return


def _claim(output_dir: Path, current: dict, resume: str | None, overwrite: bool) -> _Claim:
    """Rank 0's claim: lock, undo a start killed before its first step, decide, journal, set aside."""
    created = _missing_directories(output_dir.absolute())
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(
            f"output_dir: cannot create {output_dir} ({error.strerror}); choose a directory you can write to"
        ) from None
    lock = output_dir / LOCK_FILE
    lock_text = lock.read_text() if lock.is_file() else None
    handle = _take_exclusive_lock(output_dir)  # refused while a live run holds it: its directory is left alone
    start = Start(found=(), set_aside=(), created=created, lock_text=lock_text)
    try:
        if (interrupted := Start.read(output_dir)) is not None:
            logger.info(f"{output_dir}: undoing a start that was killed before its first step")
            _restore(output_dir, interrupted)
            start = dataclasses.replace(start, created=interrupted.created, lock_text=interrupted.lock_text)
        elif (output_dir / SET_ASIDE_DIR).exists():  # a start killed while removing what it had replaced
            shutil.rmtree(output_dir / SET_ASIDE_DIR)
        run_id, replaced, notes = _decide(output_dir, current, resume, overwrite)
        names = tuple(path.name for path in replaced)
        start = dataclasses.replace(start, found=_names(output_dir), set_aside=names, notes=notes)
        start.write(output_dir)
        if names:
            (output_dir / SET_ASIDE_DIR).mkdir()
            for name in names:
                os.rename(output_dir / name, output_dir / SET_ASIDE_DIR / name)
    except BaseException:
        if Start.read(output_dir) == start:
            _restore(output_dir, start)
        _release(output_dir, start)
        handle.close()
        raise
    fcntl.flock(handle, fcntl.LOCK_SH)  # others may join; a new run (exclusive) may not
    _held_locks.append(handle)
    return _Claim(output_dir, Run(run_id, current), resume, start, _end_the_start_on_sigterm())


def _end_the_start_on_sigterm():
    """SIGTERM (a launcher stopping the ranks after another one failed) raises `SystemExit` until the first
    step, so that the start is undone on the way out; returns the handler it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def end(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, end)


def start_run(recipe: dict, training, resume: str | None) -> Run:
    """Claim ``training.output_dir`` for this run on every rank (collective once a process group exists).

    Rank 0 takes the directory's lock exclusively, decides (refusing, or setting aside what the run replaces)
    and journals the claim; then every rank holds the lock shared until it exits. The run is recorded at its
    first optimizer step (`begin_run`); a start that ends before is undone (`release_output_dir`).
    """
    output_dir = Path(training.output_dir)
    current = identity_config(
        recipe, {f.name: getattr(training, f.name) for f in dataclasses.fields(training) if f.init}
    )
    distributed = dist.is_available() and dist.is_initialized()
    decision: list = [None]
    if ranks().is_main:
        try:
            claim = _claim(output_dir, current, resume, bool(recipe.get("overwrite_output_dir")))
            _claims.append(claim)
            decision[0] = ("ok", claim.run.run_id)
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
    if distributed:
        dist.barrier()  # every rank holds the lock before any can fail and rank 0 undo the claim
    return Run(value, current)


def begin_run(run: Run) -> None:
    """The run's first optimizer step: record the run, end the journal (the start is final), then remove what
    the run replaced. Every rank calls it; only rank 0, which claimed ``output_dir``, has anything to do."""
    for claim in [claim for claim in _claims if claim.run.run_id == run.run_id]:
        _write_run(claim.output_dir, run.run_id, run.config, claim.resume)
        (claim.output_dir / START_FILE).unlink()
        _claims.remove(claim)  # final: no longer undone on the way out
        for note in claim.start.notes:
            logger.info(note)
        if (claim.output_dir / SET_ASIDE_DIR).exists():
            shutil.rmtree(claim.output_dir / SET_ASIDE_DIR)
        if claim.sigterm is not None:
            signal.signal(signal.SIGTERM, claim.sigterm)


class RunBegins(TrainerCallback):
    """`begin_run` at the first optimizer step, or at the end of a training that had no step left to take."""

    def __init__(self, run: Run):
        self.run = run

    def on_optimizer_step(self, args, state, control, **kwargs):
        begin_run(self.run)

    def on_train_end(self, args, state, control, **kwargs):
        begin_run(self.run)


def _write_atomically(path: Path, text: str) -> None:
    staged = path.with_name(f".{path.name.lstrip('.')}.tmp")
    staged.write_text(text)
    os.replace(staged, path)


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
    _write_atomically(output_dir / RUN_FILE, json.dumps(record, indent=1, sort_keys=True))


def release_output_dir() -> None:
    """Drop this process's hold on its ``output_dir`` (also dropped by the kernel when it exits); a start that
    has not taken its first step is undone first (rank 0)."""
    while _claims:
        claim = _claims.pop()
        if claim.sigterm is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # already on the way out: let the undo finish
        try:
            _restore(claim.output_dir, claim.start)
            _release(claim.output_dir, claim.start)
        except OSError as error:
            logger.warning(
                f"output_dir: could not undo the start in {claim.output_dir} ({error}); the next start there will"
            )
        finally:
            if claim.sigterm is not None:
                signal.signal(signal.SIGTERM, claim.sigterm)
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
