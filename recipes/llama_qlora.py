"""QLoRA on Llama (3.x): nf4 base, double quantization, bf16 compute, sharded with FSDP through the Hugging Face Trainer.

The procedure is `fsdp_peft.recipe.run_recipe`; this recipe only names its default config,
``configs/llama_qlora/tiny.yaml`` (the embedded tiny-llama, no GPU or network). Real models: llama_qlora/llama3_1_8b.yaml, llama_qlora/llama3_3_70b.yaml.

    accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/llama_qlora.py [--key value ...]
"""

from fsdp_peft.recipe import run_recipe
from fsdp_peft.settings.catalog import CONFIGS

DEFAULT_CONFIG = CONFIGS / "llama_qlora" / "tiny.yaml"

if __name__ == "__main__":
    run_recipe("llama_qlora", DEFAULT_CONFIG)
