"""Every place fsdp-peft patches, overrides or reads a private part of another library, in one package.

`registry`: the private parts that other modules only read or override (Trainer's private methods, FSDP2 unit
state), listed in `UPSTREAM` with what the code relies on; the releases verified; the `patch` decorator. One module of
patches per library (`torch_patches`, `transformers_patches`, `accelerate_patches`, `peft_patches`, `trl_patches`,
`bitsandbytes_patches`): each patch is one function whose docstring says what it replaces, why, where upstream
stands, and when to remove it (docs/compat.md#the-measurements has what each gap measured). `gate.check_upstream` runs
when a recipe or an ``fsdp-peft`` command starts: a library outside the versions this was verified with, or a symbol
that moved or changed its signature, stops the run with one line, before any work; never a patch that silently stops
applying. ``FSDP_PEFT_UNVERIFIED=1`` lifts the version gate (symbols are still checked), for trying newer releases as
``.ci/run`` does. `import_hook` is the finder ``fsdp_peft/__init__.py`` installs for bitsandbytes' backend modules.
Import from the module: this package imports none of them.
"""
