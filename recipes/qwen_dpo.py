"""DPO on Qwen (2.5, 3) with LoRA, or QLoRA with load_in_4bit: true, sharded with FSDP through TRL's DPOTrainer.

The procedure is `fsdp_peft.procedures.preference.PREFERENCE_PROCEDURE` (run by `fsdp_peft.recipe.run_recipe`); this
recipe only names its default config, ``configs/qwen_dpo/tiny.yaml`` (the embedded tiny-qwen2 and
tiny-preference pairs, no GPU or network). Real models: qwen_dpo/qwen2_5_7b_qlora.yaml.

Supports: LoRA or QLoRA (``load_in_4bit``), TRL's DPO losses (``loss_type``, ``beta``), the reference as the
same sharded model with its adapter disabled (no second copy), ``precompute_ref_log_probs``, sharded
checkpoints and exact resume, prompt/chosen/rejected strings or chat pairs from files or the hub.

    accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/qwen_dpo.py [--key value ...]
"""

from fsdp_peft.procedures.preference import PREFERENCE_PROCEDURE
from fsdp_peft.recipe import run_recipe
from fsdp_peft.settings.catalog import CONFIGS

DEFAULT_CONFIG = CONFIGS / "qwen_dpo" / "tiny.yaml"
PROCEDURE = PREFERENCE_PROCEDURE  # what `fsdp-peft validate` and `plan` check and plan this recipe's configs as

if __name__ == "__main__":
    run_recipe("qwen_dpo", DEFAULT_CONFIG, procedure=PROCEDURE)
