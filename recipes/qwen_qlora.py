"""QLoRA on Qwen (2.5 and 3): nf4 base, double quantization, bf16 compute, sharded with FSDP through the Hugging Face Trainer.

The procedure is `fsdp_peft.recipe.run_recipe`; this recipe only names its default config,
``configs/qwen_qlora/tiny.yaml`` (the embedded tiny-qwen2, no GPU or network). Real models: qwen_qlora/qwen2_5_7b.yaml, qwen_qlora/qwen3_8b.yaml.

    accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/qwen_qlora.py [--key value ...]
"""

from fsdp_peft.recipe import run_recipe
from fsdp_peft.settings.catalog import CONFIGS

DEFAULT_CONFIG = CONFIGS / "qwen_qlora" / "tiny.yaml"

if __name__ == "__main__":
    run_recipe("qwen_qlora", DEFAULT_CONFIG)
