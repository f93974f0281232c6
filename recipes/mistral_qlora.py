"""QLoRA on Mistral: nf4 base, double quantization, bf16 compute, sharded with FSDP through the Hugging Face Trainer.

The procedure is `fsdp_peft.recipe.run_recipe`; this recipe only names its default config,
``configs/mistral_qlora/tiny.yaml`` (the embedded tiny-mistral, no GPU or network). Real models: mistral_qlora/mistral_7b.yaml.

    accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/mistral_qlora.py [--key value ...]
"""

from fsdp_peft.recipe import run_recipe
from fsdp_peft.settings.catalog import CONFIGS

DEFAULT_CONFIG = CONFIGS / "mistral_qlora" / "tiny.yaml"

if __name__ == "__main__":
    run_recipe("mistral_qlora", DEFAULT_CONFIG)
