"""Ranks forked from one process that has already imported the stack: the launches of the suite without their imports.

A tiny 2-rank launch spends about 10 of its 18 CPU-seconds importing torch, transformers, peft and fsdp-peft, three
times over (the launcher and each rank). Run as a script, this file imports them once (`conftest.run_launch` starts
one such process per test process, through `run`), then reads one launch per line on stdin and forks its ranks:
each rank sets the environment the launcher would have given it, takes the launch's stdout and stderr files, prints
what the imports printed, and runs the script as ``__main__``, as ``python script.py ...`` would, over a real gloo
process group (rank 0 hosts the store, as it does under torchrun without an agent). It answers each launch with its
exit status on one line of stdout.

The parent never runs a tensor operation or opens a process group before forking (as a DataLoader forks its
workers), and what a rank does is the script's own. Only what a launcher adds around the ranks is not here (its log
lines, restarts, the failure summary): a warm run that fails runs again cold (`conftest.run_launch`), and tests that
look at a launcher's own output launch for real (`conftest.run_command`).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import random
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What the recipes, the checks in tests/distributed/ and the CLI import, at import or on first use; fsdp_peft first,
# as every recipe imports it first (its import hook defers bitsandbytes' compiled kernels to their first use).
PRELOAD = (
    "fsdp_peft",
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "peft",
    "accelerate",
    "datasets",
    "bitsandbytes",
    "safetensors.torch",
    "matplotlib.pyplot",
    "fsdp_peft.recipe",
    "fsdp_peft.cli",
)
# ``fsdp-peft``: the console script pip writes, as it runs.
CONSOLE_SCRIPT = Path(sys.executable).parent / "fsdp-peft"

# How a rank ends when its launch is taken down: torchrun's agent sends SIGTERM, then SIGKILL after a grace period.
GRACE_S = 10.0


def preload() -> tuple[bytes, bytes]:
    """Import `PRELOAD`; what the imports print (bitsandbytes' note on its CPU kernels, a library's warning) comes
    back as (stdout, stderr) bytes, for each rank to print where a cold process would."""
    import importlib

    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            import matplotlib

            matplotlib.use("Agg")
            for name in PRELOAD:
                importlib.import_module(name)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
        out.seek(0)
        err.seek(0)
        printed = out.read(), err.read()
    gc.collect()
    gc.freeze()  # the imported objects are never collected: a rank's collections leave their pages shared
    return printed


def run_rank(launch: dict, rank_env: dict, printed: tuple[bytes, bytes]) -> None:
    """In the forked rank: become ``python script args``, ``python -m module args`` or the ``fsdp-peft`` console
    script with ``rank_env``, having printed what the imports printed. Like torchrun's workers, each rank leads a
    session of its own (its launch takes down what it started) and dies with the process that forked it."""
    os.setsid()
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    out = os.open(launch["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    err = os.open(launch["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.write(1, printed[0])
    os.write(2, printed[1])
    os.environ.clear()
    os.environ.update(rank_env)
    os.chdir(launch["cwd"])
    # A fresh process seeds these from the OS; forked ones would share the parent's state. (The hash seed of str and
    # bytes is the parent's in every rank: set orders agree across a warm launch's ranks, as they need not cold.)
    random.seed()
    import datasets.fingerprint
    import numpy

    numpy.random.seed()
    datasets.fingerprint.fingerprint_rng.seed()
    kind, name = launch["target"][0], launch["target"][-1]
    if kind == "console":  # pip's console script: ``sys.exit(main())`` of the module, imported as a module
        from fsdp_peft.cli import main as console_main

        sys.argv = [str(CONSOLE_SCRIPT), *launch["arguments"]]
        sys.path[0] = str(CONSOLE_SCRIPT.parent)
        sys.exit(console_main())
    if kind == "-m":  # run afresh as ``__main__``, as ``python -m`` does (imported here, it would be run twice)
        sys.modules.pop(name, None)
        sys.argv = [name, *launch["arguments"]]
        sys.path[0] = launch["cwd"]
        runpy.run_module(name, run_name="__main__", alter_sys=True)
        return
    sys.argv = [name, *launch["arguments"]]
    sys.path[0] = os.path.dirname(os.path.abspath(name))
    runpy.run_path(name, run_name="__main__")


def rank_environments(launch: dict) -> list[dict]:
    """What torchrun's agent gives each of its workers, without the agent's store."""
    ranks = launch["ranks"]
    if ranks == 0:  # one plain process, no launcher
        return [dict(launch["env"])]
    shared = {
        "GROUP_RANK": "0",
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(ranks),
        "WORLD_SIZE": str(ranks),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(ranks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(launch["port"]),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False",  # no agent: rank 0 hosts the store
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    return [
        {**launch["env"], **shared, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(ranks)
    ]


def serve_one(launch: dict, printed: tuple[bytes, bytes]) -> int:
    """Fork the launch's ranks, wait for them as torchrun does (one failing takes the others down), return its status:
    0, the first failing rank's, or 124 past the deadline."""
    sys.stdout.flush()
    sys.stderr.flush()
    children = []
    for env in rank_environments(launch):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            code = 1
            try:
                run_rank(launch, env, printed)
                code = 0
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
                if exit_.code is not None and not isinstance(exit_.code, int):
                    print(exit_.code, file=sys.stderr)
            except BaseException:
                sys.excepthook(*sys.exc_info())
            # As the interpreter ends a script: atexit handlers, then buffered output out.
            sys.exit(code)
        children.append(pid)
    deadline, status, stopping = time.monotonic() + launch["timeout"], 0, None
    running = set(children)

    def signal_all(signum: int) -> None:
        for child in running:
            try:
                os.killpg(child, signum)  # the rank and what it started
            except ProcessLookupError:
                pass

    while running:
        ended = [(pid, wait) for pid, wait in (os.waitpid(child, os.WNOHANG) for child in list(running)) if pid]
        if not ended:
            now = time.monotonic()
            if now > deadline and status == 0:
                status, stopping = 124, now
                signal_all(signal.SIGKILL)
            elif stopping is not None and now - stopping > GRACE_S:
                signal_all(signal.SIGKILL)
            time.sleep(0.05)
            continue
        for pid, wait_status in ended:
            running.discard(pid)
            code = os.waitstatus_to_exitcode(wait_status)
            if code != 0 and status == 0:
                status = code if code > 0 else 128 - code
                stopping = time.monotonic()
                signal_all(signal.SIGTERM)
    return status


