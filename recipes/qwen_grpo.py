"""GRPO on Qwen (2.5, 3) with LoRA, or QLoRA with load_in_4bit: true, sharded with FSDP (2 or 1) through TRL's GRPOTrainer.

The procedure is `fsdp_peft.procedures.rl.GRPO_PROCEDURE` (run by `fsdp_peft.recipe.run_recipe`); this recipe only names its
default config, ``configs/qwen_grpo/tiny.yaml`` (the embedded tiny-qwen2 and reversal task, no GPU or network).

Supports: LoRA or QLoRA (``load_in_4bit``), TRL's GRPO losses and sampling keys (``loss_type``, ``beta``,
``num_generations``, ``max_completion_length``, ``temperature``, ``top_p``, ...), built-in and your own reward
functions (``reward_funcs``, ``reward_weights``), rollouts from the sharded model with one all-gather per
``generate`` call, the reference as the same model with its adapter disabled (``beta > 0``), sharded checkpoints.

    accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/qwen_grpo.py [--key value ...]
"""

from fsdp_peft.procedures.rl import GRPO_PROCEDURE
from fsdp_peft.recipe import run_recipe
from fsdp_peft.settings.catalog import CONFIGS

DEFAULT_CONFIG = CONFIGS / "qwen_grpo" / "tiny.yaml"
PROCEDURE = GRPO_PROCEDURE  # what `fsdp-peft validate` and `plan` check and plan this recipe's configs as

if __name__ == "__main__":
    run_recipe("qwen_grpo", DEFAULT_CONFIG, procedure=PROCEDURE)
