"""The ``fsdp-peft`` command: tools around the recipes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdp_peft.config import GATHER_BUDGET_HELP
from fsdp_peft.errors import ConfigError, exits_cleanly_on_user_error
from fsdp_peft.export import OUTPUT_DTYPES


def _validate(args: argparse.Namespace) -> None:
    from fsdp_peft.config import parse_recipe_config

    parse_recipe_config(["--config", str(args.config)], args.config, "outputs/validate")
    print(f"{args.config}: ok")


def _export(args: argparse.Namespace) -> None:
    from fsdp_peft.export import export_merged

    out = export_merged(
        args.source, args.out, base=args.base, dtype=args.dtype, max_shard_size=args.max_shard_size,
        base_variant=args.base_variant, overwrite=args.overwrite, verify=args.verify,
    )  # fmt: skip
    print(f"merged model written to {out}")


def _generate(args: argparse.Namespace) -> None:
    from fsdp_peft.inference import run_generate

    run_generate(args)


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
    export = commands.add_parser("export", help="merge an adapter into its base and write full weights")
    export.add_argument("source", type=Path, help="adapter directory, Trainer checkpoint, or training output_dir")
    export.add_argument("--out", type=Path, required=True, help="directory to create")
    export.add_argument("--base", help="base model (hub id or directory); default: the adapter's own")
    export.add_argument("--dtype", default="bf16", choices=list(OUTPUT_DTYPES))
    export.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB or 500MB")
    export.add_argument(
        "--base-variant", default="exact", choices=["exact", "nf4"],
        help="merge onto the exact 16-bit base, or onto its NF4 round trip (what QLoRA training saw)",
    )  # fmt: skip
    export.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    export.add_argument("--verify", action="store_true", help="reload the export and compare logits")
    export.set_defaults(run=_export)
    generate = commands.add_parser(
        "generate", help="complete prompts with a trained adapter or merged model (sharded under accelerate launch)"
    )
    generate.add_argument(
        "source", type=Path, help="merged model directory, adapter directory, Trainer checkpoint, or training output_dir"
    )
    generate.add_argument("--base", help="base model for an adapter (hub id or directory); default: the adapter's own")
    prompts = generate.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", nargs="+", action="extend", metavar="TEXT", help="prompt(s) to complete")
    prompts.add_argument("--prompts-file", type=Path, metavar="F", help="one prompt per line, or JSONL with 'prompt'")
    generate.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    generate.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
    generate.add_argument("--temperature", type=float, metavar="T", help="sample with this temperature")
    generate.add_argument("--top-p", type=float, metavar="P", help="sample from the top-p nucleus")
    generate.add_argument("--seed", type=int, default=0, help="seed for sampling")
    chat = generate.add_mutually_exclusive_group()
    chat.add_argument("--chat", action="store_true", default=None, help="render prompts with the chat template")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="use prompts as raw text")
    generate.add_argument("--batch-size", type=int, default=8, help="prompts per generate call on each rank")
    generate.add_argument("--gather-budget", default="auto", help=f"FSDP2 weights kept gathered: {GATHER_BUDGET_HELP}")
    generate.add_argument("--json", action="store_true", help="print one JSON line per prompt: prompt, completion")
    generate.set_defaults(run=_generate)
    tiny = commands.add_parser("tiny-model", help="build the embedded tiny model (once) and print its path")
    tiny.set_defaults(run=_tiny)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.run(args)


__all__ = ["main", "ConfigError"]


if __name__ == "__main__":
    main()
