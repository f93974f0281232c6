"""Runs never mix and never vanish silently: one run per output_dir, resumed only by itself, locked while live;
a start that fails before its first optimizer step leaves output_dir as it found it.

Each bad case is refused with one ``error:`` line and exit code 2, and the existing run's files are byte for
byte unchanged (checksums before and after); each good case still trains. The claim and its undo are also
checked in this process (no launch), as a recipe's rank 0 makes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from transformers import TrainingArguments

from conftest import REPO, launch_recipe, read_json, recipe_launch_command, run_command
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.model import tiny
from fsdp_peft.tools.runs import LOCK_FILE, RUN_FILE, Run, begin_run, release_output_dir, start_run

QUICK = [
    "--max_steps",
    "4",
    "--save_strategy",
    "steps",
    "--save_steps",
    "2",
    "--logging_steps",
    "1",
    "--generate_samples",
    "0",
    "--generate_eval_samples",
    "0",
    "--per_device_train_batch_size",
    "4",
    "--lr_scheduler_type",
    "constant",
    "--warmup_steps",
    "0",
]


def launch_command(*overrides: str) -> list[str]:
    return recipe_launch_command("llama_lora", *overrides)


def checksums(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory`` (the lock file's holder line excluded)."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != ".fsdp_peft.lock"
    }


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    ours = result.stderr.partition("Traceback (most recent call last)")[0]
    return [line for line in ours.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 (never modified by the tests: they copy it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    launch_recipe("llama_lora", "--output_dir", str(out), *QUICK)
    return out


def copy_of(finished: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(finished, target)
    return target


@pytest.mark.slow
def test_a_run_records_its_identity_in_its_outputs_and_checkpoints(finished):
    record = read_json(finished / "fsdp_peft_run.json")
    assert len(record["run_id"]) == 12 and record["config"]["learning_rate"] == pytest.approx(1e-3)
    for checkpoint in ("checkpoint-2", "checkpoint-4"):
        assert read_json(finished / checkpoint / "fsdp_peft_layout.json")["run_id"] == record["run_id"]


@pytest.mark.slow
def test_starting_into_a_finished_run_is_refused_and_changes_nothing(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    before = checksums(out)
    result = run_command(launch_command("--output_dir", str(out), *QUICK))
    assert result.returncode != 0
    run_id = read_json(out / "fsdp_peft_run.json")["run_id"]
    assert error_lines(result) == [
        f"error: output_dir: {out} holds run {run_id} started {read_json(out / 'fsdp_peft_run.json')['started']} "
        "(2 checkpoints, adapter/ saved); resume it with --resume_from_checkpoint auto, replace it with "
        "--overwrite_output_dir true (its checkpoints are removed), or choose another output_dir"
    ]
    assert checksums(out) == before


@pytest.mark.slow
def test_overwrite_output_dir_removes_the_old_run_and_says_so(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    old_id = read_json(out / "fsdp_peft_run.json")["run_id"]
    (out / "checkpoint-4" / "marker").write_text("old run")
    result = launch_recipe(
        "llama_lora",
        "--output_dir",
        str(out),
        *QUICK[:2],
        "--save_strategy",
        "no",
        "--overwrite_output_dir",
        "true",
        *QUICK[6:],
    )
    assert "overwrite_output_dir: removing the previous run's checkpoint-2, checkpoint-4, adapter" in result.stdout
    assert not (out / "checkpoint-2").exists() and not (out / "checkpoint-4").exists()
    record = read_json(out / "fsdp_peft_run.json")
    assert record["run_id"] != old_id and (out / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_auto_resume_refuses_a_run_with_another_config_and_resumes_the_same_one(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    shutil.rmtree(out / "checkpoint-4")  # the run "died" after its step-2 checkpoint
    before = checksums(out)
    changed = [*QUICK, "--learning_rate", "5e-4", "--resume_from_checkpoint", "auto", "--output_dir", str(out)]
    result = run_command(launch_command(*changed))
    assert result.returncode != 0
    [line] = error_lines(result)
    assert line.startswith(f"error: resume_from_checkpoint: auto: {out} holds run ")
    assert "trained with another config (differs in learning_rate); resume with that config" in line
    assert checksums(out) == before

    same = launch_recipe("llama_lora", *QUICK, "--resume_from_checkpoint", "auto", "--output_dir", str(out))
    assert f"resuming from {out / 'checkpoint-2'}" in same.stdout
    record = read_json(out / "fsdp_peft_run.json")
    assert record["run_id"] == read_json(finished / "fsdp_peft_run.json")["run_id"] and len(record["legs"]) == 2


@pytest.mark.slow
def test_resuming_a_run_already_at_max_steps_trains_no_further_step(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    losses_before = [e for e in read_json(out / "checkpoint-4" / "trainer_state.json")["log_history"] if "loss" in e]
    result = launch_recipe("llama_lora", *QUICK, "--resume_from_checkpoint", "auto", "--output_dir", str(out))
    assert f"resuming from {out / 'checkpoint-4'}" in result.stdout
    assert "llama_lora: 4 steps" in result.stdout  # the summary of the finished run, not a fifth step
    state = read_json(out / "trainer_state.json")
    assert state["global_step"] == 4
    assert [e for e in state["log_history"] if "loss" in e] == losses_before
    assert not (out / "checkpoint-5").exists()


@pytest.mark.slow
def test_a_live_run_holds_its_output_dir_and_a_killed_one_does_not(tmp_path, tiny_model_dir):
    out = tmp_path / "live"
    long_run = [*QUICK[2:], "--max_steps", "2000", "--output_dir", str(out)]
    live = subprocess.Popen(
        launch_command(*long_run),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoint-2").is_dir():
            assert live.poll() is None and time.monotonic() < deadline, live.stderr.read() if live.poll() else "slow"
            time.sleep(0.5)
        before = checksums(out / "checkpoint-2")
        second = run_command(launch_command(*long_run, "--overwrite_output_dir", "true"))
        [line] = error_lines(second)
        assert line.startswith(f"error: output_dir: {out} is in use by a live run (pid ")
        assert line.endswith("wait for it to end or stop it, or choose another output_dir")
        assert checksums(out / "checkpoint-2") == before  # overwrite did not touch the live run

        ranks = [
            p for p in psutil.Process(live.pid).children(recursive=True) if "llama_lora.py" in " ".join(p.cmdline())
        ]
        assert len(ranks) == 2
        launcher = psutil.Process(live.pid)
        launcher.send_signal(signal.SIGKILL)  # the launcher dies; its ranks must not live on as orphans
        gone, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, [p.pid for p in alive]
    finally:
        if live.poll() is None:
            live.kill()
        live.wait()
    resumed = launch_recipe("llama_lora", *QUICK, "--overwrite_output_dir", "true", "--output_dir", str(out))
    assert "overwrite_output_dir: removing the previous run's" in resumed.stdout


@pytest.mark.slow
def test_an_unknown_model_type_is_refused_alike_by_validate_and_the_recipe(tmp_path, tiny_model_dir):
    model = tmp_path / "odd-model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "llama_nova"}))
    recipe = tmp_path / "odd.yaml"
    recipe.write_text(f"include: {REPO / 'configs' / 'llama_lora' / 'tiny.yaml'}\nmodel_name_or_path: {model}\n")
    expected = (
        f"error: model_name_or_path: the config of {model} does not load: The checkpoint you are trying to load has "
        "model type `llama_nova` but Transformers does not recognize this architecture."
    )
    validate = run_command(["fsdp-peft", "validate", str(recipe)])
    recipe_run = run_command(launch_command("--config", str(recipe), "--output_dir", str(tmp_path / "out")))
    for result in (validate, recipe_run):
        assert result.returncode != 0
        [line] = error_lines(result)
        assert line.startswith(expected) and line.endswith(
            "(if its code lives in its hub repo: trust_remote_code: true)"
        )
    assert error_lines(validate) == error_lines(recipe_run)
    assert validate.returncode == 2 and "Traceback" not in validate.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_model_whose_code_lives_in_its_repo_needs_trust_remote_code(tmp_path, tiny_model_dir):
    model = tiny.write_remote_code_copy(tiny_model_dir, tmp_path / "remote-code-llama")
    recipe = tmp_path / "nova.yaml"
    recipe.write_text(f"include: {REPO / 'configs' / 'llama_lora' / 'tiny.yaml'}\nmodel_name_or_path: {model}\n")

    refused = run_command(["fsdp-peft", "validate", str(recipe)])
    assert refused.returncode == 2
    [line] = error_lines(refused)
    assert (
        line.startswith(f"error: model_name_or_path: the config of {model} does not load")
        and "trust_remote_code: true" in line
    )

    out = tmp_path / "out"
    trained = launch_recipe(
        "llama_lora",
        "--config",
        str(recipe),
        "--trust_remote_code",
        "true",
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--generate_samples",
        "0",
        "--generate_eval_samples",
        "0",
    )
    assert f"warning: trust_remote_code: true: running Python code from the repository of {model}" in trained.stderr
    assert read_json(out / "results.json")["steps"] == 2
    assert read_json(out / "fsdp_layout.json")["units"][2].endswith("layers.0")


# ---------------------------------------------------------------- a start owns nothing before its first step

OLD_RUN_ID = "0123456789ab"
SHORT = ["--max_steps", "2", "--generate_samples", "0", "--generate_eval_samples", "0"]


def tree(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory`` with its bytes (``None`` for a directory), the lock file included."""
    return {
        str(path.relative_to(directory)): path.read_bytes() if path.is_file() else None
        for path in sorted(directory.rglob("*"))
    }