def main() -> None:
    printed = preload()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        launch = json.loads(line)
        status = serve_one(launch, printed)
        print(json.dumps({"id": launch["id"], "status": status}), flush=True)


# --- The test process's side -------------------------------------------------------------------------------------

# Read when a rank runs, not when the stack is imported: they may differ between the warm process and a launch.
# Any other difference of the environment starts a new warm process (the imports may have read it).
READ_AT_RUN_TIME = {"PYTEST_CURRENT_TEST", "FSDP_PEFT_CACHE"}


def launch_of(command: list[str]) -> dict | None:
    """What ``command`` launches: its target (``[script]`` or ``["-m", module]``), arguments, ranks (0: one plain
    process), port, and the variables its launcher adds; None for a command this file does not serve."""
    if command and command[0] in ("fsdp-peft", str(CONSOLE_SCRIPT)):  # the console script
        return {"target": ["console"], "arguments": command[1:], "ranks": 0, "port": 0, "adds": {}}
    if not command or command[0] != sys.executable:
        return None
    if command[1:3] == ["-m", "accelerate.commands.launch"]:
        return _accelerate_launch(command[3:])
    if command[1:3] == ["-m", "torch.distributed.run"]:
        return _torchrun(command[3:])
    if command[1:3] == ["-m", "fsdp_peft.cli"]:
        return {"target": command[1:3], "arguments": command[3:], "ranks": 0, "port": 0, "adds": {}}
    if len(command) > 1 and command[1].endswith(".py"):
        return {"target": [command[1]], "arguments": command[2:], "ranks": 0, "port": 0, "adds": {}}
    return None


