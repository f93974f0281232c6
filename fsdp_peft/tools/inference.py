"""``fsdp-peft generate``: completions from a trained adapter or a merged model, sharded when launched so.

Sources: a merged model directory (what ``fsdp-peft export`` writes, or any Hugging Face model
directory), or anything ``fsdp-peft export`` reads (adapter directory, Trainer checkpoint with sharded
FSDP state, training ``output_dir``). An adapter is loaded onto its base the way the recipe trained it
(same dtype, 4-bit when it was QLoRA), from the recipe saved next to it.

Under ``accelerate launch`` / ``torchrun`` with several processes, every rank loads the model, FSDP2
shards it (`fsdp_peft.parallel.fsdp_policies.shard_for_generation`) and generation runs on the sharded model with
the prompts spread over the ranks; rank 0 prints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import get_peft_config, set_peft_model_state_dict
from transformers import AutoConfig, AutoTokenizer, TextStreamer, set_seed

from fsdp_peft.core._compat.peft_patches import peft_wrapped
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import logger
from fsdp_peft.data.templates import render_prompt
from fsdp_peft.data.vision_rows import open_image, processor_inputs
from fsdp_peft.model.adapter_files import ADAPTER_SOURCES, RECIPE_FILE, check_trained_base, find_adapter, resolve_base
from fsdp_peft.model.model_record import record_of
from fsdp_peft.model.modeling import (
    bf16_products_prepared,
    disable_cpu_weight_repacking,
    load_base_model,
    local_device,
)
from fsdp_peft.model.moe_quantization import dequantize_in_forward
from fsdp_peft.model.new_tokens import grow_vocabulary, tokenizer_directory
from fsdp_peft.model.tiny_vision import load_processor
from fsdp_peft.model.variants import init_reads_base_weights
from fsdp_peft.model.vision import auto_model_class, is_vision_config, vision_runs_on_every_rank
from fsdp_peft.parallel.fsdp_policies import shard_for_generation
from fsdp_peft.settings.config import RecipeArguments
from fsdp_peft.tools.decoding import graphs_compiled
from fsdp_peft.tools.generation import GenerationSettings, generate_completions

MERGED_SOURCE = "a merged model directory (config.json + *.safetensors)"


@dataclass
class LoadedModel:
    """A model ready to generate, its tokenizer, and whether its recipe rendered prompts as chat."""

    model: torch.nn.Module
    tokenizer: object
    chat: bool | None
    description: str
    base_dir: Path | None = None  # an adapter's base model directory (None: a merged model)
    adapter_dir: Path | None = None  # the adapter loaded onto it (None: a merged model, or the base alone)


def is_merged_model_dir(source: Path) -> bool:
    return (
        (source / "config.json").is_file()
        and not (source / "adapter_config.json").is_file()
        and any(source.glob("*.safetensors"))
    )


def load_for_generation(
    source: Path, base: str | None, device: torch.device, allow_base_mismatch: bool = False, base_only: bool = False
) -> LoadedModel:
    """Load ``source`` (merged directory or adapter source) on ``device``; `ConfigError` for anything else.

    An adapter's recorded base is checked against the one it is loaded onto (`check_trained_base`).
    ``base_only``: that base as the recipe trained on it (same dtype, 4-bit for QLoRA), without the adapter.
    """
    source = Path(source)
    if not source.exists():
        raise ConfigError(f"SOURCE: {source} does not exist")
    if is_merged_model_dir(source):
        if base is not None:
            raise ConfigError(f"--base: {source} is a merged model and needs no base; drop --base")
        if base_only:
            raise ConfigError(
                f"--base-only: {source} is a merged model, with no adapter to leave out; give its base model "
                "directory as SOURCE instead"
            )
        auto_class = auto_model_class(AutoConfig.from_pretrained(source))
        model = auto_class.from_pretrained(source, dtype="auto", device_map={"": device})
        if device.type == "cpu":
            bf16_products_prepared(model)
        recipe = json.loads((source / RECIPE_FILE).read_text()) if (source / RECIPE_FILE).is_file() else {}
        chat = recipe.get("use_chat_template")
        return LoadedModel(model, _tokenizer(AutoTokenizer.from_pretrained(source)), chat, f"merged model {source}")
    try:
        adapter = find_adapter(source)
    except ConfigError as error:
        if "is none of" in str(error):
            raise ConfigError(f"SOURCE: {source} is none of: {MERGED_SOURCE}, {ADAPTER_SOURCES}") from None
        raise
    base_dir = resolve_base(adapter, base)
    check_trained_base(adapter, base_dir, allow_base_mismatch)
    known = {f.name for f in dataclasses.fields(RecipeArguments)}
    recipe = RecipeArguments(**{k: v for k, v in adapter.recipe.items() if k in known})
    recipe.model_name_or_path = str(base_dir)
    if init_reads_base_weights(recipe.init_lora_weights):  # converted for the original base: load that, unquantized
        recipe.init_lora_weights, recipe.load_in_4bit = "default", False
    tokenizer = _tokenizer(AutoTokenizer.from_pretrained(tokenizer_directory(adapter.origin, base_dir)))
    model = grow_vocabulary(load_base_model(recipe), tokenizer, recipe)
    chat = recipe.use_chat_template if adapter.recipe else None
    if base_only:  # as the recipe's forward ran it: 4-bit experts dequantized per forward, no CPU repacking
        dequantize_in_forward(record_of(model).quantized_experts)
        if model.device.type == "cpu":
            disable_cpu_weight_repacking(model)
        return LoadedModel(model.eval(), tokenizer, chat, f"base {base_dir} of adapter {adapter.origin}", base_dir)
    model = attach_trained_adapter(model, adapter)
    return LoadedModel(model, tokenizer, chat, f"adapter {adapter.origin} on {base_dir}", base_dir, adapter.origin)


def _tokenizer(tokenizer):
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def attach_trained_adapter(model, adapter):
    """Wrap ``model`` in the adapter's LoRA layers and load its tensors, frozen; every tensor must find its place."""
    config = get_peft_config({k: v for k, v in adapter.config.items() if k != "base_model_name_or_path"})
    peft_model = peft_wrapped(model, config, autocast_adapter_dtype=False)
    dequantize_in_forward(record_of(model).quantized_experts)  # 4-bit experts (fsdp_peft.model.moe_quantization)
    result = set_peft_model_state_dict(peft_model, adapter.tensors)
    if result.unexpected_keys:
        raise ConfigError(
            f"{adapter.origin}: {len(result.unexpected_keys)} adapter tensors match no module of the base "
            f"(e.g. {result.unexpected_keys[0]}); is --base the model it was trained on?"
        )
    if model.device.type == "cpu":
        disable_cpu_weight_repacking(peft_model)
    # loaded for inference: nothing trains it, so each generation call's merged weights are kept for the next
    # (`fsdp_peft.tools.generation.adapters_merged`)
    return peft_model.requires_grad_(False).eval()