def claim(output_dir: Path, overwrite: bool = False) -> Run:
    """Claim ``output_dir`` in this process, as a recipe's rank 0 does (no process group here)."""
    training = TrainingArguments(output_dir=str(output_dir), use_cpu=True, report_to="none")
    return start_run({"model_name_or_path": "tiny-llama", "overwrite_output_dir": overwrite}, training, None)


def a_finished_run(directory: Path) -> Path:
    """What a finished run leaves (record, checkpoint, adapter, lock file), beside a file of the user's."""
    record = {"run_id": OLD_RUN_ID, "started": "2026-12-01T00:00:00+00:00", "config": {}, "legs": []}
    (directory / "checkpoint-2").mkdir(parents=True)
    (directory / "checkpoint-2" / "adapter_model.safetensors").write_bytes(b"step 2")
    (directory / "adapter").mkdir()
    (directory / "adapter" / "adapter_model.safetensors").write_bytes(b"final")
    (directory / RUN_FILE).write_text(json.dumps(record))
    (directory / LOCK_FILE).write_text("pid 1 on elsewhere\n")
    (directory / "notes.txt").write_text("the user's")
    return directory


def written_before_the_first_step(output_dir: Path) -> None:
    """What a start writes before its first optimizer step (EVA's init, preference data and scores)."""
    (output_dir / "eva_init.safetensors").write_bytes(b"the new run's")
    (output_dir / ".preference_data" / "train").mkdir(parents=True)
    (output_dir / "held_out_before.jsonl").write_text("{}\n")


