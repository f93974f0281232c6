"""The ground floor: what every other room stands on and that knows nothing of models, data or training.

User errors and how a command exits on them (`fsdp_peft.core.errors`), the one registry of patches to the upstream
libraries with its version gate (`fsdp_peft.core._compat`), logging by rank, the process group, safetensors and YAML
reading, dtype names, the names of a run's files, atomic publishing of a directory, and the XLA device checks.
Import from the module: this package imports none of them.
"""
