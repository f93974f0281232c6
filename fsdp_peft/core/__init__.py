"""The ground floor: what every other room stands on, knowing nothing of models, data or training.

User errors and how a command exits on them (`errors`), the patches of the upstream libraries with their registry and
start-up gate (`_compat`), the rank-aware logger (`log`), this process's ranks and process group (`distributed`),
safetensors reading and streaming writes (`safetensors_io`), strict YAML (`strict_yaml`), the one dtype vocabulary
(`dtypes`), the names of a run's files (`run_file_names`), directories published only when complete
(`atomic_publish`), checks that run where the hub cannot be reached (`unreachable_hub`), and the XLA device route
(`xla`). Import from the module: this package imports none of them.
"""
