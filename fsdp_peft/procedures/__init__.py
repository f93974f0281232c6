"""The training procedures and the Trainer they share: supervised fine-tuning (`sft`, and `vision_sft` for
vision-language models), preference training (`preference`: DPO, KTO) and GRPO (`rl`, with `rewards`), each a
`procedure.Procedure` value that `fsdp_peft.recipe` runs through one skeleton and that owns its keys and rules, and
`registry`, which lists them and finds a recipe's or a config's procedure; the recipes' `Trainer` (`trainer`, and
TRL's trainers with its behaviour, built where a DPO/KTO or GRPO run starts) and its eval loss (`eval_loss`: the
held-out tokens' mean cross-entropy on any number of ranks), memory measured in the run (`memory`),
EVA initialisation from sharded data (`eva`), and what a run does when it ends (`ending`).

Import from the module: this package imports none of them.
"""
