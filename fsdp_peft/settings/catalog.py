"""The shipped recipes and configs: where they live, one line about each, and copying one to edit.

Names are what ``fsdp-peft ls`` prints: a recipe by its file stem (``qwen_qlora``), a config by its path
under ``configs/`` (``llama_qlora/llama3_1_8b.yaml``). Recipes and configs live beside the package in
the source tree (``pip install -e .``), like the recipes' own default configs.
"""

from __future__ import annotations

import ast
import difflib
import shutil
from dataclasses import dataclass
from pathlib import Path

from fsdp_peft.core.errors import ConfigError

SOURCE_TREE = Path(__file__).resolve().parents[2]
RECIPES = SOURCE_TREE / "recipes"
CONFIGS = SOURCE_TREE / "configs"
CONFIG_SUFFIXES = (".yaml", ".sbatch")


@dataclass(frozen=True)
class Shipped:
    """One shipped recipe or config."""

    kind: str  # "recipe" or "config"
    name: str
    path: Path
    about: str


def _recipe_about(path: Path) -> str:
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    return docstring.strip().splitlines()[0] if docstring.strip() else ""


def _config_about(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("#") and not line.startswith(("#!", "#SBATCH")):
            return line.lstrip("#").strip()
    return ""


def shipped() -> list[Shipped]:
    """Every recipe, then every config, sorted by name."""
    if not RECIPES.is_dir() or not CONFIGS.is_dir():
        raise ConfigError(
            f"recipes/ and configs/ not found beside the package in {SOURCE_TREE}; they ship with the source "
            "tree: install fsdp-peft from a checkout with `pip install -e .`"
        )
    recipes = [Shipped("recipe", p.stem, p, _recipe_about(p)) for p in sorted(RECIPES.glob("*.py"))]
    configs = [
        Shipped("config", p.relative_to(CONFIGS).as_posix(), p, _config_about(p))
        for p in sorted(CONFIGS.rglob("*"))
        if p.is_file() and p.suffix in CONFIG_SUFFIXES
    ]
    return recipes + configs


def find_shipped(name: str) -> Shipped:
    """The recipe or config called ``name`` (``recipes/`` or ``configs/`` prefixes, ``.py`` and a config's
    suffix may be left out: ``llama_qlora/tiny`` is ``llama_qlora/tiny.yaml``, as ``tune cp`` reads names)."""
    everything = shipped()
    wanted = name.removeprefix("recipes/").removeprefix("configs/").removesuffix(".py")
    for entry in everything:
        if entry.name == wanted:
            return entry
    for entry in everything:
        if entry.kind == "config" and entry.name.rsplit(".", 1)[0] == wanted:
            return entry
    close = difflib.get_close_matches(wanted, [e.name for e in everything], n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'?" if close else "run `fsdp-peft ls` for the names"
    raise ConfigError(f"NAME: no recipe or config called '{name}'; {hint}")


def shipped_config(name: str) -> Path | None:
    """The shipped config file ``configs/<name>``, if there is one."""
    path = CONFIGS / name
    return path if path.is_file() else None


def copy_shipped(name: str, destination: Path) -> Path:
    """Copy recipe or config ``name`` to ``destination`` (a new file, or into an existing directory)."""
    entry = find_shipped(name)
    target = destination / entry.path.name if destination.is_dir() else destination
    if target.exists():
        raise ConfigError(f"DEST: {target} already exists; cp never overwrites: choose another DEST or remove it first")
    if not target.parent.is_dir():
        raise ConfigError(f"DEST: directory not found: {target.parent}; create it first")
    shutil.copyfile(entry.path, target)
    return target