def _accelerate_launch(arguments: list[str]) -> dict | None:
    """``accelerate launch``'s own parsing and environment (``prepare_multi_gpu_env``): the launcher the configs in
    configs/accelerate/ take on one machine (FSDP, not ``--cpu``), then torchrun's."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(arguments))
    if args.cpu or not (args.use_fsdp or args.multi_gpu) or args.num_machines != 1 or args.no_python:
        return None
    launched = prepare_multi_gpu_env(args)
    adds = {key: value for key, value in launched.items() if os.environ.get(key) != value}
    target = ["-m", args.training_script] if args.module else [args.training_script]
    ranks, port = int(args.nproc_per_node), int(args.main_process_port)
    return {"target": target, "arguments": args.training_script_args, "ranks": ranks, "port": port, "adds": adds}


def _torchrun(arguments: list[str]) -> dict | None:
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(arguments)
    if args.nnodes not in ("1", "1:1") or args.no_python or args.standalone or not args.master_port:
        return None
    target = ["-m", args.training_script] if args.module else [args.training_script]
    ranks, port = int(args.nproc_per_node), int(args.master_port)
    return {"target": target, "arguments": args.training_script_args, "ranks": ranks, "port": port, "adds": {}}


class NotStarted(RuntimeError):
    """The warm process could not start."""


class _Warm:
    """The warm process of this test process, started on first use and again where the environment changed."""

    process: subprocess.Popen | None = None
    env: dict[str, str] = {}
    launches = 0

    @classmethod
    def ready(cls, env: dict[str, str], cwd: Path) -> subprocess.Popen:
        def differs(a: dict, b: dict) -> set:
            return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} - READ_AT_RUN_TIME

        if cls.process is not None and (cls.process.poll() is not None or differs(env, cls.env)):
            cls.stop()
        if cls.process is None:
            cls.process = subprocess.Popen(
                [sys.executable, __file__],
                cwd=cwd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            cls.env = dict(env)
            line = cls.process.stdout.readline()
            if not line.startswith('{"ready"'):
                cls.stop()
                raise NotStarted(f"the warm process did not start: {line!r}")
            atexit.register(cls.stop)
        return cls.process

    @classmethod
    def stop(cls) -> None:
        if cls.process is not None:
            cls.process.kill()
            cls.process.wait()
            cls.process = None


def run(launch: dict, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run ``launch`` on the warm process as `subprocess.run` would, its output captured as text. `NotStarted`: the
    warm process could not start (nothing of the launch ran)."""
    import select

    process = _Warm.ready(env, cwd)
    _Warm.launches += 1
    with tempfile.TemporaryDirectory(prefix="warm_ranks_") as directory:
        stdout, stderr = Path(directory) / "stdout", Path(directory) / "stderr"
        request = {**launch, "id": _Warm.launches, "env": {**env, **launch["adds"]}, "cwd": str(cwd)}
        request |= {"timeout": timeout, "stdout": str(stdout), "stderr": str(stderr)}
        try:
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
            # The warm process enforces the deadline itself; past it and the grace period, it is stuck.
            if not select.select([process.stdout], [], [], timeout + GRACE_S + 60)[0]:
                raise RuntimeError(f"the warm process did not answer within {timeout + GRACE_S + 60:.0f} s")
            answer = process.stdout.readline()
            if not answer:
                raise RuntimeError("the warm process ended during a launch")
            answer = json.loads(answer)
            assert answer["id"] == request["id"], (answer, request["id"])
        except BaseException:
            _Warm.stop()  # its state is unknown: the next launch starts a new one
            raise
        command = [sys.executable, *launch["target"], *launch["arguments"]]
        out = stdout.read_text() if stdout.exists() else ""
        err = stderr.read_text() if stderr.exists() else ""
    if answer["status"] == 124:
        raise subprocess.TimeoutExpired(command, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(command, answer["status"], out, err)


if __name__ == "__main__":
    main()
