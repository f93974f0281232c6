"""LoRA on Mistral on a 16-bit base, sharded with FSDP through the Hugging Face Trainer.

The procedure is `fsdp_peft.recipe.run_recipe`; this recipe only names its default config,
``configs/mistral_lora/tiny.yaml`` (the embedded tiny-mistral, no GPU or network). Real models: the mistral_qlora config with --load_in_4bit false.

    accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/mistral_lora.py [--key value ...]
"""

from fsdp_peft.recipe import run_recipe
from fsdp_peft.settings.catalog import CONFIGS

DEFAULT_CONFIG = CONFIGS / "mistral_lora" / "tiny.yaml"

if __name__ == "__main__":
    run_recipe("mistral_lora", DEFAULT_CONFIG)
