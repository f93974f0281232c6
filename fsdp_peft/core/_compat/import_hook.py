"""The import finder that ``fsdp_peft/__init__.py`` installs before anything imports bitsandbytes.

It imports bitsandbytes' backend modules (``bitsandbytes.backends.<device>.ops``) through
`fsdp_peft.core._compat.bitsandbytes_patches.bitsandbytes_compiling_module_spec`: the default backend's compiler
loads on first use, not at import; the CPU backend's 4-bit dequantization is replaced by a right one as soon as it
is registered (the other backends import as they are). Every other module is left to the other finders. Importing
this module imports neither torch nor bitsandbytes (``fsdp-peft ls`` and ``cp`` must stay light).
"""

from __future__ import annotations

import logging
import sys
from importlib.abc import MetaPathFinder


class BitsandbytesImport(MetaPathFinder):
    """Serves bitsandbytes' backend ``ops`` modules; ``None`` (the other finders) for every other module."""

    def find_spec(self, name, path=None, target=None):
        if not (name.startswith("bitsandbytes.backends.") and name.endswith(".ops")):
            return None
        from fsdp_peft.core._compat.bitsandbytes_patches import (  # lazy: ls/cp must not import torch
            bitsandbytes_compiling_module_spec,
        )

        return bitsandbytes_compiling_module_spec(name, path, target)


def install() -> None:
    """Put the finder first (once per process); a CPU backend imported before fsdp_peft gets its kernel fixed now.

    Also quiets bitsandbytes' import-time warning, on AVX512-BF16 CPUs, that it could not fetch a kernel from the
    hub for its packed CPU weight layout: fsdp-peft switches that layout off (it corrupts FSDP shards, see
    `fsdp_peft.core._compat.bitsandbytes_patches.cpu_weight_repacking_disabled`), so the warning only misleads.
    """
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    if not any(isinstance(finder, BitsandbytesImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, BitsandbytesImport())
    if "bitsandbytes.backends.cpu.ops" in sys.modules:
        from fsdp_peft.core._compat.bitsandbytes_patches import (  # lazy: only where bitsandbytes came first
            cpu_4bit_dequantization_block_aligned,
        )

        cpu_4bit_dequantization_block_aligned()
