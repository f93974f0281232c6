"""Low-memory loading under FSDP2 (``cpu_ram_efficient_loading``): only rank 0 reads the checkpoint.

Every rank builds the model as a skeleton (weights on the meta device, the same modules as
``from_pretrained`` builds, 4-bit ``Linear4bit`` included); LoRA adapters are created for real, with
the same random initialisation as on a loaded model. FSDP2 shards the skeleton (nothing to copy), and
then rank 0 reads one checkpoint tensor at a time with plain file reads, converts it exactly as
``from_pretrained`` would (cast to the load dtype; for QLoRA, quantize to 4-bit on its own device), and
scatters it: each rank receives only its shard. 4-bit weights travel as their packed bytes (the
floating quant storage dtype, so they shard like any tensor) and their ``quant_state`` (absmax, nested
constants, code, shape, dtype, blocksize: small) is broadcast whole and attached to the module, as
bitsandbytes does when it quantizes.

Why not accelerate's own path: transformers 5.24 reads the checkpoint on every rank even under
``FSDP_CPU_RAM_EFFICIENT_LOADING`` (docs/compat.md#elsewhere-in-the-package), accelerate keeps rank 0's full state dict
alive while it broadcasts, and it skips the path entirely when bitsandbytes ``Params4bit`` are present."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import re
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from huggingface_hub import snapshot_download
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoConfig, GenerationConfig
from transformers.quantizers import AutoHfQuantizer

from fsdp_peft.core._compat.accelerate_patches import fsdp2_prepare_model_replaced
from fsdp_peft.core.distributed import ranks
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import logger
from fsdp_peft.core.safetensors_io import base_tensor_files, read_tensors
from fsdp_peft.model.model_record import record_of
from fsdp_peft.model.moe import EXPERTS_MODULE
from fsdp_peft.model.moe_quantization import SUFFIX as EXPERT_SUFFIX
from fsdp_peft.model.moe_quantization import quantize_expert_rows, quantized_expert_parameter
from fsdp_peft.model.new_tokens import grown_checkpoint_tensor
from fsdp_peft.model.vision import auto_model_class
from fsdp_peft.settings.fsdp_settings import fsdp_settings

CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."  # torch's activation-checkpoint wrapper, in module names


def low_memory_loading_requested(training=None) -> bool:
    """FSDP2 with ``cpu_ram_efficient_loading`` on several processes, from any FSDP route.

    ``training``: the run's `TrainingArguments` (or their values) when the recipe may set ``fsdp_config``;
    without it only the accelerate launcher's settings count.
    """
    settings = fsdp_settings(training if training is not None else {})
    return bool(settings and settings.version == 2 and settings.cpu_ram_efficient_loading and ranks().world_size > 1)


def model_skeleton(path: str | Path, dtype: torch.dtype, quantization=None, trust_remote_code: bool = False):
    """The model ``from_pretrained(path, dtype, quantization_config)`` builds, with weights on meta.

    Non-persistent buffers (rotary frequencies) are real: they are computed, not loaded. 4-bit layers get
    a meta ``Params4bit`` of the packed shape, as FSDP will shard it.
    """
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = auto_model_class(config).from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()  # from_pretrained ties once loaded; FSDP must see the tied weight as one
    if quantization is not None:
        _quantize_skeleton(model, quantization, dtype)
    with contextlib.suppress(OSError):
        model.generation_config = GenerationConfig.from_pretrained(path)
    record_of(model).pending_checkpoint = str(path)
    return model.eval()  # from_pretrained returns eval-mode models


def _quantize_skeleton(model, quantization, dtype: torch.dtype) -> None:
    """transformers' own module replacement (``Linear4bit``), then meta packed weights of the final shape."""
    import bitsandbytes as bnb  # lazy: only 4-bit layers need bitsandbytes

    quantizer = AutoHfQuantizer.from_config(quantization, pre_quantized=False)
    quantizer.preprocess_model(model=model, dtype=dtype, device_map=None, checkpoint_files=None, use_kernels=False)
    quantize = record_of(model).quantize
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            template = module.weight
            shape = _packed_shape(template.shape, template.quant_storage)
            packed = torch.empty(shape, dtype=template.quant_storage, device="meta")
            settings = {k: v for k, v in template.__dict__.items() if k not in ("data", "quant_state", "bnb_quantized")}
            module.weight = bnb.nn.Params4bit(packed, requires_grad=False, bnb_quantized=True, **settings)
            quantize[name] = (settings, dtype)  # what rank 0 quantizes the weight with
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)


