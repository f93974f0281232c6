"""PiSSA, OLoRA and LoftQ on a 4-bit (or low-memory-loaded) base: the initial adapter and the residual base
weights, computed once from the full-precision checkpoint, tensor by tensor, before the model is loaded.

This is peft's recommended PiSSA-QLoRA procedure (peft ``examples/pissa_finetuning``): initialise on the
full-precision weights, save the residual model ``W - scale * B0 @ A0`` and the initial adapter, load the
residual in 4 bits and train from the initial adapter. Here the residual checkpoint is written under
``$FSDP_PEFT_CACHE/initialisations/<key>`` (the key hashes the checkpoint files, targets, ranks, scales, init,
quantization and seed), atomically (`fsdp_peft.core.atomic_publish.publish_directory`), by each node's first rank while
the others wait; later runs and resumes reuse it. The run then loads that checkpoint like any other: through
``from_pretrained``, or under ``cpu_ram_efficient_loading`` read by rank 0 and scattered shard by shard.

- PiSSA/OLoRA: peft's own ``LoraLayer.pissa_init``/``olora_init``, run on one full-precision linear layer at a
  time (peft's ``lora.Linear`` around the checkpoint tensor).
- LoftQ: peft's ``loftq_init``/``replace_lora_weights_loftq`` compute on CUDA only (``compute_device`` is
  hard-coded), and quantize with settings of their own (no double quantization) rather than the run's. Here
  the alternation is LoftQ's (quantize ``W - scale * B @ A``, then ``B, A`` from the SVD of ``W - Q`` with
  peft's ``_low_rank_decomposition``), with the run's own bitsandbytes settings on this rank's device, so the
  4-bit base the run loads is exactly the ``Q`` LoftQ fitted; and the LoRA scale is divided out (peft's sets
  ``B @ A`` to the residual, right only when ``lora_alpha == r``). With ``loftq_iter: 1`` the base is the
  original checkpoint (``Q = quant(W)``) and only the initial adapter is written.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import peft
import torch
from huggingface_hub import snapshot_download
from peft import LoraConfig
from peft.tuners.lora import Linear, LoraLayer
from peft.utils.loftq_utils import _low_rank_decomposition
from safetensors.torch import load_file, save_file

from fsdp_peft.core.atomic_publish import publish_directory
from fsdp_peft.core.distributed import gathered_from_every_rank, ranks
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import logger
from fsdp_peft.core.safetensors_io import (
    SAFETENSORS_DTYPES,
    StreamingShardWriter,
    base_tensor_files,
    read_header,
    read_tensors,
)
from fsdp_peft.model.loading import checkpoint_key, low_memory_loading_requested
from fsdp_peft.model.model_record import record_of
from fsdp_peft.model.paths import cache_dir
from fsdp_peft.model.variants import init_reads_base_weights

RESIDUAL_VERSION = 1  # bump when the same inputs give another residual or initial adapter
INITIAL_ADAPTER = "initial_adapter.safetensors"
ADAPTER = "default"


def init_computed_before_loading(recipe, training=None) -> bool:
    """PiSSA/OLoRA/LoftQ on a 4-bit base, or under low-memory loading: the base the run loads is a residual."""
    return init_reads_base_weights(recipe.init_lora_weights) and (
        recipe.load_in_4bit or low_memory_loading_requested(training)
    )


@dataclass(frozen=True)
class Target:
    """One linear layer peft puts LoRA on: its checkpoint name, rank, alpha, scale and 4-bit settings."""

    name: str
    r: int
    alpha: float
    scale: float
    quantize: tuple | None  # (Params4bit settings, load dtype) when the run loads this weight in 4 bits


def lora_linear_targets(skeleton_peft_model) -> list[Target]:
    """peft's own target resolution (patterns included), read from the adapters it put on a weightless model."""
    targets, quantized = [], record_of(skeleton_peft_model).quantize
    for name, module in skeleton_peft_model.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_A:
            continue
        base = module.get_base_layer()
        if not isinstance(base, torch.nn.Linear):  # bitsandbytes' Linear4bit is one
            continue
        quantize = quantized.get(checkpoint_key(name))
        targets.append(
            Target(
                checkpoint_key(name), module.r[ADAPTER], module.lora_alpha[ADAPTER], module.scaling[ADAPTER], quantize
            )
        )
    return targets


