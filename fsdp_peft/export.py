"""Merged full-weight export: a base checkpoint plus a LoRA adapter, as a plain Hugging Face model directory.

The base safetensors are streamed tensor by tensor (plain reads, not memory maps); each adapted weight gets ``W + scale * B @ A``
(computed in fp32, rounded once to the output dtype) and output shards are written as they fill, so
peak host memory is about the largest tensor plus the adapter, whatever the model and shard size. The merge is
always onto the 16-bit base, never into re-quantized 4-bit weights; ``base_variant="nf4"`` instead
merges onto the NF4 round trip of the base, the weights a QLoRA adapter was trained against.

Sources: an adapter directory (PEFT format), a Trainer checkpoint holding sharded FSDP state
(``pytorch_model_fsdp_0/``), or a training ``output_dir`` (its final ``adapter/``, else its latest
checkpoint). The output appears only when complete (written beside it, then renamed).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from fsdp_peft.errors import ConfigError
from fsdp_peft.files import publish_directory
from fsdp_peft.tiny import resolve_model_path

OUTPUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
RECIPE_FILE = "fsdp_peft_recipe.json"
PEFT_PREFIX = "base_model.model."
DCP_DIR = "pytorch_model_fsdp_0"
ADAPTER_SOURCES = (
    "an adapter directory (adapter_config.json + adapter_model.safetensors), "
    f"a Trainer checkpoint ({DCP_DIR}/), or a training output_dir (adapter/ or checkpoint-N/)"
)
UNSUPPORTED_ADAPTER_KEYS = ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform")


@dataclass
class Adapter:
    """A LoRA adapter as export needs it: its config, its tensors (PEFT keys), where it came from."""

    config: dict
    tensors: dict[str, torch.Tensor]
    origin: Path
    recipe: dict = field(default_factory=dict)

    @property
    def scale(self) -> float:
        r, alpha = self.config["r"], self.config["lora_alpha"]
        return alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r

    def deltas_by_base_key(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{base weight key: (lora_A, lora_B)}``."""
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in self.tensors.items():
            match = re.fullmatch(r"(.+)\.lora_([AB])\.weight", key.removeprefix(PEFT_PREFIX))
            if not match:
                raise ConfigError(f"{self.origin}: adapter tensor '{key}' is not a LoRA A/B weight; cannot merge it")
            pairs.setdefault(f"{match[1]}.weight", {})[match[2]] = tensor
        incomplete = [k for k, pair in pairs.items() if set(pair) != {"A", "B"}]
        if incomplete:
            raise ConfigError(f"{self.origin}: adapter has lora_A without lora_B (or the reverse) for {incomplete[0]}")
        return {key: (pair["A"], pair["B"]) for key, pair in pairs.items()}


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _check_adapter_config(config: dict, origin: Path) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{origin}: adapter type {config.get('peft_type')} cannot be merged; only LoRA")
    if config.get("use_dora") or config.get("fan_in_fan_out") or config.get("bias", "none") != "none":
        raise ConfigError(f"{origin}: DoRA, fan_in_fan_out and trained biases are not supported by export yet")
    for key in UNSUPPORTED_ADAPTER_KEYS:
        if config.get(key):
            raise ConfigError(f"{origin}: adapter_config '{key}' is not supported by export yet")