def _packed_shape(shape: torch.Size, storage: torch.dtype) -> tuple[int, int]:
    """bitsandbytes packs two 4-bit values per byte into a column of the storage dtype."""
    return ((shape.numel() + 1) // 2 // storage.itemsize, 1)


def pending_checkpoint(model: torch.nn.Module) -> str | None:
    """The checkpoint a skeleton model still has to receive, if any (also through a PEFT wrapper)."""
    return record_of(model).pending_checkpoint


def checkpoint_key(name: str) -> str:
    """A model state-dict name as stored in the base checkpoint (PEFT's wrapper components removed, and a 4-bit
    expert parameter's suffix: `fsdp_peft.model.moe_quantization`)."""
    key = name.removeprefix("base_model.model.").replace(".token_adapter.base_layer.", ".")
    key = re.sub(r"(\.base_layer)+\.", ".", key)  # nested wrappers too (peft's LoRA on several parameters)
    return key.removesuffix(EXPERT_SUFFIX) if f".{EXPERTS_MODULE}." in key else key


def load_sharded_weights(model: torch.nn.Module, device: torch.device, offload_to_cpu: bool) -> int:
    """Fill a sharded skeleton from its checkpoint; collective. Returns the number of tensors loaded.

    Rank 0 reads, converts and scatters one tensor at a time; nobody holds more than one full tensor.
    """
    rank = dist.get_rank()
    missing, seen = {}, set()
    for name, value in model.state_dict(keep_vars=True).items():
        if value.device.type == "meta" and id(value) not in seen:  # tied weights: one parameter, two names
            missing[name] = value
        seen.add(id(value))
    # rank 0 alone looks at the checkpoint; every rank learns its plan (or its problem) from it
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    tied = set(getattr(base, "all_tied_weights_keys", None) or {})  # re-tied after loading, not read
    record = record_of(model)
    box = [reading_plan(record.pending_checkpoint, missing, tied) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ConfigError(box[0])
    by_file: dict[Path, list[str]] = box[0]

    # state-dict names omit the wrapper FSDP's activation checkpointing inserts; module names do not
    modules = {name.replace(CHECKPOINT_WRAPPER, ""): module for name, module in model.named_modules()}
    loaded: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        stream = read_tensors(file, [checkpoint_key(n) for n in names]) if rank == 0 else None
        for name in names:
            target = missing[name]
            module = modules[name.rpartition(".")[0]]
            quantize = record.quantize.get(checkpoint_key(name).rpartition(".")[0])
            experts = quantized_expert_parameter(record.quantized_experts, module, name.rpartition(".")[2])
            full = None
            if rank == 0:
                _, tensor = next(stream)
                if experts is not None:  # 4-bit experts: quantized here, as a full model's are after from_pretrained
                    weight = tensor.to(device, experts.load_dtype)
                    full, quant_state = quantize_expert_rows(weight, experts.layout), None
                else:
                    full, quant_state = _convert(tensor, target.dtype, quantize, device)
                full = grown_checkpoint_tensor(model, checkpoint_key(name), full)  # new tokens' rows
            if quantize is not None:
                module.quant_state = _broadcast_quant_state(quant_state if rank == 0 else None, device)
            if full is None:
                full = torch.empty(target.shape, dtype=target.dtype, device=device)
            if isinstance(target, DTensor):
                value = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=0)
            else:  # not sharded (e.g. left out of FSDP): every rank takes the whole tensor
                dist.broadcast(full, src=0)
                value = full
            trained_rows_copied(modules.get(name.rpartition(".")[0].removesuffix(".base_layer")), full, rank, device)
            del full
            loaded[name] = value.to("cpu") if offload_to_cpu else value
            release_freed_host_memory()
    model.load_state_dict(loaded, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    record.pending_checkpoint = None
    return len(loaded)


def trained_rows_copied(layer, full: torch.Tensor, rank: int, device: torch.device) -> None:
    """peft's trainable tokens start as their base rows, which a skeleton did not have when peft attached them
    (`fsdp_peft.core._compat.peft_patches.adapters_created_off_meta`): copy them from rank 0's full tensor, each rank
    its shard."""
    if layer is None or not hasattr(layer, "trainable_tokens_delta"):
        return
    for adapter, indices in layer.token_indices.items():
        if adapter not in layer.trainable_tokens_delta:
            continue
        rows = full[torch.tensor(indices, device=full.device)] if rank == 0 else None
        if rows is None:
            rows = torch.empty((len(indices), *full.shape[1:]), dtype=full.dtype, device=device)
        dist.broadcast(rows, src=0)  # a few rows
        with torch.no_grad():
            for tensor in (layer.trainable_tokens_delta[adapter], layer.trainable_tokens_original[adapter]):
                if isinstance(tensor, DTensor):
                    tensor.copy_(distribute_tensor(rows.to(tensor.dtype), tensor.device_mesh, tensor.placements))
                else:
                    tensor.copy_(rows)


def reading_plan(
    name: str, missing: dict[str, torch.Tensor], tied: set[str] = frozenset()
) -> dict[Path, list[str]] | str:
    """``{safetensors file: model names}``, largest tensors first, or the problem that prevents reading.

    ``tied`` names weights (checkpoint keys) that are tied to another: absent from the checkpoint, they
    are left out, and tied again once loaded.

    Largest first: their transient full copies on rank 0 then meet few shards already held. A hub id is
    resolved to its downloaded snapshot (downloaded now, by rank 0 only, when absent).
    """
    path = Path(name).expanduser()
    try:
        if not path.is_dir():
            path = Path(snapshot_download(name, allow_patterns=["*.safetensors", "*.safetensors.index.json", "*.json"]))
        files = base_tensor_files(path)
    except (ConfigError, OSError, ValueError) as error:
        return (
            f"cpu_ram_efficient_loading: cannot read {name} tensor by tensor ({error}); it needs a safetensors "
            "checkpoint: convert it, or set cpu_ram_efficient_loading: false"
        )
    missing = {n: v for n, v in missing.items() if checkpoint_key(n) in files or checkpoint_key(n) not in tied}
    absent = sorted(k for k in map(checkpoint_key, missing) if k not in files)
    if absent:
        return (
            f"cpu_ram_efficient_loading: {path} lacks {len(absent)} weights the model needs (e.g. {absent[0]}); "
            "set cpu_ram_efficient_loading: false to load it through from_pretrained"
        )
    plan: dict[Path, list[str]] = {}
    for model_name in sorted(missing, key=lambda n: -missing[n].numel()):
        plan.setdefault(files[checkpoint_key(model_name)], []).append(model_name)
    return plan


def release_freed_host_memory() -> None:
    """Hand memory freed by the allocator back to the OS (glibc only; elsewhere nothing happens).

    glibc keeps freed blocks below its mmap threshold (up to 32 MiB, raised as large blocks are freed)
    in its heap; one full tensor read, scattered and freed after another would otherwise stay resident
    on rank 0 and add up to a full copy of the model.
    """
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def _convert(tensor: torch.Tensor, dtype: torch.dtype, quantize: tuple | None, device: torch.device):
    """What ``from_pretrained`` makes of a checkpoint tensor: the load dtype, and for 4-bit layers the
    packed weight and its quant state, quantized on this rank's device as bitsandbytes does it there."""
    if quantize is None:
        return tensor.to(device=device, dtype=dtype), None
    import bitsandbytes as bnb  # lazy: only 4-bit layers need bitsandbytes

    settings, load_dtype = quantize
    weight = bnb.nn.Params4bit(tensor.to(load_dtype), requires_grad=False, **{**settings, "module": None})
    quantized = weight.to(device)
    return quantized.data, quantized.quant_state


def _broadcast_quant_state(quant_state, device: torch.device):
    """Rank 0's ``QuantState`` on every rank, pickled from the CPU so that any backend can carry it."""
    if quant_state is not None:
        quant_state.to("cpu")  # in place
    box = [quant_state]
    dist.broadcast_object_list(box, src=0)
    box[0].to(device)
    return box[0]


@contextlib.contextmanager
def weights_loaded_after_sharding(model: torch.nn.Module, accelerator):
    """While the `Accelerator` prepares ``model``: shard the skeleton, then fill it (`load_sharded_weights`).

    The weights arrive inside accelerate's FSDP2 preparation, before it maps the optimizer's parameters
    to the sharded ones. Accelerate's own rank-0 broadcast is switched off meanwhile: it would send
    rank 0's full state dict, which here does not exist.
    """
    if pending_checkpoint(model) is None:
        yield
        return
    plugin = accelerator.state.fsdp_plugin
    if plugin is None or plugin.fsdp_version != 2:
        raise ConfigError(
            "cpu_ram_efficient_loading: the model was built for FSDP2's low-memory loading; set fsdp_version: 2"
        )

    def then_load(original):
        def prepare(accelerator, model):
            plugin.cpu_ram_efficient_loading = False
            try:
                prepared = original(accelerator, model)
            finally:
                plugin.cpu_ram_efficient_loading = True
            offload = isinstance(plugin.cpu_offload, CPUOffloadPolicy)
            source = pending_checkpoint(prepared)
            count = load_sharded_weights(prepared, accelerator.device, offload_to_cpu=offload)
            logger.info(f"low-memory loading: rank 0 read {count} tensors of {source}, each rank kept its shards")
            return prepared

        return prepare

    with fsdp2_prepare_model_replaced(then_load):
        yield
