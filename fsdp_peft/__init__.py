"""fsdp-peft: LoRA and QLoRA fine-tuning recipes sharded with FSDP through the Hugging Face Trainer."""

import logging
import sys
from importlib.abc import MetaPathFinder

# bitsandbytes warns on import, on AVX512-BF16 CPUs, that it could not fetch a kernel from the hub for
# its packed CPU weight layout. fsdp-peft switches that layout off (it corrupts FSDP shards, see
# fsdp_peft.model.modeling.disable_cpu_weight_repacking), so the warning only misleads.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


class _BitsandbytesImport(MetaPathFinder):
    """Imports two of bitsandbytes' backend modules through `fsdp_peft.core._compat.bitsandbytes_compiling_module_spec`:
    the default backend's compiler loads on first use, not at import; the CPU backend's 4-bit dequantization is
    replaced by a right one as soon as it is registered. Every other module is left to the other finders."""

    def find_spec(self, name, path=None, target=None):
        if name not in ("bitsandbytes.backends.default.ops", "bitsandbytes.backends.cpu.ops"):
            return None
        from fsdp_peft.core._compat import bitsandbytes_compiling_module_spec  # lazy: ls/cp must not import torch

        return bitsandbytes_compiling_module_spec(name, path, target)


if not any(isinstance(finder, _BitsandbytesImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _BitsandbytesImport())
if "bitsandbytes.backends.cpu.ops" in sys.modules:  # imported before fsdp_peft: its kernel is fixed now instead
    from fsdp_peft.core._compat import cpu_4bit_dequantization_block_aligned

    cpu_4bit_dequantization_block_aligned()

__version__ = "0.1.0"