def read_sharded_adapter(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Adapter tensors from a Trainer checkpoint's sharded FSDP state (DCP), without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(checkpoint / DCP_DIR))
    metadata = reader.read_metadata().state_dict_metadata
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        raise ConfigError(f"{checkpoint}: its sharded model state holds no adapter tensors; export the final adapter")
    dcp.load(state, storage_reader=reader, no_dist=True)
    return {key.removeprefix("model."): tensor for key, tensor in state.items()}


def _latest_checkpoint(directory: Path) -> Path | None:
    steps = [(int(p.name.split("-")[1]), p) for p in directory.glob("checkpoint-*") if p.name.split("-")[1].isdigit()]
    return max(steps)[1] if steps else None


def find_adapter(source: Path) -> Adapter:
    """Read the adapter behind ``source`` (adapter directory, sharded checkpoint or training output_dir)."""
    source = Path(source)
    if (source / "adapter_config.json").is_file() and (source / "adapter_model.safetensors").is_file():
        config = _read_json(source / "adapter_config.json")
        tensors = {}
        with safe_open(source / "adapter_model.safetensors", framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        adapter = Adapter(config, tensors, source, _read_json(source / RECIPE_FILE))
    elif (source / DCP_DIR).is_dir():
        if not (source / "adapter_config.json").is_file():
            raise ConfigError(f"{source}: checkpoint has no adapter_config.json (it was not written by fsdp-peft)")
        config = _read_json(source / "adapter_config.json")
        adapter = Adapter(config, read_sharded_adapter(source), source, _read_json(source / RECIPE_FILE))
    elif (source / "adapter").is_dir():
        return find_adapter(source / "adapter")
    elif (checkpoint := _latest_checkpoint(source)) is not None:
        return find_adapter(checkpoint)
    else:
        raise ConfigError(f"SOURCE: {source} is none of: {ADAPTER_SOURCES}")
    _check_adapter_config(adapter.config, adapter.origin)
    return adapter


def resolve_base(adapter: Adapter, base: str | None) -> Path:
    """The base model directory: ``--base``, else the adapter's ``base_model_name_or_path``.

    The embedded tiny model is rebuilt from its seed when its cache directory has moved.
    """
    name = base or adapter.config.get("base_model_name_or_path")
    if not name:
        raise ConfigError(f"{adapter.origin}: adapter names no base model; pass --base")
    name = resolve_model_path(name)  # tiny-<family>, or a moved cache directory of one, becomes its cache
    if Path(name).is_dir():
        return Path(name)
    if Path(name).exists() or name.startswith(("/", "./", "../")):
        raise ConfigError(f"--base: directory not found: {name}")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))


def base_tensor_files(base: Path) -> dict[str, Path]:
    """``{tensor key: safetensors file}`` for the base checkpoint (sharded with an index, or single)."""
    index = base / "model.safetensors.index.json"
    if index.is_file():
        return {key: base / name for key, name in json.loads(index.read_text())["weight_map"].items()}
    single = base / "model.safetensors"
    if not single.is_file():
        raise ConfigError(f"--base: {base} holds no safetensors checkpoint (model.safetensors or its index)")
    return {key: single for key in read_header(single) if key != "__metadata__"}


def check_adapter_fits_base(deltas: dict, files: dict[str, Path], adapter: Adapter, base: Path) -> None:
    """Every adapted weight exists in the base with matching shapes; raised before anything is written."""
    headers = {path: read_header(path) for path in {files[key] for key in deltas if key in files}}
    for key, (lora_a, lora_b) in deltas.items():
        if key not in files:
            raise ConfigError(
                f"adapter {adapter.origin} adapts '{key}', which base {base} does not have "
                "(different architecture, or the wrong --base)"
            )
        shape = tuple(headers[files[key]][key]["shape"])
        if shape != (lora_b.shape[0], lora_a.shape[1]) or lora_a.shape[0] != lora_b.shape[1]:
            raise ConfigError(
                f"adapter {adapter.origin}: '{key}' is {list(shape)} in base {base} but the adapter's "
                f"B @ A is {[lora_b.shape[0], lora_a.shape[1]]} (wrong --base?)"
            )


def nf4_round_trip(weight: torch.Tensor, recipe: dict) -> torch.Tensor:
    """The weight as QLoRA training saw it: cast to the load dtype, 4-bit quantized, dequantized."""
    import bitsandbytes.functional as bnb_functional

    load_dtype = getattr(torch, recipe.get("torch_dtype", "bfloat16"))
    storage = getattr(torch, recipe.get("bnb_4bit_quant_storage", "bfloat16"))
    packed, state = bnb_functional.quantize_4bit(
        weight.to(load_dtype).contiguous(),
        blocksize=64,
        compress_statistics=recipe.get("bnb_4bit_use_double_quant", True),
        quant_type=recipe.get("bnb_4bit_quant_type", "nf4"),
        quant_storage=storage,
    )
    return bnb_functional.dequantize_4bit(packed, state).to(torch.float32)


def is_quantized_in_training(key: str, tensor: torch.Tensor) -> bool:
    """bitsandbytes quantizes the linear layers inside decoder layers (2-D weights under ``layers.``)."""
    return tensor.dim() == 2 and ".layers." in key and key.endswith(".weight")


def parse_size(text: str, key: str = "--max-shard-size") -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or bytes as an integer; errors name ``key``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise ConfigError(f"{key}: '{text}' is not a size like 5GB, 500MB or 2GiB")
    unit = (match[2] or "B").upper()
    powers = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    return int(float(match[1]) * powers[unit])


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def read_header(path: Path) -> dict:
    """A safetensors file's header: ``{key: {"dtype", "shape", "data_offsets"}}`` (and ``__metadata__``)."""
    with open(path, "rb") as handle:
        return json.loads(handle.read(int.from_bytes(handle.read(8), "little")))


