"""LoRA on Mixtral mixtures of experts (attention and every expert) on a 16-bit base, sharded with FSDP2 through the Hugging Face Trainer.

The procedure is `fsdp_peft.recipe.run_recipe`; this recipe only names its default config,
``configs/mixtral_lora/tiny.yaml`` (the embedded tiny-mixtral, no GPU or network). Experts, router and the
router's auxiliary loss: docs/moe.md.

    accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/mixtral_lora.py [--key value ...]
"""

from fsdp_peft.recipe import run_recipe
from fsdp_peft.settings.catalog import CONFIGS

DEFAULT_CONFIG = CONFIGS / "mixtral_lora" / "tiny.yaml"

if __name__ == "__main__":
    run_recipe("mixtral_lora", DEFAULT_CONFIG)