def test_a_start_that_ends_before_its_first_step_leaves_no_output_dir_behind(tmp_path):
    out = tmp_path / "runs" / "first"
    claim(out)
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE, ".fsdp_peft_start.json"]  # no run record yet
    written_before_the_first_step(out)
    release_output_dir()  # the recipe's way out, after any error
    assert not (tmp_path / "runs").exists()


def test_a_start_that_ends_before_its_first_step_leaves_an_existing_output_dir_as_it_was(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    claim(out)
    written_before_the_first_step(out)
    release_output_dir()
    assert tree(out) == {"notes.txt": b"the user's"}


def test_overwrite_keeps_the_old_run_until_the_new_one_takes_its_first_step(tmp_path):
    out = a_finished_run(tmp_path / "out")
    before = tree(out)
    claim(out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [
        LOCK_FILE,
        ".fsdp_peft_replaced",
        ".fsdp_peft_start.json",
        "notes.txt",
    ]
    written_before_the_first_step(out)
    release_output_dir()
    assert tree(out) == before


def test_the_first_step_records_the_run_and_only_then_removes_the_run_it_replaces(tmp_path, capsys):
    out = a_finished_run(tmp_path / "out")
    run = claim(out, overwrite=True)
    written_before_the_first_step(out)
    begin_run(run)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [LOCK_FILE, ".preference_data", "eva_init.safetensors", "held_out_before.jsonl", "notes.txt", RUN_FILE]
    )
    assert read_json(out / RUN_FILE)["run_id"] == run.run_id != OLD_RUN_ID
    assert (
        f"overwrite_output_dir: removing the previous run's checkpoint-2, adapter from {out}" in capsys.readouterr().out
    )
    release_output_dir()
    assert read_json(out / RUN_FILE)["run_id"] == run.run_id  # the start is final: leaving undoes nothing


def test_a_refused_start_leaves_even_the_lock_file_as_it_was(tmp_path):
    out = a_finished_run(tmp_path / "out")
    before = tree(out)
    with pytest.raises(ConfigError, match=f"holds run {OLD_RUN_ID} started"):
        claim(out)
    assert tree(out) == before


def test_a_refused_start_counts_the_checkpoints_it_found_in_words(tmp_path):
    out = a_finished_run(tmp_path / "out")
    with pytest.raises(ConfigError, match=r"\(1 checkpoint, adapter/ saved\)"):  # once "1 checkpoints"
        claim(out)
    (out / "checkpoint-4").mkdir()
    with pytest.raises(ConfigError, match=r"\(2 checkpoints, adapter/ saved\)"):
        claim(out)


START_THEN = """
import os, signal, sys, time
from pathlib import Path
from transformers import TrainingArguments
from fsdp_peft.tools.runs import release_output_dir, start_run

out, end = Path(sys.argv[1]), sys.argv[2]
training = TrainingArguments(output_dir=str(out), use_cpu=True, report_to="none")
try:
    start_run({"overwrite_output_dir": True}, training, None)
    (out / "eva_init.safetensors").write_bytes(b"the new run's")
    os.kill(os.getpid(), getattr(signal, end))
    time.sleep(30)
finally:
    release_output_dir()
"""


def test_a_start_killed_before_its_first_step_is_undone_by_the_next_start(tmp_path):
    out = a_finished_run(tmp_path / "out")
    before = tree(out)
    killed = run_command([sys.executable, "-c", START_THEN, str(out), "SIGKILL"], timeout=120)
    assert killed.returncode == -signal.SIGKILL and (out / ".fsdp_peft_start.json").is_file()
    assert not (out / "adapter").exists()  # set aside, and the process died before it could put it back
    with pytest.raises(ConfigError, match=f"holds run {OLD_RUN_ID} started"):  # the old run is back, refused
        claim(out)
    assert tree(out) == before


def test_sigterm_before_the_first_step_undoes_the_start(tmp_path):
    out = a_finished_run(tmp_path / "out")
    before = tree(out)
    stopped = run_command([sys.executable, "-c", START_THEN, str(out), "SIGTERM"], timeout=120)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-2000:]
    assert tree(out) == before


