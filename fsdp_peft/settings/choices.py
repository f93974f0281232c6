"""What a user may name without a hub or a GPU: the embedded models and data sets, and the forms of a gather budget.

Plain constants, no torch: the command line lists them in its ``--help`` before anything heavy is imported.
`fsdp_peft.model.tiny` and `fsdp_peft.model.tiny_vision` build what these names stand for.
"""

from __future__ import annotations

TINY_MODEL_NAME = "tiny-llama"  # the default of the recipes
TINY_CAUSAL_LM_NAMES = (TINY_MODEL_NAME, "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-qwen3-moe", "tiny-mixtral")
TINY_QWEN_VL_NAME = "tiny-qwen2.5-vl"
TINY_QWEN3_VL_NAME = "tiny-qwen3-vl"
TINY_GEMMA_VL_NAME = "tiny-gemma3-vl"
TINY_VISION_MODEL_NAMES = (TINY_QWEN_VL_NAME, TINY_QWEN3_VL_NAME, TINY_GEMMA_VL_NAME)
EMBEDDED_MODEL_NAMES = (*TINY_CAUSAL_LM_NAMES, *TINY_VISION_MODEL_NAMES)  # causal LMs, then vision-language models
SMOLLM2_NAME = "smollm2-135m-instruct"  # a real model, built from the package index's copy (fsdp_peft.model.smollm2)
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # offline and not in the hub cache: that same copy
OFFLINE_MODEL_NAMES = (*EMBEDDED_MODEL_NAMES, SMOLLM2_NAME)  # every model a config may name without the hub

TINY_DATASET_NAME = "tiny-reverse"
TINY_PREFERENCE_NAME = "tiny-preference"
TINY_COLORS_NAME = "tiny-colors"  # the image task of the vision-language recipes

GATHER_BUDGET_HELP = "'auto' (half the free device memory), 'all', 'none' (gather per forward) or a size like 8GiB"
COMPILED_CHOICES = ("auto", "true", "false")  # generate_compiled (fsdp_peft.tools.decoding)
COMPILED_DECODING_HELP = (
    "'auto' (on a GPU: a static KV cache and each token's forward compiled, a CUDA graph; eager on CPU, where "
    "compiling costs more than short runs save), 'true' (compiled on CPU too) or 'false' (eager)"
)
UNMERGED_ADAPTER_HELP = (
    "compute with the LoRA adapter unmerged, as in training, instead of merged into the weights for each generate "
    "call (faster, equal up to rounding)"
)

# `kernels`: none, or Liger-Kernel's fused training kernels (`fsdp_peft.model.kernels`)
KERNELS = ("none", "liger")
