"""Every procedure, and the one a recipe or a config trains by.

A recipe names its procedure: ``PROCEDURE`` in ``recipes/<name>.py``, SFT where it names none (as
`fsdp_peft.recipe.run_recipe` defaults). A config under ``configs/<recipe>/`` is that recipe's, and ``fsdp-peft
validate``/``plan --recipe NAME`` name one for any YAML. A YAML elsewhere (a copy from ``fsdp-peft cp``, or one that
includes a shipped config) is recognised by the keys it sets (``Procedure.recognised_by``, asked in `PROCEDURES`
order; where it sets none, the procedure of the shipped config it includes), and the tool says so in one line unless
the shipped config it includes agrees. The launch never guesses: it runs its recipe's procedure, whose rules
refuse the keys only other procedures read (`fsdp_peft.tools.validation`), so a config that ``validate`` passes for a
recipe is one its launch takes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.procedures.preference import PREFERENCE_PROCEDURE
from fsdp_peft.procedures.procedure import Procedure
from fsdp_peft.procedures.rl import GRPO_PROCEDURE
from fsdp_peft.procedures.sft import SFT_PROCEDURE
from fsdp_peft.procedures.vision_sft import VISION_SFT_PROCEDURE
from fsdp_peft.settings.catalog import CONFIGS, RECIPES, shipped
from fsdp_peft.settings.config import config_files, keys_set, read_yaml_config
from fsdp_peft.tools.plan import MemoryPlan, plan_memory
from fsdp_peft.tools.validation import check_before_training

# every procedure, in the order a loose YAML's keys are asked (GRPO's before DPO/KTO's, which share beta and loss_type)
PROCEDURES = (GRPO_PROCEDURE, PREFERENCE_PROCEDURE, SFT_PROCEDURE, VISION_SFT_PROCEDURE)


def others(procedure: Procedure) -> tuple[Procedure, ...]:
    """Every procedure but ``procedure``: the ones whose keys its config must not set."""
    return tuple(other for other in PROCEDURES if other.name != procedure.name)


def check_config(recipe, training: dict, procedure: Procedure, with_model_structure: bool = False) -> None:
    """`fsdp_peft.tools.validation.check_before_training` for ``procedure``, the other procedures' keys refused."""
    check_before_training(recipe, training, procedure, with_model_structure, others(procedure))


def recipe_procedure(name: str) -> Procedure:
    """The procedure recipe ``name`` runs: its ``PROCEDURE`` (read by loading ``recipes/<name>.py``, whose launch
    waits behind ``__main__``), else SFT."""
    path = RECIPES / f"{name}.py"
    if not path.is_file():
        recipes = [entry.name for entry in shipped() if entry.kind == "recipe"]
        raise ConfigError(f"--recipe: {name!r} is no recipe; the recipes are {', '.join(recipes)}")
    spec = importlib.util.spec_from_file_location(f"fsdp_peft_recipe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, "PROCEDURE", SFT_PROCEDURE)


def recognised(values: dict) -> Procedure:
    """The procedure a YAML's keys name: the first whose ``recognised_by`` it sets (`keys_set`: not at their
    defaults), else SFT."""
    return _named_by(keys_set(values))


def _named_by(given: set[str]) -> Procedure:
    return next((p for p in PROCEDURES if given & set(p.recognised_by)), SFT_PROCEDURE)


def shipped_recipe_of(path: Path) -> str | None:
    """The recipe whose ``configs/<recipe>/`` holds ``path``, if any."""
    try:
        parts = Path(path).resolve().relative_to(CONFIGS.resolve()).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and (RECIPES / f"{parts[0]}.py").is_file() else None


def config_procedure(path: Path, recipe: str | None = None) -> tuple[Procedure, str | None]:
    """The procedure that trains the config at ``path``: recipe ``recipe``'s, else the shipped recipe's whose
    ``configs/<recipe>/`` holds it; else the one its keys name, or, where they name none, the recipe's whose config
    it includes. The second value is the line that says so, unless an included recipe's config agrees with its
    keys."""
    name = recipe or shipped_recipe_of(path)
    if name is not None:
        return recipe_procedure(name), None
    given = keys_set(read_yaml_config(Path(path), problems=[]))
    keyed = _named_by(given)
    included = next(filter(None, map(shipped_recipe_of, config_files(Path(path))[1:])), None)
    if included is not None:
        base = recipe_procedure(included)
        if keyed in (base, SFT_PROCEDURE):  # its keys agree, or name nothing: the included recipe's
            return base, None
    keys = [key for key in keyed.recognised_by if key in given]
    why = f"it sets {', '.join(keys)}" if keys else "it sets no key of another procedure"
    return keyed, (
        f"{path}: taken for the {keyed.about} recipes ({why}); pass --recipe NAME (a name `fsdp-peft ls` lists) "
        "to take it for the recipe you will launch it with"
    )


def plan_config(
    path: Path,
    world_size: int | None,
    gpu_memory: int,
    low_memory_loading: bool | None = None,
    offload_params: bool | None = None,
    recipe: str | None = None,
) -> MemoryPlan:
    """`fsdp_peft.tools.plan.plan_memory` of the config at ``path`` for the procedure that trains it
    (`config_procedure`), the line of a procedure found by keys among its notes."""
    procedure, recognised = config_procedure(path, recipe)
    plan = plan_memory(path, world_size, gpu_memory, low_memory_loading, offload_params, procedure=procedure)
    plan.notes += [recognised] if recognised else []
    return plan