def broken_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with its weights file cut in half, as by an interrupted download."""
    model = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    return model


def one_launcher_traceback(result: subprocess.CompletedProcess) -> bool:
    """Only the launcher's own ``ChildFailedError`` traceback: no rank printed one."""
    return result.stderr.count("Traceback (most recent call last)") == 1 and "[rank" not in result.stderr


@pytest.mark.slow
def test_a_bad_row_stops_the_start_before_any_weights_load_and_leaves_output_dir_as_it_was(tmp_path, tiny_model_dir):
    rows = (REPO / "fsdp_peft" / "assets" / "tiny_reverse" / "train.jsonl").read_text().splitlines()[:40]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join([*rows, '{"prompt": "reverse: abcde"}']) + "\n")
    expected = [f"error: {data}: row 41: missing field 'completion'; fix the row or set skip_invalid_rows: true"]

    # The weights cannot be read either: the row is what stops the start, so it was checked before they load.
    fresh = tmp_path / "fresh"
    broken = broken_model(tiny_model_dir, tmp_path)
    result = run_command(
        launch_command(
            "--train_file", str(data), "--model_name_or_path", str(broken), *SHORT, "--output_dir", str(fresh)
        )
    )
    assert result.returncode != 0 and error_lines(result) == expected and one_launcher_traceback(result)
    assert not fresh.exists()

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("the user's")
    result = run_command(launch_command("--train_file", str(data), *SHORT, "--output_dir", str(kept)))
    assert result.returncode != 0 and error_lines(result) == expected and one_launcher_traceback(result)
    assert tree(kept) == {"notes.txt": b"the user's"}

    data.write_text("\n".join(rows) + "\n")  # the row fixed, the same command trains
    launch_recipe("llama_lora", "--train_file", str(data), *SHORT, "--output_dir", str(kept))
    assert read_json(kept / "results.json")["steps"] == 2 and (kept / "notes.txt").read_text() == "the user's"
    assert len(read_json(kept / RUN_FILE)["legs"]) == 1


@pytest.mark.slow
def test_a_model_that_fails_to_load_leaves_the_run_it_would_replace_intact(finished, tmp_path, tiny_model_dir):
    out = copy_of(finished, tmp_path)
    before = tree(out)
    broken = broken_model(tiny_model_dir, tmp_path)
    result = run_command(
        launch_command(
            "--model_name_or_path", str(broken), "--overwrite_output_dir", "true", *QUICK, "--output_dir", str(out)
        )
    )
    assert result.returncode != 0 and "Error while deserializing header" in result.stderr
    assert tree(out) == before
