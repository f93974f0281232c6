"""Which procedure checks and plans a config: its recipe's, never a guess where the recipe is known.

A config is its recipe's when ``--recipe`` names it, when it lies under ``configs/<recipe>/``, or when it includes a
file there; only a YAML with none of these is taken by its keys, and ``validate`` and ``plan`` say so in one line. A
recipe launched with another procedure's keys refuses them, and ``validate --recipe`` says the same line the launch
does (`fsdp_peft.procedures.registry`, `fsdp_peft.tools.validation._keys_are_the_procedures`).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from conftest import REPO
from fsdp_peft.cli import main
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.procedures.preference import PREFERENCE_PROCEDURE
from fsdp_peft.procedures.registry import PROCEDURES, config_procedure, plan_config, recipe_procedure, recognised
from fsdp_peft.procedures.rl import GRPO_PROCEDURE
from fsdp_peft.procedures.sft import SFT_PROCEDURE
from fsdp_peft.procedures.vision_sft import VISION_SFT_PROCEDURE
from fsdp_peft.recipe import parse_recipe_config
from fsdp_peft.settings.config import RecipeArguments, keys_set, resolve_recipe_config
from fsdp_peft.tools.plan import ROLLOUT_ROW

CONFIGS = REPO / "configs"


def _validate(config: Path, *arguments: str) -> tuple[int, str, str]:
    """``fsdp-peft validate config arguments``: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["validate", str(config), *arguments])
            code = 0
        except SystemExit as exit_code:
            code = exit_code.code
    return code, out.getvalue(), err.getvalue()


def test_every_procedure_has_its_own_name_and_every_recipe_names_a_listed_one():
    assert len({procedure.name for procedure in PROCEDURES}) == len(PROCEDURES) == 4
    recipes = sorted(path.stem for path in (REPO / "recipes").glob("*.py"))
    found = {recipe: recipe_procedure(recipe) for recipe in recipes}
    assert all(procedure in PROCEDURES for procedure in found.values())
    assert sorted(r for r, p in found.items() if p is PREFERENCE_PROCEDURE) == ["llama_dpo", "qwen_dpo"]
    assert sorted(r for r, p in found.items() if p is GRPO_PROCEDURE) == ["llama_grpo", "qwen_grpo"]
    assert sorted(r for r, p in found.items() if p is VISION_SFT_PROCEDURE) == [
        "gemma3_vl_lora",
        "gemma3_vl_qlora",
        "qwen_vl_lora",
        "qwen_vl_qlora",
    ]
    with pytest.raises(ConfigError, match=r"^--recipe: 'llama_dop' is no recipe; the recipes are gemma3_vl_lora, "):
        recipe_procedure("llama_dop")


def test_every_key_a_procedure_owns_is_a_recipe_key_and_shared_keys_have_each_ones_default():
    fields = set(RecipeArguments.__dataclass_fields__)
    for procedure in PROCEDURES:
        assert set(procedure.keys) <= fields and set(procedure.recognised_by) <= set(procedure.keys), procedure.name
        assert set(procedure.defaults) <= set(procedure.keys), procedure.name
    # the keys both TRL procedures read, at TRL's own defaults for each (DPOConfig's and GRPOConfig's)
    from trl import DPOConfig, GRPOConfig

    assert PREFERENCE_PROCEDURE.defaults == {"beta": DPOConfig.beta, "loss_type": "sigmoid"}
    assert GRPO_PROCEDURE.defaults == {"beta": GRPOConfig.beta, "loss_type": GRPOConfig.loss_type}
    assert SFT_PROCEDURE.keys == VISION_SFT_PROCEDURE.keys == ()


def test_a_loose_yaml_is_recognised_by_its_keys_grpo_first():
    assert recognised({"num_generations": 4, "beta": 0.1}) is GRPO_PROCEDURE
    assert recognised({"beta": 0.1}) is PREFERENCE_PROCEDURE
    assert recognised({"ref_model": "x"}) is PREFERENCE_PROCEDURE
    assert recognised({"lora_r": 8}) is SFT_PROCEDURE


def test_keys_at_their_defaults_or_empty_name_no_procedure():
    """``--print-config`` writes every key, GRPO's too, at its default: such a YAML is still the SFT run's; an empty
    value where the default is empty (``ref_model: ""``) sets nothing either."""
    import dataclasses

    printed = dataclasses.asdict(RecipeArguments())
    assert keys_set(printed) == set() and recognised(printed) is SFT_PROCEDURE
    assert keys_set({"ref_model": "", "reward_weights": None, "num_generations": 8, "beta": 0.2}) == {"beta"}
    assert recognised({**printed, "reward_funcs": ["math_answer"], "beta": 0.0}) is GRPO_PROCEDURE


def test_a_yaml_that_includes_a_shipped_config_is_taken_by_its_keys_first(tmp_path):
    """An include decides only where the YAML's own keys name no other procedure: DPO keys over an SFT config are a
    DPO config (said in one line), a vision config's copy stays vision-language SFT, a DPO config's stays DPO."""
    over_sft = tmp_path / "dpo_on_8b.yaml"
    over_sft.write_text("include: llama_qlora/llama3_1_8b.yaml\nbeta: 0.1\nloss_type: sigmoid\n")
    procedure, line = config_procedure(over_sft)
    assert procedure is PREFERENCE_PROCEDURE and line.startswith(f"{over_sft}: taken for the DPO/KTO recipes (it sets ")
    vision = tmp_path / "vision.yaml"
    vision.write_text("include: qwen_vl_lora/tiny.yaml\nlora_r: 4\n")
    assert config_procedure(vision) == (VISION_SFT_PROCEDURE, None)
    dpo = tmp_path / "dpo.yaml"
    dpo.write_text("include: llama_dpo/tiny.yaml\nbeta: 0.3\n")
    assert config_procedure(dpo) == (PREFERENCE_PROCEDURE, None)


