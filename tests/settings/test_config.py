"""Recipe configuration: precedence, key checking and clean user errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import REPO, procedure_of, run_command
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.procedures.sft import SFT_PROCEDURE
from fsdp_peft.recipe import parse_recipe_config
from fsdp_peft.settings.config import read_yaml_config, resolve_recipe_config
from fsdp_peft.tools.validation import check_before_training

QLORA_TINY = REPO / "configs" / "llama_qlora" / "tiny.yaml"
LORA_TINY = REPO / "configs" / "llama_lora" / "tiny.yaml"


def test_command_line_overrides_win_over_the_yaml(tmp_path):
    recipe, training = parse_recipe_config(
        ["--learning_rate", "1e-4", "--lora_r", "8", "--output_dir", str(tmp_path)], QLORA_TINY, "unused"
    )
    yaml_values = read_yaml_config(QLORA_TINY)
    assert training.learning_rate == pytest.approx(1e-4) != yaml_values["learning_rate"]
    assert recipe.lora_r == 8 != yaml_values["lora_r"]
    assert recipe.lora_alpha == yaml_values["lora_alpha"]
    assert training.max_steps == yaml_values["max_steps"]
    assert recipe.load_in_4bit is True
    assert training.output_dir == str(tmp_path)


def test_every_dtype_key_and_command_takes_both_spellings(tmp_path):
    from fsdp_peft.tools.export import export_merged

    argv = ["--torch_dtype", "fp32", "--bnb_4bit_compute_dtype", "BF16", "--fsdp_reduce_dtype", "float32"]
    recipe, _ = parse_recipe_config(
        [*argv, "--export_dtype", "float16", "--output_dir", str(tmp_path)], QLORA_TINY, "x"
    )
    assert (recipe.torch_dtype, recipe.bnb_4bit_compute_dtype, recipe.fsdp_reduce_dtype) == (
        "float32",
        "bfloat16",
        "float32",
    )
    assert recipe.export_dtype == "fp16"
    with pytest.raises(ConfigError, match=r"^--dtype: 'float64' is not a dtype; use bf16, fp16 or fp32"):
        export_merged(tmp_path / "missing", tmp_path / "out", dtype="float64")
    with pytest.raises(ConfigError, match="^SOURCE: ") as refused:  # float32 passes the dtype check
        export_merged(tmp_path / "missing", tmp_path / "out", dtype="float32")
    assert "--dtype" not in str(refused.value)


def test_yaml_strings_are_converted_to_the_field_type(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("learning_rate: 2e-4\nlora_dropout: '0.1'\nbf16: false\nlora_target_modules: [q_proj, v_proj]\n")
    recipe, training = parse_recipe_config(["--config", str(config)], QLORA_TINY, str(tmp_path / "out"))
    assert training.learning_rate == pytest.approx(2e-4)
    assert recipe.lora_dropout == pytest.approx(0.1)
    assert recipe.lora_target_modules == ["q_proj", "v_proj"]
    assert training.output_dir == str(tmp_path / "out")


@pytest.mark.parametrize(
    "yaml_text, argv, message",
    [
        ("learnin_rate: 1.0e-3\n", [], "unknown key 'learnin_rate'; did you mean 'learning_rate'?"),
        ("", ["--lora_alpah", "8"], "command line: unknown key 'lora_alpah'; did you mean 'lora_alpha'?"),
        ("lora_r: many\n", [], "lora_r: invalid int value: 'many'"),
        ("- a list\n", [], "expected a mapping of key: value"),
        ("dataset: /no/such/dir\n", [], "dataset: '/no/such/dir' is neither 'tiny-reverse' nor a directory"),
        ("train_file: /no/such.jsonl\n", [], "train_file: file not found: /no/such.jsonl"),
        ("model_name_or_path: ./no-such-model\n", [], "model_name_or_path: directory not found: ./no-such-model"),
    ],
)
def test_bad_config_is_a_one_line_error_naming_the_key(tmp_path, yaml_text, argv, message):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text)
    with pytest.raises(ConfigError) as error:
        parse_recipe_config(["--config", str(config), *argv], QLORA_TINY, str(tmp_path))
    assert message in str(error.value)


def test_every_problem_is_listed_at_once(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("lora_r: 0\ntrain_file: /no/such.jsonl\n")
    with pytest.raises(ConfigError) as error:
        parse_recipe_config(["--config", str(config)], QLORA_TINY, str(tmp_path))
    assert "train_file: file not found" in str(error.value)
    assert "lora_r: must be positive" in str(error.value)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--config", "{bad}"], "error: {bad}: unknown key 'learnin_rate'; did you mean 'learning_rate'?"),
        (["--config", "/no/such/config.yaml"], "error: --config: file not found: /no/such/config.yaml"),
        (["--dataset", "/no/such/data"], "error: dataset: '/no/such/data' is neither 'tiny-reverse' nor a directory"),
    ],
)
def test_recipe_exits_nonzero_without_traceback_on_user_error(tmp_path, args, expected):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learnin_rate: 1.0e-3\n")
    args = [a.replace("{bad}", str(bad)) for a in args]
    result = run_command([sys.executable, "recipes/llama_qlora.py", *args], timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(expected.replace("{bad}", str(bad)))
    assert "Loading weights" not in result.stdout + result.stderr


def test_unknown_key_fails_under_accelerate_before_any_process_group(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("per_device_train_batchsize: 4\n")
    result = run_command(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(REPO / "configs" / "accelerate" / "cpu_fsdp2.yaml"),
            "--main_process_port",
            "0",
            "recipes/llama_lora.py",
            "--config",
            str(bad),
        ],
        timeout=180,
    )
    assert result.returncode != 0
    ours, _, launcher = result.stderr.partition("Traceback (most recent call last)")
    errors = [line for line in ours.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {bad}: unknown key 'per_device_train_batchsize'; did you mean 'per_device_train_batch_size'?"
    ]
    assert "ChildFailedError" in launcher  # torchrun's report of the failed ranks, not ours
    assert "fsdp_peft/" not in launcher and 'recipes/llama_lora.py", line' not in launcher
    # ... which ends with our line as its root cause: the last words on the screen are the message to read
    last = [line.strip() for line in result.stderr.splitlines() if line.strip().strip("=")][-1]
    assert last == f"traceback : {errors[0]}", result.stderr[-1500:]
    assert "Loading weights" not in result.stdout + result.stderr


def test_fsdp_in_the_yaml_needs_a_launcher(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="fsdp: set in the config, but this is a single process"):
        parse_recipe_config(["--fsdp", "full_shard auto_wrap"], QLORA_TINY, str(tmp_path))


def test_a_procedures_training_default_fills_only_what_the_config_leaves_unset(tmp_path):
    config = tmp_path / "c.yaml"  # the SFT summary counts the tokens trained on unless the config says otherwise
    config.write_text("max_steps: 1\n")
    _, training = parse_recipe_config(["--config", str(config)], QLORA_TINY, str(tmp_path / "out"))
    assert training.include_num_input_tokens_seen == "non_padding"
    config.write_text("include_num_input_tokens_seen: true\n")  # the parser takes it as a bool: true means all
    _, training = parse_recipe_config(["--config", str(config)], QLORA_TINY, str(tmp_path / "out"))
    assert training.include_num_input_tokens_seen == "all"


def test_shipped_recipe_configs_validate(tmp_path):
    for config in sorted(p for p in (REPO / "configs").glob("llama_*/*.yaml") if not p.name.startswith("tpu_")):
        procedure = procedure_of(config)  # each checked by the rules of its own procedure
        # harness tasks' hub data is out of reach here: checked offline as `fsdp-peft validate` does, in
        # tests/test_recipes_catalog.py
        no_tasks = ["--eval_tasks", ""] if read_yaml_config(config).get("eval_tasks") else []
        argv = ["--config", str(config), *no_tasks]
        recipe, training = parse_recipe_config(argv, config, str(tmp_path), procedure=procedure)
        assert recipe.model_name_or_path
        assert Path(config).read_text().startswith("#"), f"{config} must open with its comment block"


def test_a_user_error_is_said_once_by_the_first_rank_and_by_another_only_if_it_is_not_stopped(monkeypatch, capsys):
    from fsdp_peft.core import errors

    @errors.exits_cleanly_on_user_error
    def main():
        raise ConfigError("bad.yaml: unknown key 'x'")

    monkeypatch.setattr(errors, "OTHER_RANKS_WAIT_S", 0.2)
    for local_rank, expected in (("0", "error: bad.yaml: unknown key 'x'"), ("1", "error: (local rank 1) bad.yaml")):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(SystemExit) as exit_:
            main()
        assert exit_.value.code == errors.USER_ERROR_EXIT_CODE
        assert capsys.readouterr().err.startswith(expected)


def test_a_relative_data_path_in_a_config_means_its_directory_then_the_working_directory(tmp_path, monkeypatch):
    """As ``include:`` does: a config beside its data runs from any directory; the working directory is the fallback,
    and a path found in neither is refused naming both places."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "data").mkdir(parents=True), elsewhere.mkdir()
    (project / "data" / "train.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    config = project / "my.yaml"
    config.write_text(f"include: {LORA_TINY}\ndataset: data\n")
    monkeypatch.chdir(elsewhere)
    recipe, _, _ = resolve_recipe_config(["--config", str(config)], config, "out")
    assert recipe.dataset == str(project / "data")
    (elsewhere / "cwd_data").mkdir()
    config.write_text(f"include: {LORA_TINY}\ndataset: cwd_data\n")
    recipe, _, _ = resolve_recipe_config(["--config", str(config)], config, "out")
    assert recipe.dataset == "cwd_data"
    config.write_text(f"include: {LORA_TINY}\ndataset: ./missing\n")
    recipe, training, _ = resolve_recipe_config(["--config", str(config)], config, "out")
    with pytest.raises(ConfigError) as error:
        check_before_training(recipe, training, SFT_PROCEDURE)
    assert str(error.value) == (
        "dataset: './missing' is neither 'tiny-reverse' nor a directory or data file that exists (looked beside the "
        f"config file that sets it, then in the working directory {elsewhere}); fix the path, or name a hub dataset "
        "as owner/name"
    )
