"""LoRA on Qwen (2.5 and 3) on a 16-bit base, sharded with FSDP through the Hugging Face Trainer.

The procedure is `fsdp_peft.recipe.run_recipe`; this recipe only names its default config,
``configs/qwen_lora/tiny.yaml`` (the embedded tiny-qwen2, no GPU or network). Real models: the qwen_qlora configs with --load_in_4bit false.

    accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/qwen_lora.py [--key value ...]
"""

from fsdp_peft.recipe import run_recipe
from fsdp_peft.settings.catalog import CONFIGS

DEFAULT_CONFIG = CONFIGS / "qwen_lora" / "tiny.yaml"

if __name__ == "__main__":
    run_recipe("qwen_lora", DEFAULT_CONFIG)
