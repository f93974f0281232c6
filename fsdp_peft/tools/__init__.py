"""What a user runs around a training run (the ``fsdp-peft`` command, `fsdp_peft.cli`, calls them): every rule
checked before any weights (`validation`), the memory plan (`plan`), generation from the sharded model
(`generation`, its compiled decode step `decoding`, and `fsdp-peft generate`: `inference`), evaluation with
lm-evaluation-harness (`evaluation`, its tasks `eval_tasks`), merged export (`export`), and the run directories they
read and guard (`runs`).

The tools stand on the model and its sharding and know no procedure's code: a procedure reaches them as a value
(`fsdp_peft.procedures.procedure.Procedure`) passed in. Import from the module: this package imports none of them.
"""
