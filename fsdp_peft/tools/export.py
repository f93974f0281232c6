"""Merged full-weight export: a base checkpoint plus a LoRA adapter, as a plain Hugging Face model directory.

The base safetensors are streamed tensor by tensor (plain reads, not memory maps: `fsdp_peft.core.safetensors_io`);
each adapted weight gets ``W + scale * B @ A`` (computed in fp32 in reused buffers, `fsdp_peft.model.merge`, rounded
once to the output dtype) and output shards are written as they fill by a thread, overlapping the next
tensor's read and merge. Peak host memory is a few tensors plus the adapter, whatever the model and shard
size. It imports torch, not transformers, peft or bitsandbytes (seconds of start-up each): config,
generation config and tokenizer files are copied from the base; transformers' config class is consulted only
when the base's config.json does not state every field the adapter's base record holds, and ``--verify`` and
``--base-variant nf4`` load what they need. The merge is
always onto the 16-bit base, never into re-quantized 4-bit weights; ``base_variant="nf4"`` instead
merges onto the NF4 round trip of the base, the weights a QLoRA adapter was trained against.

Sources: an adapter directory (PEFT format), a Trainer checkpoint holding sharded FSDP state
(``pytorch_model_fsdp_0/``), or a training ``output_dir`` (its final ``adapter/``, else its latest
checkpoint). The output appears only when complete (written beside it, then renamed); staging
directories of the same output left by a killed export are removed by the next export to it.

An adapter written by fsdp-peft records its base (``fsdp_peft_base.json``, `fsdp_peft.model.adapter_files`: the
adapter directory's format); export and generate refuse another base unless ``--allow-base-mismatch`` is
given, since tensor names and shapes alone can match across architectures.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import re
import shutil
import types
from pathlib import Path
from typing import Iterator

import torch
from tqdm.auto import tqdm

from fsdp_peft.core._compat.peft_patches import peft_wrapped
from fsdp_peft.core.atomic_publish import publish_directory
from fsdp_peft.core.dtypes import short_dtype_name
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import tell
from fsdp_peft.core.run_file_names import RESULTS_FILE
from fsdp_peft.core.safetensors_io import (
    SAFETENSORS_DTYPES,
    StreamingShardWriter,
    base_tensor_files,
    behind,
    parse_size,
    read_header,
    read_tensors,
)
from fsdp_peft.model.adapter_files import (
    RECIPE_FILE,
    Adapter,
    check_trained_base,
    find_adapter,
    read_json,
    resolve_base,
    trained_on_4bit,
)
from fsdp_peft.model.merge import Scratch, WeightUpdate
from fsdp_peft.model.moe import EXPERTS_MODULE
from fsdp_peft.model.moe_quantization import dequantize_expert_rows, layout_for, quantize_expert_rows
from fsdp_peft.model.new_tokens import grown_layout, read_new_tokens, write_grown_model_files
from fsdp_peft.model.paths import checkpoint_quantization
from fsdp_peft.model.vision import auto_model_class_name
from fsdp_peft.settings.families import FAMILIES, family_for
from fsdp_peft.settings.four_bit import BLOCKSIZE, FourBit

OUTPUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # by short name (dtypes.py)
WRITER_LOCK = ".fsdp_peft_writer.lock"
# Copied from the base next to the merged weights: generation config, tokenizer and processor files.
MODEL_SIDE_FILES = (
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "*.model",
    "*.tiktoken",
    "vocab*",
    "merges.txt",
    "chat_template*",
    "preprocessor_config.json",
    "processor_config.json",
)


def stored_names_as_loaded(files: dict[str, Path], base: Path) -> dict[str, str]:
    """``{stored key: the model's name}`` where a vision-language base stores its tensors under other names than
    its model's (the hub's older layout, `fsdp_peft.model.vision.names_as_loaded`): the adapter's names are the model's,
    the export keeps the base's (it loads wherever the base loads). Empty otherwise (read from config.json alone)."""
    config = base / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    vision = family_for(model_type).vision
    if vision is None or any(key.startswith(f"{vision.language_model}.") for key in files):
        return {}
    from fsdp_peft.model.vision import names_as_loaded  # lazy: transformers' model code, for hub-layout bases only

    return names_as_loaded(base, files)


