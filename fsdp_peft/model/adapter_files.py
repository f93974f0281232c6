"""The adapter directory fsdp-peft writes and reads: peft's files plus the run's records.

Beside peft's ``adapter_config.json`` and ``adapter_model.safetensors`` (or, in a Trainer checkpoint, the
sharded FSDP state in ``pytorch_model_fsdp_0/``) an adapter holds the recipe config (`RECIPE_FILE`) and a
record of the base it was trained on (`BASE_FILE`: architecture, model_type and a fingerprint of the config
fields in `BASE_FINGERPRINT_FIELDS`). The trainer writes them (`fsdp_peft.procedures.trainer.write_adapter_metadata`);
export and generate find and read an adapter here (`find_adapter`) and check the base they are given against
its record (`check_trained_base`). Imports torch, not transformers (export's start-up stays light).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import tell
from fsdp_peft.model.merge import WeightUpdate, adapter_updates, init_reads_base_weights
from fsdp_peft.model.new_tokens import read_new_tokens
from fsdp_peft.model.paths import resolve_model_path

RECIPE_FILE = "fsdp_peft_recipe.json"
BASE_FILE = "fsdp_peft_base.json"
# The config fields that decide the base's tensor names and shapes (read where present, from the text
# config of multimodal models). Not dtype, quantization_config, use_cache, _name_or_path or
# transformers_version: a 4-bit load or a bf16 copy of a base is the same base.
BASE_FINGERPRINT_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "num_experts",
    "num_local_experts",
    "moe_intermediate_size",
)
PEFT_PREFIX = "base_model.model."
DCP_DIR = "pytorch_model_fsdp_0"
ADAPTER_SOURCES = (
    "an adapter directory (adapter_config.json + adapter_model.safetensors), "
    f"a Trainer checkpoint ({DCP_DIR}/), or a training output_dir (adapter/ or checkpoint-N/)"
)
UNSUPPORTED_ADAPTER_KEYS = ("layers_to_transform",)


@dataclass
class Adapter:
    """A LoRA adapter as export needs it: its config, its tensors (PEFT keys), where it came from."""

    config: dict
    tensors: dict[str, torch.Tensor]
    origin: Path
    recipe: dict = field(default_factory=dict)
    base: dict = field(default_factory=dict)  # the base it was trained on (BASE_FILE); empty when not recorded

    def updates_by_base_key(self, base_shapes: dict[str, tuple] | None = None) -> dict[str, WeightUpdate]:
        """``{base tensor key: WeightUpdate}`` (LoRA, DoRA, rsLoRA, patterns, modules_to_save, trainable tokens, and,
        given the ``base_shapes`` that place them, LoRA on a mixture of experts' expert parameters)."""
        tensors = {key.removeprefix(PEFT_PREFIX): tensor for key, tensor in self.tensors.items()}
        return adapter_updates(tensors, self.config, self.origin, read_new_tokens(self.origin), base_shapes)


def read_json(path: Path) -> dict:
    """A JSON file's object; empty when the file is absent."""
    return json.loads(path.read_text()) if path.is_file() else {}


def _check_adapter_config(config: dict, origin: Path) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{origin}: adapter type {config.get('peft_type')} cannot be merged; only LoRA")
    if config.get("fan_in_fan_out") or config.get("bias", "none") != "none":
        raise ConfigError(f"{origin}: fan_in_fan_out and trained biases are not supported by export yet")
    if init_reads_base_weights(str(config.get("init_lora_weights", True))):
        raise ConfigError(
            f"{origin}: a {config['init_lora_weights']} adapter as trained (a checkpoint) belongs to a changed base; "
            "export the run's final adapter/, which is converted onto the original base"
        )
    for key in UNSUPPORTED_ADAPTER_KEYS:
        if config.get(key):
            raise ConfigError(f"{origin}: adapter_config '{key}' is not supported by export yet")


def read_sharded_adapter(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Adapter tensors from a Trainer checkpoint's sharded FSDP state (DCP), without a process group."""
    import torch.distributed.checkpoint as dcp  # lazy: only checkpoints need it (0.8 s of the export's start)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # lazy: as above

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
        config = read_json(source / "adapter_config.json")
        tensors = {}
        with safe_open(source / "adapter_model.safetensors", framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        adapter = Adapter(config, tensors, source, read_json(source / RECIPE_FILE), read_json(source / BASE_FILE))
    elif (source / DCP_DIR).is_dir():
        if not (source / "adapter_config.json").is_file():
            raise ConfigError(f"{source}: checkpoint has no adapter_config.json (it was not written by fsdp-peft)")
        config = read_json(source / "adapter_config.json")
        recipe, base = read_json(source / RECIPE_FILE), read_json(source / BASE_FILE)
        adapter = Adapter(config, read_sharded_adapter(source), source, recipe, base)
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
    from huggingface_hub import snapshot_download  # lazy: only a hub id needs it

    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))


def base_config_fields(config) -> dict:
    """The fields of `BASE_FINGERPRINT_FIELDS` that ``config`` sets, plus its model_type."""
    text = config.get_text_config()
    return fingerprint_fields(config.model_type, lambda name: getattr(text, name, None))


def fingerprint_fields(model_type: str | None, value_of) -> dict:
    """``model_type`` and the fields of `BASE_FINGERPRINT_FIELDS` that ``value_of(name)`` gives a plain value."""
    fields = {"model_type": model_type}
    for name in BASE_FINGERPRINT_FIELDS:
        value = value_of(name)
        if isinstance(value, (bool, int, float, str)):
            fields[name] = value
    return fields


def base_record(config) -> dict:
    """What an adapter keeps of its base: architecture, model_type, and a hash of the fields that shape it."""
    fields = base_config_fields(config)
    fingerprint = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    architecture = (getattr(config, "architectures", None) or [None])[0]
    return {"architecture": architecture, "model_type": config.model_type, "fingerprint": fingerprint, "fields": fields}


def raw_config_record(config: dict) -> dict | None:
    """`base_record`'s architecture, model_type and fields read from a config.json as written, without the
    config class's defaults; ``None`` for a composite config (sub-configs: the class decides which is text)."""
    if any(isinstance(value, dict) and "model_type" in value for value in config.values()):
        return None
    architecture = (config.get("architectures") or [None])[0]
    fields = fingerprint_fields(config.get("model_type"), config.get)
    return {"architecture": architecture, "model_type": config.get("model_type"), "fields": fields}


def write_base_record(config, directory: Path) -> None:
    """Record the base an adapter is trained on next to it, so export and generate can check theirs."""
    (Path(directory) / BASE_FILE).write_text(json.dumps(base_record(config), indent=1, sort_keys=True))


def _describe_base(record: dict) -> str:
    return f"{record.get('architecture') or 'model'} (model_type {record.get('model_type')})"


def base_mismatch(trained: dict, given: dict, given_name: str) -> str | None:
    """How base ``given_name`` (record ``given``) differs from the ``trained`` one, in words; None if the same."""
    architectures = {trained.get("architecture"), given.get("architecture")}
    if trained.get("model_type") != given.get("model_type") or (None not in architectures and len(architectures) > 1):
        return f"a {_describe_base(trained)} base, but {given_name} is a {_describe_base(given)}"
    if trained.get("fingerprint") == given.get("fingerprint"):
        return None
    old, new = trained.get("fields", {}), given.get("fields", {})
    changed = [f"{key} {old.get(key)} vs {new.get(key)}" for key in sorted(old | new) if old.get(key) != new.get(key)]
    return (
        f"another {_describe_base(trained)} than {given_name}: same architecture, different config (trained vs given): "
        + (", ".join(changed) if changed else f"fingerprint {trained.get('fingerprint')} vs {given.get('fingerprint')}")
    )


def check_trained_base(adapter: Adapter, base_dir: Path, allow_mismatch: bool = False) -> None:
    """Refuse a base other than the one the adapter was trained on: names and shapes can match across architectures."""
    if not adapter.base:
        tell(
            f"note: {adapter.origin} has no {BASE_FILE} (older fsdp-peft run or plain peft adapter): "
            f"its base could not be checked against {base_dir}"
        )
        return
    if not (base_dir / "config.json").is_file():
        raise ConfigError(f"--base: {base_dir} has no config.json; pass the model directory the adapter was trained on")
    config = json.loads((base_dir / "config.json").read_text())
    if raw_config_record(config) == {key: adapter.base.get(key) for key in ("architecture", "model_type", "fields")}:
        return  # its config.json states every field as trained: no config class (transformers) needed
    from transformers import AutoConfig  # lazy: the class's defaults decide; start-up seconds otherwise spared

    problem = base_mismatch(adapter.base, base_record(AutoConfig.from_pretrained(base_dir)), str(base_dir))
    if problem is None:
        return
    problem = f"adapter {adapter.origin} was trained on {problem}"
    if not allow_mismatch:
        raise ConfigError(
            f"--base: {problem}; pass the base it was trained on with --base, "
            f"or add --allow-base-mismatch to use {base_dir} anyway"
        )
    tell(f"warning: --allow-base-mismatch: {problem}; using it anyway, as asked")


def trained_on_4bit(adapter: Adapter) -> bool | None:
    """Whether the adapter's recipe loaded the base in 4 bits (QLoRA); None without a recipe record."""
    return bool(adapter.recipe.get("load_in_4bit")) if adapter.recipe else None