def read_prompts(prompts: list[str] | None, prompts_file: Path | None) -> list[str]:
    """``--prompt`` values, else the lines (or JSONL ``prompt`` fields) of ``--prompts-file``, else stdin."""
    if prompts:
        return prompts
    if prompts_file is not None:
        if not prompts_file.is_file():
            raise ConfigError(f"--prompts-file: file not found: {prompts_file}")
        lines, where = prompts_file.read_text().splitlines(), str(prompts_file)
    elif sys.stdin.isatty():
        raise ConfigError(
            "no prompts: give --prompt TEXT, --prompts-file FILE, or pipe prompts on stdin (one per line)"
        )
    else:
        lines, where = sys.stdin.read().splitlines(), "stdin"
    if where.endswith(".jsonl"):
        texts = []
        for number, line in enumerate(lines, 1):
            row = json.loads(line) if line.strip() else {}
            if line.strip() and not isinstance(row.get("prompt"), str):
                raise ConfigError(f"{where}: row {number} has no string 'prompt' field")
            texts.append(row.get("prompt", ""))
        lines = texts
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ConfigError(f"{where}: no prompts (empty lines are skipped)")
    return prompts


def read_images(paths: list[Path], prompts: int) -> list[Path]:
    """``--image`` files checked before any weights load: one for every prompt, or one per prompt."""
    for path in paths:
        if not Path(path).is_file():
            raise ConfigError(f"--image: file not found: {path}")
        try:
            open_image(str(path))
        except OSError as error:
            raise ConfigError(f"--image: {path} cannot be read as an image ({error})") from None
    if len(paths) not in (0, 1, prompts):
        raise ConfigError(f"--image: {len(paths)} images for {prompts} prompts; give one, or one per prompt")
    return [str(p) for p in paths] * (prompts if len(paths) == 1 else 1)


