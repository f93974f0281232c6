"""LoRA on Gemma 3 (a vision-language model) on a 16-bit base, sharded with FSDP through the Hugging Face Trainer.

The procedure is `fsdp_peft.recipe.run_recipe` with `fsdp_peft.procedures.vision_sft`'s; this recipe only names its default
config, ``configs/gemma3_vl_lora/tiny.yaml`` (the embedded tiny model and image task, no GPU or network).

    accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/gemma3_vl_lora.py [--key value ...]
"""

from fsdp_peft.procedures.vision_sft import VISION_SFT_PROCEDURE
from fsdp_peft.recipe import run_recipe
from fsdp_peft.settings.catalog import CONFIGS

DEFAULT_CONFIG = CONFIGS / "gemma3_vl_lora" / "tiny.yaml"
PROCEDURE = VISION_SFT_PROCEDURE  # what `fsdp-peft validate` and `plan` check and plan this recipe's configs as

if __name__ == "__main__":
    run_recipe("gemma3_vl_lora", DEFAULT_CONFIG, procedure=PROCEDURE)
