"""DPO on Llama (3.x) with LoRA, or QLoRA with load_in_4bit: true, sharded with FSDP through TRL's DPOTrainer.

The procedure is `fsdp_peft.procedures.preference.PREFERENCE_PROCEDURE` (run by `fsdp_peft.recipe.run_recipe`); this
recipe only names its default config, ``configs/llama_dpo/tiny.yaml`` (the embedded tiny-llama and
tiny-preference pairs, no GPU or network). Real models: llama_dpo/llama3_1_8b_qlora.yaml.

Supports: LoRA or QLoRA (``load_in_4bit``), TRL's DPO losses (``loss_type``, ``beta``), the reference as the
same sharded model with its adapter disabled (no second copy), ``precompute_ref_log_probs``, sharded
checkpoints and exact resume, prompt/chosen/rejected strings or chat pairs from files or the hub.

    accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/llama_dpo.py [--key value ...]
"""

from fsdp_peft.procedures.preference import PREFERENCE_PROCEDURE
from fsdp_peft.recipe import run_recipe
from fsdp_peft.settings.catalog import CONFIGS

DEFAULT_CONFIG = CONFIGS / "llama_dpo" / "tiny.yaml"
PROCEDURE = PREFERENCE_PROCEDURE  # what `fsdp-peft validate` and `plan` check and plan this recipe's configs as

if __name__ == "__main__":
    run_recipe("llama_dpo", DEFAULT_CONFIG, procedure=PROCEDURE)
