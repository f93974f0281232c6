"""The ``fsdp-peft`` command."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import REPO, run_command

# beside this interpreter, not on PATH: pytest run as .venv/bin/python without activating the venv finds it too
CONSOLE_SCRIPT = Path(sys.executable).parent / "fsdp-peft"


def test_validate_accepts_a_shipped_config_and_rejects_a_broken_one(tmp_path):
    exe = str(CONSOLE_SCRIPT)
    assert CONSOLE_SCRIPT.is_file(), f"{CONSOLE_SCRIPT}: the console script is installed with the package"
    good = run_command([exe, "validate", str(REPO / "configs" / "llama_qlora" / "llama3_1_8b.yaml")], timeout=120)
    assert good.returncode == 0 and good.stdout.strip().endswith("llama3_1_8b.yaml: ok")
    bad = tmp_path / "bad.yaml"
    bad.write_text("load_in_4bit: true\nbnb_4bit_quant_storage: float32\nbf16: true\n")
    result = run_command([exe, "validate", str(bad), "--recipe", "llama_qlora"], timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(
        "error: bnb_4bit_quant_storage: 'float32' differs from the dtype FSDP gathers in ('bfloat16'"
    )


def _cli(*args: str):
    exe = str(CONSOLE_SCRIPT)
    assert CONSOLE_SCRIPT.is_file(), f"{CONSOLE_SCRIPT}: the console script is installed with the package"
    return run_command([exe, *args], timeout=120)


def test_ls_lists_every_recipe_and_config_on_one_line_each():
    result = _cli("ls")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    recipes = sorted(p.stem for p in (REPO / "recipes").glob("*.py"))
    configs = sorted(p.relative_to(REPO / "configs").as_posix() for p in (REPO / "configs").rglob("*.yaml"))
    assert [line.split()[:2] for line in lines if line.startswith("recipe")] == [["recipe", r] for r in recipes]
    listed = [line.split()[1] for line in lines if line.startswith("config")]
    assert [name for name in listed if name.endswith(".yaml")] == configs
    by_name = {line.split()[1]: line for line in lines}
    seventy = by_name["llama_qlora/llama3_3_70b.yaml"]
    assert seventy.endswith("  QLoRA on Llama 3.3 70B Instruct, sharded with FSDP2 over the GPUs of one machine.")
    assert "QLoRA on Qwen (2.5 and 3): nf4 base" in by_name["qwen_qlora"]


def test_cp_copies_to_a_new_file_and_refuses_to_overwrite_or_guess(tmp_path):
    copied = _cli("cp", "qwen_qlora/qwen2_5_7b.yaml", str(tmp_path / "mine.yaml"))
    assert copied.returncode == 0, copied.stderr[-2000:]
    source = (REPO / "configs" / "qwen_qlora" / "qwen2_5_7b.yaml").read_bytes()
    assert (tmp_path / "mine.yaml").read_bytes() == source
    (tmp_path / "mine.yaml").write_text("lora_r: 4\n")  # the user's edit
    again = _cli("cp", "qwen_qlora/qwen2_5_7b.yaml", str(tmp_path / "mine.yaml"))
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert again.stderr.startswith(f"error: DEST: {tmp_path / 'mine.yaml'} already exists; cp never overwrites")
    assert (tmp_path / "mine.yaml").read_text() == "lora_r: 4\n"


def test_validate_lists_every_problem_at_once_with_the_accelerate_configs_fsdp_rules(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("include: llama_qlora/llama3_1_8b.yaml\nlora_r: 0\noptim: paged_adamw_8bit\n")
    accelerate_config = REPO / "configs" / "accelerate" / "fsdp2_offload.yaml"
    offload = _cli("validate", str(config), "--accelerate-config", str(accelerate_config))
    assert offload.returncode == 2 and "Traceback" not in offload.stderr
    errors = [line.strip() for line in offload.stderr.splitlines() if "warn" not in line.lower()]
    assert errors[0] == "error: lora_r: must be positive, got 0"
    assert errors[1].startswith("optim: 'paged_adamw_8bit' steps on the GPU, but FSDP offload_params keeps parameters")


def test_cp_copies_a_recipe_into_a_directory_and_suggests_the_closest_name(tmp_path, capsys):
    from fsdp_peft.cli import main

    main(["cp", "recipes/qwen_qlora.py", str(tmp_path)])
    assert (tmp_path / "qwen_qlora.py").read_bytes() == (REPO / "recipes" / "qwen_qlora.py").read_bytes()
    assert capsys.readouterr().out.strip() == f"copied recipes/qwen_qlora.py to {tmp_path / 'qwen_qlora.py'}"
    with pytest.raises(SystemExit) as exit_info:
        main(["cp", "mistral_qlora/mistral7b.yaml", str(tmp_path)])
    assert exit_info.value.code == 2 and capsys.readouterr().err.strip() == (
        "error: NAME: no recipe or config called 'mistral_qlora/mistral7b.yaml'; "
        "did you mean 'mistral_qlora/mistral_7b.yaml'?"
    )


def test_validate_names_a_missing_accelerate_config(tmp_path, capsys):
    from fsdp_peft.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(
            ["validate", str(REPO / "configs" / "qwen_qlora" / "tiny.yaml"), "--accelerate-config", str(tmp_path / "x")]
        )
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: --accelerate-config: file not found: {tmp_path / 'x'}"


def test_cp_takes_a_config_name_without_its_suffix_as_tune_cp_does(tmp_path, capsys):
    from fsdp_peft.cli import main

    main(["cp", "llama_qlora/tiny", str(tmp_path / "mine.yaml")])
    assert (tmp_path / "mine.yaml").read_bytes() == (REPO / "configs" / "llama_qlora" / "tiny.yaml").read_bytes()
    assert capsys.readouterr().out.strip() == f"copied llama_qlora/tiny to {tmp_path / 'mine.yaml'}"
    main(["cp", "llama_qlora/tiny", str(tmp_path)])
    assert (tmp_path / "tiny.yaml").is_file()


@pytest.mark.parametrize("command", ["plan", "validate"])
def test_an_error_is_one_whole_line_on_stderr(tmp_path, command):
    """The error line ends with its newline, so nothing printed after it (a warning, the shell prompt) joins it."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("include: llama_qlora/llama3_1_8b.yaml\nlora_r: 0\n")
    result = _cli(command, str(bad), *(["--gpus", "2", "--gpu-memory", "24GiB"] if command == "plan" else []))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stdout == "", result.stdout
    assert "error: lora_r: must be positive, got 0\n" in result.stderr, repr(result.stderr)
    assert all(line.startswith(("error: ", "warning")) or not line for line in result.stderr.split("\n")), repr(
        result.stderr
    )