def _checkpoint_directory(path: str) -> Path:
    directory = Path(path).expanduser()
    if directory.is_dir():
        return directory
    return Path(snapshot_download(path, allow_patterns=["*.safetensors", "*.safetensors.index.json", "*.json"]))


def _key(directory: Path, files: dict[str, Path], targets: list[Target], recipe, seed: int, device) -> str:
    digest = hashlib.sha256(f"fsdp-peft residual v{RESIDUAL_VERSION} peft {peft.__version__}".encode())
    for file in sorted(set(files.values())):
        stat = file.stat()
        digest.update(json.dumps([str(file.resolve()), stat.st_size, stat.st_mtime_ns]).encode())
    init = [recipe.init_lora_weights, recipe.loftq_bits, recipe.loftq_iter, seed, device.type]
    quantized = [(t.name, t.r, t.alpha, t.scale, repr(t.quantize)) for t in targets]
    digest.update(json.dumps([str(directory.resolve()), init, quantized], default=str).encode())
    return digest.hexdigest()[:20]


def prepared_initialisation(recipe, model_path: str, targets: list[Target], seed: int, device) -> tuple[str, Path]:
    """``(checkpoint to load, initial adapter file)``, computed on each node's first rank while the others
    wait (collective); a failure there reaches every rank. LoftQ corrects the 4-bit layers only (the others,
    e.g. a targeted ``lm_head``, start as peft's default)."""
    if recipe.init_lora_weights == "loftq":
        targets = [t for t in targets if t.quantize is not None]
    if not targets:
        raise ConfigError(
            f"init_lora_weights: {recipe.init_lora_weights} initialises linear layers (LoftQ: 4-bit ones), and "
            f"lora_target_modules ({', '.join(recipe.lora_target_modules)}) selects none; target one, "
            "or use init_lora_weights: default"
        )
    directory = _checkpoint_directory(model_path)
    files = base_tensor_files(directory)
    target = cache_dir() / "initialisations" / _key(directory, files, targets, recipe, seed, device)
    error = None
    if ranks().is_local_main and not (target / INITIAL_ADAPTER).is_file():
        try:
            with publish_directory(target) as staging:
                _write_initialisation(staging, directory, files, targets, recipe, seed, device)
        except ConfigError as problem:
            error = str(problem)
        except Exception as crash:
            error = f"{recipe.init_lora_weights} initialisation failed on another rank: {type(crash).__name__}: {crash}"
            gathered_from_every_rank(error)
            raise
    if first := next((e for e in gathered_from_every_rank(error) if e), None):
        raise ConfigError(first)
    base = target if (target / "config.json").is_file() else directory
    logger.info(f"{recipe.init_lora_weights}: initial adapter in {target}, base weights from {base}")
    return str(base), target / INITIAL_ADAPTER


def _write_initialisation(staging: Path, directory: Path, files, targets, recipe, seed: int, device) -> None:
    """Stream every checkpoint file once: targets become residuals (written in the checkpoint dtype)."""
    by_name = {f"{t.name}.weight": t for t in targets}
    absent = sorted(set(by_name) - set(files))
    if absent:
        raise ConfigError(f"init_lora_weights: {directory} has no tensor {absent[0]} to initialise the adapter from")
    residual_needed = not (recipe.init_lora_weights == "loftq" and recipe.loftq_iter == 1)
    adapter: dict[str, torch.Tensor] = {}
    gpus = [device.index or 0] if device.type == "cuda" else []  # only this rank computes: leave its RNGs as they were
    with torch.random.fork_rng(devices=gpus):
        torch.manual_seed(seed)  # pissa_niter_N's randomised SVD: the same key gives the same result
        for file in sorted(set(files.values())):
            keys = [k for k, f in files.items() if f == file]
            header = read_header(file)
            layout = [(k, header[k]["shape"], SAFETENSORS_DTYPES[header[k]["dtype"]]) for k in keys]
            writer = None
            if residual_needed:
                (staging / ".part").mkdir()
                writer = StreamingShardWriter(staging / ".part", layout, max_bytes=2**62)
            for key, tensor in read_tensors(file, keys):
                if key in by_name:
                    lora_a, lora_b, tensor = initial_adapter(tensor, by_name[key], recipe, device)
                    name = by_name[key].name
                    adapter[f"{name}.lora_A"], adapter[f"{name}.lora_B"] = lora_a.contiguous(), lora_b.contiguous()
                if writer is not None:
                    writer.write(key, tensor)
            if writer is not None:
                writer.finish()
                (staging / ".part" / "model.safetensors").rename(staging / file.name)
                (staging / ".part").rmdir()
    if residual_needed:  # configs (and the shard index) as they are: the tensor names do not change
        for path in directory.iterdir():
            if path.is_file() and not path.name.endswith(".safetensors"):
                shutil.copy2(path, staging / path.name)
    save_file(adapter, str(staging / INITIAL_ADAPTER))


