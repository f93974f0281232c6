"""Where things live on disk: fsdp-peft's cache, the embedded tiny models in it, and a model name's directory.

The cache is ``$FSDP_PEFT_CACHE``, else ``~/.cache/fsdp_peft``: the tiny models' checkpoints (built from
their seed by `fsdp_peft.model.tiny` and `fsdp_peft.model.tiny_vision` on first use), the embedded image task
(`tiny_colors_path`) and the tokenized data (`fsdp_peft.data.cache`).
SmolLM2-135M-Instruct, a real model, is built there too, from the package index's copy (`fsdp_peft.model.smollm2`).
`resolve_model_path` turns a ``model_name_or_path`` that names either into its cache directory.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import shutil
from pathlib import Path

from fsdp_peft.core.atomic_publish import publish_directory
from fsdp_peft.model import smollm2
from fsdp_peft.model.tiny import TINY_MODEL_ASSETS, WEIGHTS_SEED, write_tiny_model
from fsdp_peft.model.tiny_vision import (
    COLORS_SEED,
    write_tiny_colors,
    write_tiny_vision_model,
)
from fsdp_peft.settings.choices import (
    EMBEDDED_MODEL_NAMES,
    SMOLLM2_HUB_ID,
    SMOLLM2_NAME,
    TINY_COLORS_NAME,
    TINY_MODEL_NAME,
    TINY_VISION_MODEL_NAMES,
)

# fsdp_peft.core.log's logger by its name, not that module's imports: most of the package stands on this one
logger = logging.getLogger("fsdp_peft")


def cache_dir() -> Path:
    """Where the generated tiny checkpoint lives: ``$FSDP_PEFT_CACHE`` or ``~/.cache/fsdp_peft``."""
    return Path(os.environ.get("FSDP_PEFT_CACHE", Path.home() / ".cache" / "fsdp_peft"))


def tiny_model_path(name: str = TINY_MODEL_NAME) -> Path:
    """Tiny model ``name``'s checkpoint directory, created on first use (safe when several ranks race)."""
    if name not in EMBEDDED_MODEL_NAMES:
        raise ValueError(f"no embedded model called {name!r}; there are {', '.join(EMBEDDED_MODEL_NAMES)}")
    target = cache_dir() / f"{name}-seed{WEIGHTS_SEED}"
    if (target / "model.safetensors").is_file():
        return target
    with publish_directory(target) as staging:
        if name in TINY_VISION_MODEL_NAMES:
            write_tiny_vision_model(name, staging, TINY_MODEL_ASSETS, WEIGHTS_SEED)
        else:
            write_tiny_model(name, staging)
    return target


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct's checkpoint directory, built on first use from the package index's copy. Processes that
    ask at once (a launch's ranks, test workers) wait for the one that builds it: one download, one build."""
    target = cache_dir() / smollm2.CHECKPOINT_NAME
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        if not (target / "model.safetensors").is_file():
            for stale in target.parent.glob(f".{target.name}.partial.*"):  # a build killed midway (no one else builds)
                shutil.rmtree(stale, ignore_errors=True)
            with publish_directory(target) as staging:
                smollm2.build(staging)
    return target


@functools.cache
def _note_packaged_smollm2() -> None:
    logger.info(
        f"{SMOLLM2_HUB_ID}: the hub is offline and the model is not in its cache; using the copy from the package "
        f"index ({smollm2.PACKAGE} {smollm2.VERSION}, Q4_1 weights), as model_name_or_path: {SMOLLM2_NAME} would"
    )


def tiny_colors_path() -> Path:
    """The embedded image task's directory (``train.jsonl``, ``eval.jsonl``, ``images/``), created on first use
    (safe when several ranks race)."""
    target = cache_dir() / f"{TINY_COLORS_NAME}-seed{COLORS_SEED}"
    if (target / "eval.jsonl").is_file():
        return target
    with publish_directory(target) as staging:
        write_tiny_colors(staging)
    return target


def resolve_model_path(name: str) -> str:
    """Where ``model_name_or_path`` points: a tiny model's or SmolLM2's cache directory, else ``name`` unchanged.

    A tiny model is named by its name (``tiny-qwen2``) or by a cache directory of it that no longer
    exists (``.../tiny-qwen2-seed1234``, as recorded in an adapter), which is then rebuilt here; SmolLM2 likewise
    (``smollm2-135m-instruct``, its cache directory), and by its hub id when the hub is offline and has no copy.
    """
    if name in EMBEDDED_MODEL_NAMES:
        return str(tiny_model_path(name))
    path = Path(name)
    if name == SMOLLM2_NAME or (path.name == smollm2.CHECKPOINT_NAME and not path.exists()):
        return str(smollm2_path())
    if name == SMOLLM2_HUB_ID and hub_offline() and not hub_model_cached(name):
        _note_packaged_smollm2()
        return str(smollm2_path())
    for tiny in EMBEDDED_MODEL_NAMES:
        if path.name == f"{tiny}-seed{WEIGHTS_SEED}" and not path.exists():
            return str(tiny_model_path(tiny))
    return name


def checkpoint_quantization(name: str) -> dict | None:
    """The ``quantization_config`` a local checkpoint was saved with (a pre-quantized base), else ``None``."""
    config = Path(resolve_model_path(name)).expanduser() / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("quantization_config")
    except (ValueError, AttributeError):
        return None


HUB_CONFIGS = Path(__file__).parents[1] / "hub_configs"  # the shipped configs' hub models: config.json


def shipped_hub_config(name: str) -> Path | None:
    """The published ``config.json`` of hub model ``name`` kept in the package, for the hub models the shipped
    recipe configs name (``fsdp-peft plan`` on a machine without network); ``None`` for any other."""
    path = HUB_CONFIGS / f"{name.replace('/', '--')}.json"
    return path if "/" in name and path.is_file() else None


def shipped_hub_model_names() -> list[str]:
    """The hub ids of the models the shipped recipe configs name (those `shipped_hub_config` keeps)."""
    return sorted(path.stem.replace("--", "/") for path in HUB_CONFIGS.glob("*.json"))


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids the hub: a model not in the cache cannot load."""
    from huggingface_hub import constants  # lazy: the export reads model files without the hub client

    # the hub client reads the variable once, at import; a process that sets it later is offline too
    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def hub_cache_dir() -> Path:
    """Where the Hugging Face hub keeps downloaded models (``HF_HUB_CACHE``, ``HF_HOME``/hub, ...)."""
    from huggingface_hub import constants  # lazy: as in hub_offline

    return Path(constants.HF_HUB_CACHE)


def hub_model_cached(name: str) -> bool:
    """Whether hub model ``name``'s ``config.json`` is in the hub cache (so an offline load can find it)."""
    from huggingface_hub import try_to_load_from_cache  # lazy: as in hub_offline

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def cached_hub_model_names() -> list[str]:
    """The hub ids of the models in the hub cache (``models--owner--name`` directories)."""
    cache = hub_cache_dir()
    if not cache.is_dir():
        return []
    return sorted(p.name.removeprefix("models--").replace("--", "/") for p in cache.glob("models--*"))


def local_model_config(name: str, trust_remote_code: bool = False):
    """The config of model ``name`` (an embedded tiny model, a directory or a hub id) as transformers reads it, from
    this machine only: raises ``OSError`` when it is not here (nothing is downloaded), ``ValueError`` when
    transformers cannot read it."""
    from transformers import AutoConfig  # lazy: the export reads model files without transformers

    return AutoConfig.from_pretrained(
        resolve_model_path(name), local_files_only=True, trust_remote_code=trust_remote_code
    )


def known_model_config(name: str, trust_remote_code: bool = False):
    """`local_model_config`, else for a hub model that a shipped config names its published config kept in the
    package (`shipped_hub_config`): a config without any download. ``OSError``/``ValueError`` as there when neither."""
    from transformers import AutoConfig  # lazy: as in local_model_config

    try:
        return local_model_config(name, trust_remote_code)
    except (OSError, ValueError):
        shipped = shipped_hub_config(name)
        if shipped is None:
            raise
    values = json.loads(shipped.read_text())
    return AutoConfig.for_model(values.pop("model_type"), **values)