def test_tiny_model_builds_every_embedded_name_and_the_image_task(capsys):
    """A vision-language model's or the image task's name, as the configs give them, is accepted too."""
    from fsdp_peft.cli import main

    main(["tiny-model", "tiny-qwen2.5-vl"])
    model = Path(capsys.readouterr().out.strip())
    assert model.name.startswith("tiny-qwen2.5-vl-") and (model / "model.safetensors").is_file()
    main(["tiny-model", "tiny-colors"])
    colors = Path(capsys.readouterr().out.strip())
    assert colors.name.startswith("tiny-colors-") and (colors / "eval.jsonl").is_file()


def test_help_is_plain_text_and_describes_the_config_argument(capsys):
    from fsdp_peft.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "``" not in top and "tools around the fsdp-peft recipes" in top  # no reST markup from a docstring
    for command in ("validate", "plan"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "config                the recipe YAML to " in capsys.readouterr().out


HELP_WITHOUT_TORCH = """
import sys
from fsdp_peft.cli import main
for argv in (["--help"], *([name, "--help"] for name in sys.argv[1:])):
    try:
        main(argv)
    except SystemExit as exit:
        assert exit.code == 0, (argv, exit.code)
heavy = sorted(m for m in ("torch", "transformers", "peft", "accelerate", "datasets") if m in sys.modules)
print("imported:", heavy)
"""


def test_every_subcommands_help_answers_without_importing_torch_or_the_hugging_face_libraries():
    """--help is for reading the options: it must not wait seconds on the libraries the command itself needs."""
    from fsdp_peft.cli import main

    commands = ["ls", "cp", "validate", "plan", "export", "generate", "eval", "tiny-model"]
    with pytest.raises(SystemExit):
        main(["--help"])  # every command above is a real one (argparse would refuse an unknown one in the child)
    result = run_command([sys.executable, "-c", HELP_WITHOUT_TORCH, *commands], timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1] == "imported: []"


def test_the_embedded_names_are_the_ones_the_builders_build():
    """`fsdp_peft.settings.choices` lists the causal LMs without torch; `fsdp_peft.model.tiny` keys its family models by
    exactly those names (tests/model/test_tiny_vision.py builds every vision-language name)."""
    from fsdp_peft.model.tiny import TINY_FAMILY_CONFIGS
    from fsdp_peft.settings.choices import TINY_CAUSAL_LM_NAMES, TINY_MODEL_NAME

    assert TINY_CAUSAL_LM_NAMES == (TINY_MODEL_NAME, *TINY_FAMILY_CONFIGS)