def initial_adapter(weight: torch.Tensor, target: Target, recipe, device) -> tuple[torch.Tensor, ...]:
    """``(A0, B0, base weight to store)`` for one checkpoint tensor, in fp32 / the checkpoint dtype."""
    if recipe.init_lora_weights == "loftq":
        return _loftq(weight, target, recipe.loftq_iter, device)
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = torch.nn.Parameter(weight.to(device, torch.float32), requires_grad=False)  # SVD/QR on the GPU
    config = LoraConfig(
        r=target.r, lora_alpha=target.alpha, init_lora_weights=recipe.init_lora_weights, use_rslora=recipe.use_rslora
    )
    lora = Linear(layer, ADAPTER, config=config, r=target.r, lora_alpha=target.alpha)
    if not math.isclose(lora.scaling[ADAPTER], target.scale):
        raise RuntimeError(f"{target.name}: peft scale {lora.scaling[ADAPTER]} differs from the run's {target.scale}")
    residual = lora.get_base_layer().weight.detach().to("cpu", weight.dtype)
    return lora.lora_A[ADAPTER].weight.detach().cpu(), lora.lora_B[ADAPTER].weight.detach().cpu(), residual


def _dequantized(weight: torch.Tensor, quantize: tuple, device) -> torch.Tensor:
    """What the run's 4-bit layer computes with for checkpoint tensor ``weight`` (quantized as loading does)."""
    import bitsandbytes as bnb  # lazy: only 4-bit layers need bitsandbytes

    settings, load_dtype = quantize
    packed = bnb.nn.Params4bit(weight.to(load_dtype), requires_grad=False, **{**settings, "module": None}).to(device)
    return bnb.functional.dequantize_4bit(packed.data, packed.quant_state).float().cpu()


def _loftq(weight: torch.Tensor, target: Target, iterations: int, device) -> tuple[torch.Tensor, ...]:
    """LoftQ's alternation: ``Q = quant(W - s B A)``, ``s B A = SVD_r(W - Q)``; the base to store is the last
    tensor quantized, so that loading it in 4 bits gives ``Q`` exactly."""
    full = weight.float()
    stored = weight
    for iteration in range(iterations):
        error = (full - _dequantized(stored, target.quantize, device)).to(device)
        decomposition = _low_rank_decomposition(error, target.r)
        left, right = decomposition["L"].cpu(), decomposition["R"].cpu()
        if iteration + 1 < iterations:
            stored = (full - left @ right).to(weight.dtype)
    root = math.sqrt(target.scale)
    return right / root, left / root, stored


def start_from_initial_adapter(peft_model, source: Path, init: str, base_model_name_or_path: str) -> None:
    """Set every LoRA A/B the initialisation computed. The adapter config records the init (so a checkpoint's
    unconverted adapter is refused by export) and the original base, not the residual."""
    tensors = load_file(str(source))
    used = set()
    for name, module in peft_model.named_modules():
        key = checkpoint_key(name)
        if f"{key}.lora_A" not in tensors:
            continue
        for part in ("lora_A", "lora_B"):
            weight = getattr(module, part)[ADAPTER].weight
            weight.data = tensors[f"{key}.{part}"].to(weight.dtype)
            used.add(f"{key}.{part}")
    if used != set(tensors):
        raise RuntimeError(f"initial adapter {source}: no LoRA layer for {sorted(set(tensors) - used)[:3]}")
    config = peft_model.peft_config[peft_model.active_adapter]
    config.init_lora_weights, config.base_model_name_or_path = init, base_model_name_or_path