def test_an_empty_ref_model_on_an_sft_config_is_no_foreign_key(tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text('include: llama_lora/tiny.yaml\nref_model: ""\n')
    code, out, err = _validate(config)
    assert (code, out.strip(), err) == (0, f"{config}: ok", "")


def test_a_config_is_its_recipes_under_configs_through_an_include_or_by_name(tmp_path):
    assert config_procedure(CONFIGS / "llama_dpo" / "tiny.yaml") == (PREFERENCE_PROCEDURE, None)
    assert config_procedure(CONFIGS / "qwen_vl_lora" / "tiny.yaml") == (VISION_SFT_PROCEDURE, None)
    included = tmp_path / "mine.yaml"
    included.write_text("include: llama_grpo/tiny.yaml\nlearning_rate: 1.0e-5\n")
    assert config_procedure(included) == (GRPO_PROCEDURE, None)
    loose = tmp_path / "loose.yaml"
    loose.write_text((CONFIGS / "llama_dpo" / "tiny.yaml").read_text())
    procedure, line = config_procedure(loose)
    assert procedure is PREFERENCE_PROCEDURE and line.startswith(
        f"{loose}: taken for the DPO/KTO recipes (it sets beta, loss_type); pass --recipe"
    )
    assert config_procedure(loose, "llama_lora") == (SFT_PROCEDURE, None)


def test_validate_checks_the_recipe_the_config_will_be_launched_with_and_says_the_launchs_line(tmp_path, monkeypatch):
    """The first hour's trap: a DPO config validated as DPO's, then launched with an SFT recipe, which ignored its
    DPO keys. Now the launch refuses them, and ``validate --recipe`` gives the same line; a loose copy validated
    without a recipe is taken by its keys and says so."""
    loose = tmp_path / "my.yaml"
    loose.write_text((CONFIGS / "llama_dpo" / "tiny.yaml").read_text().replace("output_dir:", "# output_dir:"))
    monkeypatch.chdir(tmp_path)
    code, out, err = _validate(loose)
    assert code == 0 and out.strip() == f"{loose}: ok", (out, err)
    assert err.splitlines() == [
        f"{loose}: taken for the DPO/KTO recipes (it sets beta, loss_type); pass --recipe "
        "NAME (a name `fsdp-peft ls` lists) to take it for the recipe you will launch it with"
    ]
    refusal = (
        "error: beta, loss_type: read by the GRPO or DPO/KTO recipes only, and this recipe trains SFT; launch a GRPO "
        "or DPO/KTO recipe with this config (`fsdp-peft ls`), or remove them"
    )
    code, out, err = _validate(loose, "--recipe", "llama_lora")
    assert code == 2 and err.splitlines()[0] == refusal, err
    with pytest.raises(ConfigError) as launched:
        parse_recipe_config(["--config", str(loose)], loose, str(tmp_path / "out"), SFT_PROCEDURE)
    assert f"error: {launched.value}".splitlines()[0] == refusal
    code, out, err = _validate(loose, "--recipe", "llama_dpo")
    assert (code, out.strip(), err) == (0, f"{loose}: ok", "")


def test_a_grpo_key_in_a_dpo_config_is_refused_and_the_dpo_rules_still_run(tmp_path):
    config = tmp_path / "dpo.yaml"
    config.write_text("include: llama_dpo/tiny.yaml\nnum_generations: 4\nbeta: 0\n")
    code, _, err = _validate(config)  # its keys say GRPO, over DPO's include: said, and checked as GRPO's
    assert code == 2 and err.startswith(f"{config}: taken for the GRPO recipes (it sets num_generations)")
    code, _, err = _validate(config, "--recipe", "llama_dpo")
    assert code == 2 and err.splitlines() == [
        "error: num_generations: 4: read by the GRPO recipes only, and this recipe trains DPO/KTO; launch a GRPO "
        "recipe with this config (`fsdp-peft ls`), or remove it",
        "       beta: must be above 0 for DPO/KTO (the reference's pull), got 0",
    ], err


def test_plan_counts_the_rows_of_the_recipes_procedure_and_notes_a_guess(tmp_path):
    """The same YAML planned for an SFT recipe and for the DPO recipe: a pair is two sequences, so DPO's tokens per
    rank are twice SFT's; GRPO's rows hold a completion too and its rollouts' KV cache."""
    loose = tmp_path / "my.yaml"
    loose.write_text((CONFIGS / "llama_dpo" / "tiny.yaml").read_text())
    as_dpo = plan_config(loose, 2, 24 * 2**30)
    as_sft = plan_config(loose, 2, 24 * 2**30, recipe="llama_lora")
    assert as_dpo.tokens_per_rank == 2 * as_sft.tokens_per_rank
    assert any(note.startswith(f"{loose}: taken for the DPO/KTO recipes") for note in as_dpo.notes)
    assert not any("taken for" in note for note in as_sft.notes)
    assert as_dpo.longest_sequence is None and as_sft.longest_sequence is not None  # one sequence a row: SFT's
    grpo_config = CONFIGS / "llama_grpo" / "tiny.yaml"
    recipe, training, _ = resolve_recipe_config(["--config", str(grpo_config)], grpo_config, "outputs")
    grpo = plan_config(grpo_config, 2, 24 * 2**30)
    rows = training["per_device_train_batch_size"]
    assert grpo.tokens_per_rank == rows * (recipe.max_seq_length + recipe.max_completion_length)
    assert grpo.gpu[ROLLOUT_ROW] > 0 and ROLLOUT_ROW not in as_dpo.gpu