def check_adapter_fits_base(updates: dict, files: dict[str, Path], adapter: Adapter, base: Path) -> None:
    """Every adapted weight exists in the base with matching shapes; raised before anything is written."""
    headers = {path: read_header(path) for path in {files[key] for key in updates if key in files}}
    for key, update in updates.items():
        if key not in files:
            raise ConfigError(
                f"adapter {adapter.origin} adapts '{key}', which base {base} does not have "
                "(different architecture, or the wrong --base)"
            )
        shape = tuple(headers[files[key]][key]["shape"])
        if update.grown is not None:  # new tokens: compared with the grown tensor
            shape = (update.grown.rows, *shape[1:])
        if update.replacement is not None:
            given, what = tuple(update.replacement.shape), "trained copy"
        elif update.lora_a is not None:
            given, what = update.delta_shape(), "B @ A"
            if update.lora_a.shape[0] != update.lora_b.shape[1]:
                given = ()
        elif update.token_rows is not None:
            given, what = (shape[0], update.token_rows.shape[1]), "trained token rows' width"
            if max(update.token_indices) >= shape[0]:
                given = ()
        else:
            continue  # only grown by new tokens
        if shape != given:
            raise ConfigError(
                f"adapter {adapter.origin}: '{key}' is {list(shape)} in base {base} but the adapter's "
                f"{what} is {list(given)} (wrong --base?)"
            )


def check_base_variant(adapter: Adapter, base_variant: str, force: bool = False) -> None:
    """``nf4`` reproduces the weights QLoRA trained against; for a 16-bit adapter it changes the model."""
    trained_4bit = trained_on_4bit(adapter)
    if base_variant != "nf4" or trained_4bit:
        return
    if trained_4bit is None:
        tell(
            f"note: --base-variant nf4: {adapter.origin} has no {RECIPE_FILE}, so whether it was trained on a "
            "4-bit base is unknown; merging onto the NF4 round trip, as asked"
        )
        return
    recorded = "load_in_4bit: false" if "load_in_4bit" in adapter.recipe else "no load_in_4bit"
    problem = f"adapter {adapter.origin} was trained on the 16-bit base (its {RECIPE_FILE} has {recorded})"
    if not force:
        raise ConfigError(
            f"--base-variant nf4: {problem}, so merging it onto NF4 weights changes the model it learned; "
            "use --base-variant exact, or add --force-base-variant to merge onto the NF4 round trip anyway"
        )
    tell(f"warning: --force-base-variant: {problem}; merging it onto the NF4 round trip of the base, as asked")


def staging_directories(out: Path) -> list[Path]:
    """The hidden staging directories `publish_directory` makes for ``out`` (``.<name>.partial.XXXXXXXX``)."""
    name = re.compile(rf"\.{re.escape(out.name)}\.partial\.[a-z0-9_]{{8}}")
    candidates = out.parent.glob(f".{glob.escape(out.name)}.partial.*")
    return sorted(path for path in candidates if name.fullmatch(path.name) and path.is_dir())


