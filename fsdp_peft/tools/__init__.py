"""What a user runs around a training run: `fsdp-peft` (`fsdp_peft.tools.cli`), checking a recipe before any
weights (`validation`) and planning its memory (`plan`), generating from the sharded model (`generation`,
`inference`), evaluating it (`evaluation`, `eval_tasks`), exporting merged weights (`export`), and the run
directories they read and guard (`runs`).

The tools stand on the model and its sharding and know no procedure. Import from the module: this package imports
none of them.
"""
