"""The training procedures and the Trainer they share: supervised fine-tuning (`sft`, `vision_sft`), preference
training (`preference`: DPO, KTO) and GRPO (`rl`, with `rewards`), each a `procedure.Procedure` value that
`fsdp_peft.recipe` runs through one skeleton; the project's `Trainer` (`trainer`), memory measured in the run
(`memory`), EVA initialisation (`eva`), and what a run does when it ends (`ending`).

Import from the module: this package imports none of them.
"""