@contextlib.contextmanager
def writer_lock(staging: Path) -> Iterator[None]:
    """Hold an flock in ``staging`` while writing it: the kernel drops it when this process dies, however."""
    pending = staging / f"{WRITER_LOCK}.{os.getpid()}"
    with open(pending, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        os.rename(pending, staging / WRITER_LOCK)  # appears already locked: never seen unlocked while alive
        try:
            yield
        finally:
            (staging / WRITER_LOCK).unlink(missing_ok=True)  # not part of the output


def _remove_if_writer_died(staging: Path) -> int | None:
    """Bytes freed by removing ``staging`` when its writer is dead; None while it lives, or with no writer lock."""
    try:
        handle = open(staging / WRITER_LOCK)
    except OSError:
        return None  # no lock: an export about to publish, or a directory fsdp-peft did not mark
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        if not staging.is_dir():
            return None  # another export removed it meanwhile
        size = sum(path.stat().st_size for path in staging.rglob("*") if path.is_file())
        shutil.rmtree(staging)
        return size


def remove_stale_staging(out: Path) -> int:
    """Remove staging directories of ``out`` left by killed exports (each up to a whole model); bytes freed."""
    freed = {path.name: _remove_if_writer_died(path) for path in staging_directories(out)}
    removed = {name: size for name, size in freed.items() if size is not None}
    total = sum(removed.values())
    if removed:
        plural = "directory" if len(removed) == 1 else "directories"
        tell(
            f"[fsdp-peft] removed {len(removed)} stale staging {plural} of {out} left by an interrupted export "
            f"({', '.join(removed)}): freed {total} bytes ({total / 2**20:.1f} MiB)"
        )
    return total


def nf4_round_trip(weight: torch.Tensor, recipe: dict) -> torch.Tensor:
    """The weight as QLoRA training saw it: cast to the load dtype, 4-bit quantized, dequantized (a mixture of
    experts' ``[experts, out, in]`` weight: each expert on its own, `fsdp_peft.model.moe_quantization`)."""
    import bitsandbytes.functional as bnb_functional  # lazy: only --base-variant nf4 needs it (seconds to import)

    load_dtype = getattr(torch, recipe.get("torch_dtype", "bfloat16"))
    four_bit = FourBit.saved(recipe)
    if weight.dim() == 3:
        layout = layout_for(weight.shape, four_bit)
        rows = quantize_expert_rows(weight.to(load_dtype).contiguous(), layout)
        return dequantize_expert_rows(rows, layout, torch.float32)
    packed, state = bnb_functional.quantize_4bit(
        weight.to(load_dtype).contiguous(),
        blocksize=BLOCKSIZE,
        compress_statistics=four_bit.double_quant,
        quant_type=four_bit.quant_type,
        quant_storage=four_bit.storage,
    )
    return bnb_functional.dequantize_4bit(packed, state).to(torch.float32)


VISION_KEPT_16_BIT = tuple(
    f"{part}." for family in FAMILIES if family.vision for part in (family.vision.tower, family.vision.projector)
)


def is_quantized_in_training(key: str, tensor: torch.Tensor) -> bool:
    """bitsandbytes quantizes the linear layers inside decoder layers (2-D weights under ``layers.``), not a
    vision-language model's tower; QLoRA on a mixture of experts, its 3-D expert weights
    (`fsdp_peft.model.moe_quantization`)."""
    if tensor.dim() == 3:
        return f".{EXPERTS_MODULE}." in key
    if key.startswith(VISION_KEPT_16_BIT):  # a vision-language model's tower and projector (`fsdp_peft.model.vision`)
        return False
    return tensor.dim() == 2 and ".layers." in key and key.endswith(".weight")


def output_layout(base_files: dict[str, Path], out_dtype: torch.dtype) -> list[tuple[str, list[int], torch.dtype]]:
    """Key, shape and output dtype of every tensor, in the order `merged_tensors` yields them."""
    layout = []
    for path, keys in _keys_by_file(base_files).items():
        header = read_header(path)
        for key in keys:
            dtype = SAFETENSORS_DTYPES[header[key]["dtype"]]
            layout.append((key, header[key]["shape"], out_dtype if dtype.is_floating_point else dtype))
    return layout


def base_shapes(base_files: dict[str, Path]) -> dict[str, tuple]:
    """Every base tensor's shape, from the safetensors headers (nothing read beyond them)."""
    shapes = {}
    for path, keys in _keys_by_file(base_files).items():
        header = read_header(path)
        shapes.update((key, tuple(header[key]["shape"])) for key in keys)
    return shapes


def _keys_by_file(base_files: dict[str, Path]) -> dict[Path, list[str]]:
    by_file: dict[Path, list[str]] = {}
    for key, path in base_files.items():
        by_file.setdefault(path, []).append(key)
    return by_file


def merged_tensors(
    base_files: dict[str, Path],
    adapter: Adapter,
    updates: dict[str, WeightUpdate],
    base_variant: str,
    out_dtype: torch.dtype,
    progress: bool,
    loaded: dict[str, str],
):
    """Yield ``(key, merged tensor in out_dtype)`` for every base tensor, reading one tensor at a time (merged
    in fp32, rounded once; ``updates``: the adapter's, by base key; ``loaded``: the model's names of keys stored
    under others, `stored_names_as_loaded`); each yielded tensor is the caller's own (no scratch buffer)."""
    scratch = Scratch()
    replaced = {key for key, update in updates.items() if update.replacement is not None}
    with tqdm(total=len(base_files), desc="export", unit="tensor", disable=not progress) as bar:
        for path, keys in _keys_by_file(base_files).items():
            read = read_tensors(path, [key for key in keys if key not in replaced])  # a trained copy: base unread
            for key in keys:
                if key in replaced:  # rounded once from the trained copy, as through fp32
                    tensor = updates[key].replacement.to(out_dtype, copy=True)
                else:
                    tensor = next(read)[1]
                    if base_variant == "nf4" and is_quantized_in_training(loaded.get(key, key), tensor):
                        tensor = nf4_round_trip(tensor, adapter.recipe)
                    tensor = merged_tensor(key, tensor, updates, scratch, out_dtype)
                yield key, tensor
                bar.update()
            read.close()


def merged_tensor(key: str, tensor, updates: dict, scratch: Scratch, out_dtype):
    """Base tensor ``key`` merged (in fp32, in ``scratch``) and rounded once to ``out_dtype``."""
    if key not in updates:
        return tensor.to(out_dtype) if tensor.is_floating_point() else tensor
    merged = updates[key].apply(tensor, scratch)
    if tensor.dtype == out_dtype and tensor.shape == merged.shape:  # the read tensor is ours: reuse it
        return tensor.copy_(merged)
    return merged.to(out_dtype, copy=True)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` for the block, then restored (export also runs at the
    end of training, in the recipe's own process)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_base_is_unquantized(base_dir: Path) -> None:
    """A merge needs the base's full-precision weights; a pre-quantized checkpoint holds packed 4-bit bytes."""
    quantization = checkpoint_quantization(str(base_dir))
    if quantization:
        method = quantization.get("quant_method", "quantized")
        raise ConfigError(
            f"--base: {base_dir} is a pre-quantized ({method}) checkpoint; merging needs the 16-bit weights: pass "
            "the 16-bit original with --base (--base-variant nf4 reproduces the 4-bit weights training saw)"
        )


def export_merged(
    source: str | Path,
    out: str | Path,
    base: str | None = None,
    dtype: str = "bf16",
    max_shard_size: str = "5GB",
    base_variant: str = "exact",
    overwrite: bool = False,
    verify: bool = False,
    progress: bool = True,
    allow_base_mismatch: bool = False,
    force_base_variant: bool = False,
) -> Path:
    """Merge the adapter behind ``source`` into its base and write a complete model directory at ``out``.

    Every check runs before anything is written; only then are stale staging directories of ``out`` removed.
    """
    out = Path(out)
    short = short_dtype_name(dtype)
    if short is None:
        raise ConfigError(f"--dtype: {dtype!r} is not a dtype; use bf16, fp16 or fp32 (or bfloat16, float16, float32)")
    dtype = short
    if base_variant not in ("exact", "nf4"):
        raise ConfigError(f"--base-variant: '{base_variant}' is not 'exact' or 'nf4'")
    if out.exists() and not overwrite:
        raise ConfigError(f"--out: {out} exists; pass --overwrite to replace it")
    max_bytes = parse_size(max_shard_size)
    adapter = find_adapter(Path(source))
    check_base_variant(adapter, base_variant, force_base_variant)
    base_dir = resolve_base(adapter, base)
    check_trained_base(adapter, base_dir, allow_base_mismatch)
    check_base_is_unquantized(base_dir)
    files = base_tensor_files(base_dir)
    loaded = stored_names_as_loaded(files, base_dir)
    stored = {name: key for key, name in loaded.items()}
    shapes = base_shapes(files)
    by_name = adapter.updates_by_base_key({loaded.get(key, key): shape for key, shape in shapes.items()})
    updates = {stored.get(name, name): update for name, update in by_name.items()}  # merged where stored
    check_adapter_fits_base(updates, files, adapter, base_dir)
    out_dtype = OUTPUT_DTYPES[dtype]

    remove_stale_staging(out)
    with publish_directory(out, replace=overwrite) as staging, writer_lock(staging):
        layout = grown_layout(output_layout(files, out_dtype), read_new_tokens(adapter.origin))
        writer = StreamingShardWriter(staging, layout, max_bytes)
        # Writes overlap with the next tensor's read and merge, which runs on one torch thread: it is memory-bound,
        # and a second would spin for work (docs/compat.md#elsewhere-in-the-package).
        with behind(writer.write) as write, torch_threads(1):
            for key, tensor in merged_tensors(files, adapter, updates, base_variant, out_dtype, progress, loaded):
                write(key, tensor)
        writer.finish()
        write_model_files(base_dir, staging, out_dtype)
        write_grown_model_files(read_new_tokens(adapter.origin), adapter.origin, staging)  # new tokens
        (staging / "README.md").write_text(model_card(adapter, base_dir, dtype, base_variant, staging))
        if adapter.recipe:  # how prompts were rendered in training, for `fsdp-peft generate`
            (staging / RECIPE_FILE).write_text(json.dumps(adapter.recipe, indent=1, sort_keys=True))
        if verify:
            print(verify_export(staging, adapter, base_dir, base_variant, dtype))
    return out


def write_model_files(base_dir: Path, staging: Path, out_dtype: torch.dtype) -> None:
    """The base's config.json without quantization and with the output dtype, and its generation config,
    tokenizer and processor files as they are (what ``from_pretrained`` reads next to the weights). Copied
    as files, not through transformers' classes: the export runs without importing them, and the files stay
    those the base ships (loadable wherever the base loads)."""
    config = json.loads((base_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    dtype = str(out_dtype).removeprefix("torch.")
    config["dtype"] = dtype
    if "torch_dtype" in config:  # the older spelling, kept in step for older transformers
        config["torch_dtype"] = dtype
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    copied = {path.name: path for pattern in MODEL_SIDE_FILES for path in base_dir.glob(pattern) if path.is_file()}
    for name, path in sorted(copied.items()):
        shutil.copyfile(path, staging / name)
    if not any(name.startswith(("tokenizer", "vocab")) or name.endswith(".model") for name in copied):
        tell(f"warning: base {base_dir} has no tokenizer files; the export has none either")


def merged_onto(adapter: Adapter, base_variant: str) -> str:
    """The model card's account of the weights the adapter was merged onto, true to how it was trained."""
    if base_variant == "exact":
        return "the exact 16-bit base"
    trained_4bit = trained_on_4bit(adapter)
    if trained_4bit:
        return "the NF4 round trip of the base (what QLoRA training saw)"
    if trained_4bit is None:
        return (
            f"the NF4 round trip of the base, as requested (--base-variant nf4); the adapter has no {RECIPE_FILE}, "
            "so whether it was trained on a 4-bit base is unknown"
        )
    return (
        "the NF4 round trip of the base, at the user's request (--force-base-variant); the adapter was trained "
        "on the 16-bit base (load_in_4bit: false), not on these 4-bit weights"
    )


def model_card(adapter: Adapter, base_dir: Path, dtype: str, base_variant: str, directory: Path) -> str:
    """A README naming base, adapter, recipe config and training summary, and how to load and prompt the model
    files written in ``directory``."""
    config = adapter.config
    model_config = read_json(directory / "config.json")
    lines = [
        "# Merged model (fsdp-peft export)",
        "",
        f"- base model: `{config.get('base_model_name_or_path') or base_dir}` (read from `{base_dir}`)",
        f"- adapter: `{adapter.origin}`: LoRA r={config['r']}, alpha={config['lora_alpha']}, "
        f"targets {config.get('target_modules')}",
        f"- merged onto: {merged_onto(adapter, base_variant)}",
        f"- dtype: {dtype}; no quantization config; loads with `{model_auto_class(model_config)}.from_pretrained`",
        "",
        *usage_section(model_config, has_chat_template(directory), has_processor(directory)),
    ]
    if adapter.recipe:
        lines += ["", "## Recipe config", "", "```json", json.dumps(adapter.recipe, indent=1, sort_keys=True), "```"]
    results = read_json(adapter.origin.parent / RESULTS_FILE)
    if results:
        lines += ["", "## Training summary", "", "```json", json.dumps(results, indent=1), "```"]
    return "\n".join(lines) + "\n"


# The model card's sentence for a tokenizer with a chat template: a chat model given a raw prompt often ends at once.
CHAT_TEMPLATE_NOTE = (
    "The tokenizer has a chat template: prompt the model through it (`apply_chat_template`, as below); a raw prompt "
    "without the template may get no answer at all (an end-of-sequence token at once)."
)
USAGE_PATH = "path/to/this/directory"  # the snippet's placeholder: the directory may be moved after export


def model_auto_class(config: dict) -> str:
    """The auto class loading a model of config.json ``config``, as `fsdp_peft.model.vision.auto_model_class_name` names
    it (read from the JSON, not transformers' config class: the export does not import transformers)."""
    return auto_model_class_name(types.SimpleNamespace(**config))


def has_chat_template(directory: Path) -> bool:
    """Whether the tokenizer or processor files in ``directory`` carry a chat template (a ``chat_template*`` file,
    or one inside tokenizer_config.json or processor_config.json, where older checkpoints keep it)."""
    if any(path.is_file() for path in directory.glob("chat_template*")):
        return True
    return any(
        read_json(directory / name).get("chat_template") for name in ("tokenizer_config.json", "processor_config.json")
    )


def has_processor(directory: Path) -> bool:
    """Whether ``directory`` holds processor files (a vision-language model's image processor)."""
    return any((directory / name).is_file() for name in ("preprocessor_config.json", "processor_config.json"))


def usage_section(config: dict, chat_template: bool, processor: bool) -> list[str]:
    """The model card's loading and prompting snippet for a model of config.json ``config``: its auto class, its
    processor where it has one (else its tokenizer), and a chat-template prompt when it has a template (raw
    otherwise)."""
    auto_class = model_auto_class(config)
    loader, reader = ("AutoProcessor", "processor") if processor else ("AutoTokenizer", "tokenizer")
    lines = ["## Usage", ""]
    if chat_template:
        lines += [CHAT_TEMPLATE_NOTE, ""]
    lines += [
        "```python",
        f"from transformers import {auto_class}, {loader}",
        "",
        f'model = {auto_class}.from_pretrained("{USAGE_PATH}")',
        f'{reader} = {loader}.from_pretrained("{USAGE_PATH}")',
    ]
    if chat_template and processor:  # image parts are expanded into the model's image tokens by the template
        lines += [
            'image = {"type": "image", "path": "image.png"}',
            'messages = [{"role": "user", "content": [image, {"type": "text", "text": "Describe the image."}]}]',
            f"inputs = {reader}.apply_chat_template(",
            '    messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"',
            ")",
        ]
    elif chat_template:
        lines += [
            'messages = [{"role": "user", "content": "Hello!"}]',
            f"inputs = {reader}.apply_chat_template(",
            '    messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"',
            ")",
        ]
    else:
        lines += [f'inputs = {reader}(text="The capital of France is", return_tensors="pt")']
    lines += [
        "output = model.generate(**inputs, max_new_tokens=64)",
        f'print({reader}.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))',
        "```",
    ]
    return lines


