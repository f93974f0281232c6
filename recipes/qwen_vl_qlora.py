"""QLoRA (nf4 language model, 16-bit vision tower) on Qwen2.5-VL (a vision-language model) sharded with FSDP through the Hugging Face Trainer.

The procedure is `fsdp_peft.recipe.run_recipe` with `fsdp_peft.procedures.vision_sft`'s; this recipe only names its default
config, ``configs/qwen_vl_qlora/tiny.yaml`` (the embedded tiny model and image task, no GPU or network).

    accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/qwen_vl_qlora.py [--key value ...]
"""

from fsdp_peft.procedures.vision_sft import VISION_SFT_PROCEDURE
from fsdp_peft.recipe import run_recipe
from fsdp_peft.settings.catalog import CONFIGS

DEFAULT_CONFIG = CONFIGS / "qwen_vl_qlora" / "tiny.yaml"
PROCEDURE = VISION_SFT_PROCEDURE  # what `fsdp-peft validate` and `plan` check and plan this recipe's configs as

if __name__ == "__main__":
    run_recipe("qwen_vl_qlora", DEFAULT_CONFIG, procedure=PROCEDURE)