def timed_calls(model, tokenizer, texts: list, settings, device, encode, calls: int) -> dict:
    """``calls`` more generation calls of ``texts`` after the first, each completion exactly
    ``settings.max_new_tokens`` tokens (EOS held off): tokens a second over them, and how many graphs were compiled
    (`fsdp_peft.tools.decoding`). Collective, as generation is."""
    timed = dataclasses.replace(settings, ignore_eos=True)
    start = time.perf_counter()
    for _ in range(calls):
        generate_completions(model, tokenizer, texts, timed, device, encode=encode)
    seconds = (time.perf_counter() - start) / calls
    tokens = len(texts) * settings.max_new_tokens
    return {
        "prompts": len(texts),
        "new_tokens": settings.max_new_tokens,
        "calls": calls,
        "seconds_per_call": seconds,
        "tokens_per_second": tokens / seconds,
        "graphs_compiled": graphs_compiled(),
    }


def timing_line(timing: dict) -> str:
    return (
        f"generation: {timing['tokens_per_second']:.1f} tokens/s ({timing['prompts']} prompts x "
        f"{timing['new_tokens']} new tokens, {timing['seconds_per_call']:.3f} s per call over {timing['calls']} "
        f"calls after the first, which took {timing['first_call_seconds']:.1f} s; {timing['graphs_compiled']} graphs "
        "compiled)"
    )


def image_prompt(processor, prompt: str) -> str:
    """``prompt`` as the user's turn with an image before it, in the processor's chat template."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def run_generate(args) -> None:
    """The ``generate`` command: load, (shard), generate, print on rank 0."""
    if args.greedy and (args.temperature is not None or args.top_p is not None):
        raise ConfigError("--greedy and --temperature/--top-p exclude each other: drop --greedy to sample")
    if getattr(args, "timed_calls", 0) < 0:
        raise ConfigError(f"--timed-calls: {args.timed_calls} is negative; give 0 (no timing) or more calls")
    prompts = read_prompts(args.prompt, args.prompts_file)
    images = read_images(getattr(args, "image", None) or [], len(prompts))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = local_device()
    set_seed(args.seed)
    loaded = load_for_generation(args.source, args.base, device, args.allow_base_mismatch)
    vision = is_vision_config(loaded.model.config)
    if images and not vision:
        raise ConfigError(f"--image: {args.source} is a text-only model; give --image to a vision-language model")
    if vision:  # a rank whose prompts have no image still runs the tower (fsdp_peft.model.vision)
        vision_runs_on_every_rank(loaded.model)
    if world > 1:
        shard_for_generation(loaded.model, device)
    where = f", sharded over {world} ranks" if world > 1 else ""
    logger.info(f"generating from {loaded.description}{where}")
    chat = args.chat if args.chat is not None else bool(loaded.chat)
    encode = None
    if images:  # the processor renders each prompt with its image part and makes the image's inputs
        processor = load_processor(loaded.base_dir or args.source)
        texts = [(image_prompt(processor, prompt), image) for prompt, image in zip(prompts, images)]

        def encode(batch):
            processor.tokenizer.padding_side = "left"
            return processor_inputs(processor, [t for t, _ in batch], [[open_image(i)] for _, i in batch])
    else:
        texts = [render_prompt(loaded.tokenizer, prompt, chat) for prompt in prompts]
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        do_sample=args.temperature is not None or args.top_p is not None,
        temperature=args.temperature if args.temperature is not None else 1.0,
        top_p=args.top_p if args.top_p is not None else 1.0,
        gather_budget=args.gather_budget,
        merged_adapter=not args.unmerged_adapter,
        compiled=args.compiled,
    )
    stream = len(prompts) == 1 and not args.json
    streamer = TextStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    first_call = time.perf_counter()
    completions = generate_completions(
        loaded.model, loaded.tokenizer, texts, settings, device, streamer=streamer, encode=encode
    )
    first_call = time.perf_counter() - first_call
    if completions is not None:
        for prompt, completion in zip(prompts, completions):
            if args.json:
                print(json.dumps({"prompt": prompt, "completion": completion}), flush=True)
            elif not stream:
                print(f">>> {prompt}\n{completion}\n", flush=True)
    if getattr(args, "timed_calls", 0):
        timing = timed_calls(loaded.model, loaded.tokenizer, texts, settings, device, encode, args.timed_calls)
        timing["first_call_seconds"] = first_call
        if completions is not None:
            print(json.dumps({"timing": timing}) if args.json else timing_line(timing), flush=True)