def verify_export(directory: Path, adapter: Adapter, base_dir: Path, base_variant: str, dtype: str) -> str:
    """Reload the export and compare its logits with base + adapter (fp32) on a few prompts."""
    from peft import LoraConfig, set_peft_model_state_dict  # lazy: only --verify needs peft
    from transformers import AutoConfig, AutoTokenizer  # lazy: as above (model code)

    from fsdp_peft.model.vision import auto_model_class  # lazy: as above

    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompts = ["The capital of France is", "reverse: abcde", "def fibonacci(n):"]
    auto_class = auto_model_class(AutoConfig.from_pretrained(directory))
    merged = auto_class.from_pretrained(directory, dtype=torch.float32).eval()
    reference = auto_class.from_pretrained(base_dir, dtype=torch.float32)
    if (new_tokens := read_new_tokens(adapter.origin)) is not None:  # their trained rows replace the grown ones
        reference.resize_token_embeddings(new_tokens.rows, mean_resizing=False)
    if base_variant == "nf4":
        with torch.no_grad():
            for name, parameter in reference.named_parameters():
                if is_quantized_in_training(name, parameter):
                    parameter.copy_(nf4_round_trip(parameter, adapter.recipe))
    known = {k: v for k, v in adapter.config.items() if k in LoraConfig.__dataclass_fields__ and k != "peft_type"}
    reference = peft_wrapped(reference, LoraConfig(**known))
    set_peft_model_state_dict(reference, adapter.tensors)
    reference.eval()
    worst = 0.0
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            got, want = merged(input_ids=ids).logits, reference(input_ids=ids).logits
            worst = max(worst, (got - want).abs().max().item())
    tolerance = {"fp32": 1e-3, "fp16": 5e-2, "bf16": 2e-1}[dtype]
    if worst > tolerance:
        raise RuntimeError(f"verify: exported logits differ from base + adapter by {worst:.3e} > {tolerance:g}")
    return (
        f"verify: largest logit difference to base + adapter on {len(prompts)} prompts: {worst:.3e} (<= {tolerance:g})"
    )
