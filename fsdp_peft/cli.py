"""The ``fsdp-peft`` command: tools around the recipes."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from pathlib import Path

from fsdp_peft.core.errors import ConfigError, exits_cleanly_on_user_error
from fsdp_peft.core.unreachable_hub import hub_data_out_of_reach_noted
from fsdp_peft.settings.catalog import copy_shipped, shipped
from fsdp_peft.settings.choices import (
    COMPILED_CHOICES,
    COMPILED_DECODING_HELP,
    GATHER_BUDGET_HELP,
    OFFLINE_MODEL_NAMES,
    TINY_COLORS_NAME,
    TINY_MODEL_NAME,
    UNMERGED_ADAPTER_HELP,
)

CATALOG_COMMANDS = ("ls", "cp")  # need neither torch nor transformers, so they answer at once
DESCRIPTION = "tools around the fsdp-peft recipes: list, copy, check and plan configs; export, generate, evaluate"
CONFIG_HELP = "the recipe YAML to check (a path, e.g. from `fsdp-peft cp`)"  # --help is plain text, not reST
RECIPE_HELP = (
    "the recipe you will launch the config with (e.g. llama_dpo): its procedure's rules and memory; default: the "
    "recipe of configs/<recipe>/, else the procedure the config's keys name, else the recipe of a config it includes"
)
ALLOW_BASE_MISMATCH_HELP = "use an adapter on a base other than the one it records (architecture, config); warns"


def _list(args: argparse.Namespace) -> None:
    entries = shipped()
    width = max(len(entry.name) for entry in entries)
    for entry in entries:
        print(f"{entry.kind:<6}  {entry.name:<{width}}  {entry.about}")


def _copy(args: argparse.Namespace) -> None:
    target = copy_shipped(args.name, args.dest)
    print(f"copied {args.name} to {target}")


def launcher_environment(accelerate_config: Path) -> dict[str, str]:
    """The variables ``accelerate launch --config_file accelerate_config`` gives each rank, plus
    ``WORLD_SIZE``: what the FSDP rules read, derived by accelerate's own launch code."""
    from accelerate.commands.launch import (
        _validate_launch_command,
        launch_command_parser,
    )  # lazy: ls/cp must not import torch
    from accelerate.utils.launch import prepare_multi_gpu_env  # lazy: ls/cp must not import torch

    if not accelerate_config.is_file():
        raise ConfigError(f"--accelerate-config: file not found: {accelerate_config}")
    launch_args = launch_command_parser().parse_args(["--config_file", str(accelerate_config), "recipe.py"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            launch_args, _, _ = _validate_launch_command(launch_args)
            launch_args.main_process_port = 0  # a free port: nothing is launched, nothing may collide
            environment = prepare_multi_gpu_env(launch_args)
    except (ValueError, TypeError, KeyError) as error:
        raise ConfigError(f"{accelerate_config}: not a valid accelerate config: {error}") from None
    changed = {key: value for key, value in environment.items() if os.environ.get(key) != value}
    return {**changed, "WORLD_SIZE": str(launch_args.num_processes)}


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _validate(args: argparse.Namespace) -> None:
    """The rules see the launch (world size included) and the procedure of the recipe the config is for; then
    ``TrainingArguments`` is built in this one process, as it would refuse to start a process group of several ranks
    here."""
    from fsdp_peft.procedures.registry import check_config, config_procedure  # lazy: ls/cp must not import torch
    from fsdp_peft.settings.config import (  # lazy: ls/cp must not import torch
        build_training_arguments,
        resolve_recipe_config,
    )

    launcher = launcher_environment(args.accelerate_config) if args.accelerate_config else {}
    unreadable: list[str] = []  # unknown keys and unreadable values: listed with every other problem
    argv = ["--config", str(args.config)]
    recipe, training_values, options = resolve_recipe_config(argv, args.config, "outputs", unreadable)
    procedure, recognised = config_procedure(args.config, args.recipe)
    if recognised:
        print(recognised, file=sys.stderr)
    with _environment(launcher), hub_data_out_of_reach_noted():
        try:
            check_config(procedure.with_defaults(recipe), training_values, procedure, with_model_structure=True)
        except ConfigError as problems:
            raise ConfigError("\n       ".join([*unreadable, str(problems)])) from None
        if unreadable:
            raise ConfigError("\n       ".join(unreadable))
    with _environment({k: v for k, v in launcher.items() if k != "WORLD_SIZE"}):
        build_training_arguments(training_values, options.config)
    print(f"{args.config}: ok" + (f" under {args.accelerate_config}" if args.accelerate_config else ""))


def _export(args: argparse.Namespace) -> None:
    from fsdp_peft.tools.export import export_merged  # lazy: ls/cp must not import torch

    out = export_merged(
        args.source,
        args.out,
        base=args.base,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        base_variant=args.base_variant,
        overwrite=args.overwrite,
        verify=args.verify,
        allow_base_mismatch=args.allow_base_mismatch,
        force_base_variant=args.force_base_variant,
    )
    print(f"merged model written to {out}")


def _generate(args: argparse.Namespace) -> None:
    from fsdp_peft.core.distributed import (  # lazy: ls/cp must not import torch
        release_process_group,
        start_process_group,
    )
    from fsdp_peft.tools.inference import run_generate  # lazy: ls/cp must not import torch

    start_process_group()
    try:
        run_generate(args)
    finally:
        release_process_group()


def _eval(args: argparse.Namespace) -> None:
    from fsdp_peft.tools.evaluation import run_eval  # lazy: ls/cp must not import torch (nor the harness)

    run_eval(args)  # checks the tasks before it joins the process group


def _plan(args: argparse.Namespace) -> None:
    """Estimate per-GPU and host memory of a recipe config from the model config alone (no weights)."""
    from fsdp_peft.core.safetensors_io import parse_size  # lazy: ls/cp must not import torch
    from fsdp_peft.procedures.registry import plan_config  # lazy: ls/cp must not import torch
    from fsdp_peft.tools.plan import format_plan  # lazy: ls/cp must not import torch

    launcher = launcher_environment(args.accelerate_config) if args.accelerate_config else {}
    size = parse_size(args.gpu_memory, "--gpu-memory")
    with _environment(launcher):
        plan = plan_config(args.config, args.gpus, size, args.low_memory_loading, args.offload, args.recipe)
    source = args.accelerate_config or "the recipe YAML"  # a flag overrides either, as accelerate launch's would
    assumed = []
    for name, flag, on, given in (
        ("low-memory loading", "low-memory-loading", plan.low_memory_loading, args.low_memory_loading),
        ("offload", "offload", plan.offload_params, args.offload),
    ):
        origin = source if given is None else f"--{'' if given else 'no-'}{flag}"
        assumed.append(f"{name} {'on' if on else 'off'} (from {origin})")
    plan.notes.append("assumed: " + ", ".join(assumed))
    print(json.dumps(plan.to_json(), indent=1) if args.json else format_plan(plan))
    if not plan.fits:
        sys.exit(1)  # scripts can branch on the verdict; user errors exit 2


def _tiny(args: argparse.Namespace) -> None:
    from fsdp_peft.model.paths import resolve_model_path, tiny_colors_path  # lazy: ls/cp must not import torch

    print(tiny_colors_path() if args.name == TINY_COLORS_NAME else resolve_model_path(args.name))


@exits_cleanly_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fsdp-peft", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("ls", help="list the shipped recipes and configs, one line each")
    listing.set_defaults(run=_list)
    copy = commands.add_parser("cp", help="copy a shipped recipe or config to edit (never overwrites)")
    copy.add_argument("name", help="a name as `fsdp-peft ls` prints it, e.g. llama_qlora/llama3_1_8b.yaml")
    copy.add_argument("dest", type=Path, help="new file, or an existing directory to copy into")
    copy.set_defaults(run=_copy)
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in CATALOG_COMMANDS:
        _add_model_commands(commands)
    args = parser.parse_args(argv)
    if args.command not in CATALOG_COMMANDS:
        from fsdp_peft.core._compat.gate import check_upstream  # lazy: ls/cp must not import torch
        from fsdp_peft.core.log import configure_logging, loading_bars_hidden  # lazy: ls/cp must not import torch

        configure_logging(stream="stderr")  # stdout is the command's output (completions, plans, listings)
        try:
            check_upstream()
            with loading_bars_hidden():
                args.run(args)
        finally:
            configure_logging()  # back to the library's default, for callers of main() in one process
        return
    args.run(args)


def _add_model_commands(commands) -> None:
    """The commands that read configs and models; their parsers import nothing heavy, so --help answers at once."""
    validate = commands.add_parser(
        "validate", help="check a recipe YAML without loading any weights; every problem at once"
    )
    validate.add_argument("config", type=Path, help=CONFIG_HELP)
    validate.add_argument(
        "--accelerate-config",
        type=Path,
        metavar="FILE",
        help="also check the FSDP settings of this accelerate config, as `accelerate launch` would pass them",
    )
    validate.add_argument("--recipe", metavar="NAME", help=RECIPE_HELP)
    validate.set_defaults(run=_validate)
    plan = commands.add_parser(
        "plan",
        help="estimate per-GPU and host memory of a recipe config and whether it fits (exit 1 if not); "
        "no weights loaded",
    )
    plan.add_argument("config", type=Path, help="the recipe YAML to plan (a path, e.g. from `fsdp-peft cp`)")
    plan.add_argument("--gpus", type=int, metavar="N", help="GPUs (ranks); default: the accelerate config's, else 1")
    plan.add_argument("--gpu-memory", default="80GiB", metavar="SIZE", help="memory of one GPU, e.g. 24GiB or 80GB")
    plan.add_argument(
        "--accelerate-config",
        type=Path,
        metavar="FILE",
        help="read FSDP settings (offload, activation checkpointing, loading) and world size from this "
        "accelerate config",
    )
    plan.add_argument(
        "--low-memory-loading",
        action=argparse.BooleanOptionalAction,
        help="plan with fsdp_cpu_ram_efficient_loading on (rank 0 reads, each GPU receives its shards) or off; "
        "default: as the accelerate config or recipe YAML says",
    )
    plan.add_argument(
        "--offload",
        action=argparse.BooleanOptionalAction,
        help="plan with fsdp_offload_params on or off; default: as the accelerate config or recipe YAML says",
    )
    plan.add_argument("--recipe", metavar="NAME", help=RECIPE_HELP)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(run=_plan)
    export = commands.add_parser("export", help="merge an adapter into its base and write full weights")
    export.add_argument("source", type=Path, help="adapter directory, Trainer checkpoint, or training output_dir")
    export.add_argument("--out", type=Path, required=True, help="directory to create")
    export.add_argument("--base", help="base model (hub id or directory); default: the adapter's own")
    export.add_argument(
        "--dtype", default="bf16", help="dtype of the merged weights: bf16, fp16 or fp32 (or bfloat16, ...)"
    )
    export.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB or 500MB")
    export.add_argument(
        "--base-variant",
        default="exact",
        choices=["exact", "nf4"],
        help="merge onto the exact 16-bit base, or onto its NF4 round trip (what QLoRA training saw)",
    )
    export.add_argument(
        "--force-base-variant",
        action="store_true",
        help="with --base-variant nf4: merge an adapter trained on the 16-bit base onto the NF4 round trip anyway",
    )
    export.add_argument("--allow-base-mismatch", action="store_true", help=ALLOW_BASE_MISMATCH_HELP)
    export.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    export.add_argument("--verify", action="store_true", help="reload the export and compare logits")
    export.set_defaults(run=_export)
    generate = commands.add_parser(
        "generate", help="complete prompts with a trained adapter or merged model (sharded under accelerate launch)"
    )
    generate.add_argument(
        "source",
        type=Path,
        help="merged model directory, adapter directory, Trainer checkpoint, or training output_dir",
    )
    generate.add_argument("--base", help="base model for an adapter (hub id or directory); default: the adapter's own")
    generate.add_argument("--allow-base-mismatch", action="store_true", help=ALLOW_BASE_MISMATCH_HELP)
    prompts = generate.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", nargs="+", action="extend", metavar="TEXT", help="prompt(s) to complete")
    prompts.add_argument("--prompts-file", type=Path, metavar="F", help="one prompt per line, or JSONL with 'prompt'")
    generate.add_argument(
        "--image",
        type=Path,
        nargs="+",
        action="extend",
        metavar="FILE",
        help="vision-language model: the image for every prompt, or one per prompt (docs/vision.md)",
    )
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
    generate.add_argument("--unmerged-adapter", action="store_true", help=UNMERGED_ADAPTER_HELP)
    generate.add_argument("--compiled", choices=COMPILED_CHOICES, default="auto", help=COMPILED_DECODING_HELP)
    generate.add_argument("--json", action="store_true", help="print one JSON line per prompt: prompt, completion")
    generate.add_argument(
        "--timed-calls",
        type=int,
        default=0,
        metavar="N",
        help="after the completions, time N more calls of the same prompts, each completion exactly --max-new-tokens "
        "tokens, and print tokens per second (the first call, which compiles, apart; with --json a 'timing' line)",
    )
    generate.set_defaults(run=_generate)
    evaluate = commands.add_parser(
        "eval",
        help="lm-evaluation-harness tasks on an adapter, checkpoint or merged model (sharded under accelerate launch)",
    )
    evaluate.add_argument(
        "source",
        type=Path,
        help="merged model directory, adapter directory, Trainer checkpoint, or training output_dir",
    )
    evaluate.add_argument(
        "--tasks",
        required=True,
        metavar="T[,T...]",
        help="harness tasks, groups or tags (comma-separated), or task YAML files; shipped: tiny_reverse_em, "
        "tiny_reverse_ll (tag tiny_reverse)",
    )
    evaluate.add_argument(
        "--include-path", type=Path, action="append", metavar="DIR", help="a directory of your own task YAMLs"
    )
    evaluate.add_argument("--limit", type=int, metavar="N", help="the first N documents of each task")
    evaluate.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="where results go; default: inside the run, SOURCE/eval (OUTPUT_DIR/eval/NAME for a run's adapter/ or "
        "checkpoint-N/; .../base-only with --base-only), never the current directory",
    )
    evaluate.add_argument(
        "--base-only", action="store_true", help="evaluate the adapter's base alone (the before of a before/after)"
    )
    evaluate.add_argument("--base", help="base model for an adapter (hub id or directory); default: the adapter's own")
    evaluate.add_argument("--allow-base-mismatch", action="store_true", help=ALLOW_BASE_MISMATCH_HELP)
    eval_chat = evaluate.add_mutually_exclusive_group()
    eval_chat.add_argument("--chat", action="store_true", default=None, help="render prompts with the chat template")
    eval_chat.add_argument("--no-chat", dest="chat", action="store_false", help="use the tasks' prompts as raw text")
    evaluate.add_argument("--max-gen-toks", type=int, metavar="N", help="new tokens of every generate_until task")
    evaluate.add_argument("--batch-size", type=int, default=32, help="requests per forward or generate call per rank")
    evaluate.add_argument("--gather-budget", default="auto", help=f"FSDP2 weights kept gathered: {GATHER_BUDGET_HELP}")
    evaluate.add_argument("--unmerged-adapter", action="store_true", help=UNMERGED_ADAPTER_HELP)
    evaluate.add_argument("--compiled", choices=COMPILED_CHOICES, default="auto", help=COMPILED_DECODING_HELP)
    evaluate.set_defaults(run=_eval)
    tiny = commands.add_parser(
        "tiny-model",
        help="build an embedded tiny model, SmolLM2-135M-Instruct or the image task tiny-colors (once); print its path",
    )
    # every name a config's model_name_or_path (or a vision recipe's dataset) may give, so each can be inspected
    tiny.add_argument(
        "name",
        nargs="?",
        default=TINY_MODEL_NAME,
        choices=[*OFFLINE_MODEL_NAMES, TINY_COLORS_NAME],
        help=f"a model that needs no hub, or {TINY_COLORS_NAME} (the image task); default: {TINY_MODEL_NAME}",
    )
    tiny.set_defaults(run=_tiny)


__all__ = ["main", "ConfigError"]


if __name__ == "__main__":
    main()
