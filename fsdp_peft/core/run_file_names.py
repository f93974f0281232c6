"""The names of the files a run writes into its ``output_dir``, defined once for the modules that write and read them.

Kept apart from `fsdp_peft.tools.runs` (which imports transformers) so that ``fsdp-peft export`` can read a run's
results without importing transformers, peft or bitsandbytes.
"""

RESULTS_FILE = "results.json"  # a finished run's figures (fsdp_peft.procedures.ending); export and the tests read it
SAMPLES_FILE = "samples.jsonl"  # the held-out prompts' completions after training
EVAL_SAMPLES_FILE = "eval_samples.jsonl"  # completions at each evaluation (fsdp_peft.tools.generation)
HARNESS_DIR = "eval"  # the harness's files of a run's eval_tasks (fsdp_peft.tools.evaluation)
HARNESS_LOG_PREFIX = "harness/"  # the trainer's log keys of eval_tasks_steps' figures: harness/<task>/<metric>
LOSS_CURVE_FILE = "loss_curve.png"
