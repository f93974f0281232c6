"""The ``fsdp-peft`` command: tools around the recipes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdp_peft.errors import ConfigError, exits_cleanly_on_user_error


def _validate(args: argparse.Namespace) -> None:
    from fsdp_peft.config import parse_recipe_config

    parse_recipe_config(["--config", str(args.config)], args.config, "outputs/validate")
    print(f"{args.config}: ok")


def _tiny(args: argparse.Namespace) -> None:
    from fsdp_peft.tiny import tiny_model_path

    print(tiny_model_path())


@exits_cleanly_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fsdp-peft", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser("validate", help="check a recipe YAML without loading any weights")
    validate.add_argument("config", type=Path)
    validate.set_defaults(run=_validate)
    tiny = commands.add_parser("tiny-model", help="build the embedded tiny model (once) and print its path")
    tiny.set_defaults(run=_tiny)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.run(args)


__all__ = ["main", "ConfigError"]
