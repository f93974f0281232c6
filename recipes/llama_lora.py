"""LoRA on Llama (3.x) on a 16-bit base, sharded with FSDP through the Hugging Face Trainer.

The procedure is `fsdp_peft.recipe.run_recipe`; this recipe only names its default config,
``configs/llama_lora/tiny.yaml`` (the embedded tiny-llama, no GPU or network). Real models: llama_lora/llama3_1_8b.yaml.

    accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/llama_lora.py [--key value ...]
"""

from fsdp_peft.recipe import run_recipe
from fsdp_peft.settings.catalog import CONFIGS

DEFAULT_CONFIG = CONFIGS / "llama_lora" / "tiny.yaml"

if __name__ == "__main__":
    run_recipe("llama_lora", DEFAULT_CONFIG)
