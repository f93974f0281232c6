"""What a recipe says: its arguments, read from YAML and the command line (`config`), every key's type, range and
choices (`keys`, `choices`), QLoRA's 4-bit settings as one record (`four_bit`), the model families (`families`), the
shipped recipes and configs (`catalog`), the FSDP settings resolved from the launcher, the YAML and the command line
(`fsdp_settings`), and activation checkpointing's forms (`checkpointing`).

Nothing here loads a model or joins a process group. Import from the module: this package imports none of them.
"""