def read_tensors(path: Path, keys: list[str]):
    """Yield ``(key, tensor)`` from a safetensors file with plain reads, one tensor in memory at a time.

    Memory-mapping (``safe_open``) would keep every page read so far resident for as long as the file
    is open, which on a multi-gigabyte shard is most of the export's memory.
    """
    with open(path, "rb") as handle:
        header_size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_size))
        for key in keys:
            entry = header[key]
            start, end = entry["data_offsets"]
            handle.seek(8 + header_size + start)
            data = bytearray(handle.read(end - start))
            tensor = torch.frombuffer(data, dtype=SAFETENSORS_DTYPES[entry["dtype"]]) if data else torch.empty(0)
            yield key, tensor.reshape(entry["shape"])


class StreamingShardWriter:
    """Writes safetensors shards tensor by tensor, straight to disk, in a layout planned up front.

    Every output key, shape and dtype is known from the base headers before anything is merged, so
    each shard's header is written first and tensors follow as they are produced: nothing but the
    tensor in hand is held in memory, whatever the shard size.
    """

    def __init__(self, directory: Path, layout: list[tuple[str, list[int], torch.dtype]], max_bytes: int):
        self.directory = directory
        self.shards: list[list[tuple[str, list[int], torch.dtype]]] = [[]]
        size = 0
        for key, shape, dtype in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            if self.shards[-1] and size + nbytes > max_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append((key, shape, dtype))
            size += nbytes
        self.names = (
            ["model.safetensors"]
            if len(self.shards) == 1
            else [f"model-{n + 1:05d}-of-{len(self.shards):05d}.safetensors" for n in range(len(self.shards))]
        )
        self.order = [(shard, entry) for shard, entries in enumerate(self.shards) for entry in entries]
        self.position, self.handle, self.total = 0, None, 0

    def _open(self, shard: int) -> None:
        if self.handle:
            self.handle.close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, shape, dtype in self.shards[shard]:
            nbytes = math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # tensor data starts 8-byte aligned
        self.handle = open(self.directory / self.names[shard], "wb")
        self.handle.write(len(encoded).to_bytes(8, "little") + encoded)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        shard, (expected, shape, dtype) = self.order[self.position]
        if key != expected or list(tensor.shape) != shape or tensor.dtype != dtype:
            raise RuntimeError(f"export: got {key} {list(tensor.shape)} {tensor.dtype}, planned {expected} {shape} {dtype}")
        if self.position == 0 or shard != self.order[self.position - 1][0]:
            self._open(shard)
        self.handle.write(tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        self.total += tensor.numel() * tensor.element_size()
        self.position += 1

    def finish(self) -> None:
        """Close the last shard and, for several shards, write Hugging Face's index."""
        if self.handle:
            self.handle.close()
        if self.position != len(self.order):
            raise RuntimeError(f"export: wrote {self.position} of {len(self.order)} planned tensors")
        if len(self.shards) > 1:
            weight_map = {key: self.names[shard] for shard, (key, _, _) in self.order}
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def output_layout(base_files: dict[str, Path], out_dtype: torch.dtype) -> list[tuple[str, list[int], torch.dtype]]:
    """Key, shape and output dtype of every tensor, in the order `merged_tensors` yields them."""
    layout = []
    for path, keys in _keys_by_file(base_files).items():
        header = read_header(path)
        for key in keys:
            dtype = SAFETENSORS_DTYPES[header[key]["dtype"]]
            layout.append((key, header[key]["shape"], out_dtype if dtype.is_floating_point else dtype))
    return layout


def _keys_by_file(base_files: dict[str, Path]) -> dict[Path, list[str]]:
    by_file: dict[Path, list[str]] = {}
    for key, path in base_files.items():
        by_file.setdefault(path, []).append(key)
    return by_file


def merged_tensors(base_files: dict[str, Path], adapter: Adapter, base_variant: str, progress: bool):
    """Yield ``(key, merged fp32 tensor)`` for every base tensor, reading one tensor at a time."""
    from tqdm.auto import tqdm

    deltas = adapter.deltas_by_base_key()
    with tqdm(total=len(base_files), desc="export", unit="tensor", disable=not progress) as bar:
        for path, keys in _keys_by_file(base_files).items():
            for key, tensor in read_tensors(path, keys):
                if base_variant == "nf4" and is_quantized_in_training(key, tensor):
                    tensor = nf4_round_trip(tensor, adapter.recipe)
                if key in deltas:
                    lora_a, lora_b = deltas[key]
                    tensor = tensor.float() + (lora_b.float() @ lora_a.float()) * adapter.scale
                yield key, tensor
                bar.update()


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
) -> Path:
    """Merge the adapter behind ``source`` into its base and write a complete model directory at ``out``."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out = Path(out)
    if dtype not in OUTPUT_DTYPES:
        raise ConfigError(f"--dtype: '{dtype}' is not one of {', '.join(OUTPUT_DTYPES)}")
    if base_variant not in ("exact", "nf4"):
        raise ConfigError(f"--base-variant: '{base_variant}' is not 'exact' or 'nf4'")
    if out.exists() and not overwrite:
        raise ConfigError(f"--out: {out} exists; pass --overwrite to replace it")
    max_bytes = parse_size(max_shard_size)
    adapter = find_adapter(Path(source))
    base_dir = resolve_base(adapter, base)
    files = base_tensor_files(base_dir)
    check_adapter_fits_base(adapter.deltas_by_base_key(), files, adapter, base_dir)
    out_dtype = OUTPUT_DTYPES[dtype]

    with publish_directory(out, replace=overwrite) as staging:
        writer = StreamingShardWriter(staging, output_layout(files, out_dtype), max_bytes)
        for key, tensor in merged_tensors(files, adapter, base_variant, progress):
            writer.write(key, tensor.to(out_dtype) if tensor.is_floating_point() else tensor)
        writer.finish()
        config = AutoConfig.from_pretrained(base_dir)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = out_dtype
        config.save_pretrained(staging)
        try:
            GenerationConfig.from_pretrained(base_dir).save_pretrained(staging)
        except OSError:
            GenerationConfig.from_model_config(config).save_pretrained(staging)
        AutoTokenizer.from_pretrained(base_dir).save_pretrained(staging)
        (staging / "README.md").write_text(model_card(adapter, base_dir, dtype, base_variant))
        if adapter.recipe:  # how prompts were rendered in training, for `fsdp-peft generate`
            (staging / RECIPE_FILE).write_text(json.dumps(adapter.recipe, indent=1, sort_keys=True))
        if verify:
            print(verify_export(staging, adapter, base_dir, base_variant, dtype))
    return out


def model_card(adapter: Adapter, base_dir: Path, dtype: str, base_variant: str) -> str:
    """A README naming base, adapter, recipe config and training summary."""
    config = adapter.config
    lines = [
        "# Merged model (fsdp-peft export)",
        "",
        f"- base model: `{config.get('base_model_name_or_path') or base_dir}` (read from `{base_dir}`)",
        f"- adapter: `{adapter.origin}`: LoRA r={config['r']}, alpha={config['lora_alpha']}, "
        f"targets {config.get('target_modules')}",
        f"- merged onto: {'the NF4 round trip of the base (what QLoRA training saw)' if base_variant == 'nf4' else 'the exact 16-bit base'}",
        f"- dtype: {dtype}; no quantization config; loads with `AutoModelForCausalLM.from_pretrained`",
    ]
    if adapter.recipe:
        lines += ["", "## Recipe config", "", "```json", json.dumps(adapter.recipe, indent=1, sort_keys=True), "```"]
    results = _read_json(adapter.origin.parent / "results.json")
    if results:
        lines += ["", "## Training summary", "", "```json", json.dumps(results, indent=1), "```"]
    return "\n".join(lines) + "\n"


def verify_export(directory: Path, adapter: Adapter, base_dir: Path, base_variant: str, dtype: str) -> str:
    """Reload the export and compare its logits with base + adapter (fp32) on a few prompts."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompts = ["The capital of France is", "reverse: abcde", "def fibonacci(n):"]
    merged = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if base_variant == "nf4":
        with torch.no_grad():
            for name, parameter in reference.named_parameters():
                if is_quantized_in_training(name, parameter):
                    parameter.copy_(nf4_round_trip(parameter, adapter.recipe))
    known = {k: v for k, v in adapter.config.items() if k in LoraConfig.__dataclass_fields__ and k != "peft_type"}
    reference = get_peft_model(reference, LoraConfig(**known))
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
    return f"verify: largest logit difference to base + adapter on {len(prompts)} prompts: {worst:.3e} (<= {tolerance:g})"
