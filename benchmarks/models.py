"""Random-weight checkpoints for the benchmarks (Llama shapes and a Qwen3-MoE shape), built once into a cache
directory.

``llama_100m_path()``: hidden 768, 12 layers, intermediate 2048, 12 heads, vocab 32000, untied head:
134,105,856 parameters in fp32 safetensors, with the embedded tiny model's byte tokenizer (262 tokens;
ids above it are never fed, which changes no parameter count or memory figure).
``shape_config(name)``: the configs of the GPU check, shapes only: the Llama shapes ``1b`` and ``8b``, and ``moe``,
Qwen3-30B-A3B's layer (hidden 2048, 32 heads of 128, 4 KV heads, experts 768 wide, 8 per token) with 8 layers of
64 experts and a 32k vocabulary: 2.70B parameters (2.42B in the experts); a token passes 0.52B of them
(attention, 8 experts per layer, the head).
``checkpoint_path(name, dtype, device)``: any of them written as a checkpoint, with the same tokenizer.
``vision_checkpoint_path(name, dtype, device)``: ``qwen2.5-vl-7b``, Qwen2.5-VL 7B's shape (its published config,
shipped in ``fsdp_peft/hub_configs``: 8.29B parameters, the vision tower's 32 blocks included) with random weights
and the embedded tiny Qwen2.5-VL's processor (its byte tokenizer; the image processor set to the shape's 14-pixel
patches and to 448x448 images: 256 image tokens each).

    python benchmarks/models.py        # build the ~100M checkpoint and print its path
"""

from __future__ import annotations

import json
import os
from pathlib import Path

LLAMA_SHAPES = {
    "100m": {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "vocab_size": 32000,
    },
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
    },
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    },
}
QWEN3_MOE_SHAPES = {
    "moe": {
        "hidden_size": 2048,
        "intermediate_size": 6144,  # Qwen3-30B-A3B's dense width (a layer in mlp_only_layers; none here)
        "moe_intermediate_size": 768,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 8,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 32000,
        "norm_topk_prob": True,
        "output_router_logits": False,  # as Qwen3-30B-A3B's config: no load-balancing loss
        "rms_norm_eps": 1e-6,
    },
}
SEED = 0


def bench_cache() -> Path:
    """``$FSDP_PEFT_CACHE/bench_models`` (default ``~/.cache/fsdp_peft/bench_models``)."""
    return Path(os.environ.get("FSDP_PEFT_CACHE", Path.home() / ".cache" / "fsdp_peft")) / "bench_models"


def shape_config(name: str):
    """The config of shape ``name`` (a Llama shape, or a Qwen3-MoE one) with the tiny tokenizer's special token ids."""
    from transformers import AutoConfig

    from fsdp_peft.model.tiny import TINY_MODEL_ASSETS

    tiny = AutoConfig.from_pretrained(TINY_MODEL_ASSETS)
    model_type, architecture = (
        ("llama", "LlamaForCausalLM") if name in LLAMA_SHAPES else ("qwen3_moe", "Qwen3MoeForCausalLM")
    )
    config = AutoConfig.for_model(
        model_type,
        **{"rms_norm_eps": 1e-5, **(LLAMA_SHAPES.get(name) or QWEN3_MOE_SHAPES[name])},
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tiny.bos_token_id,
        eos_token_id=tiny.eos_token_id,
        pad_token_id=tiny.pad_token_id,
    )
    config.architectures = [architecture]
    return config


def checkpoint_path(name: str, dtype: str = "float32", device: str = "cpu") -> Path:
    """Checkpoint directory of shape ``name`` (random weights, seed 0), built on first use on ``device``
    (initialising 8B parameters is minutes on a CPU, seconds on a GPU)."""
    from transformers import AutoTokenizer

    from fsdp_peft.model.tiny import TINY_MODEL_ASSETS

    config = shape_config(name)
    target = bench_cache() / f"{config.model_type.replace('_', '-')}-{name}-{dtype}-seed{SEED}"
    if (target / "config.json").is_file():
        return target
    config.dtype = dtype
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_ASSETS)
    return write_random_checkpoint(config, dtype, device, target, tokenizer, "2GB")


def write_random_checkpoint(config, dtype: str, device: str, target: Path, processor, max_shard_size: str) -> Path:
    """The model of ``config`` with random weights (seed `SEED`) initialised in ``dtype`` on ``device``, written with
    ``processor`` (a tokenizer or processor) into ``target`` whole or not at all."""
    import torch
    import transformers

    from fsdp_peft.core.atomic_publish import publish_directory

    torch.manual_seed(SEED)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = getattr(transformers, config.architectures[0])(config)
    finally:
        torch.set_default_dtype(default)
    with publish_directory(target) as staging:
        model.save_pretrained(staging, max_shard_size=max_shard_size)
        processor.save_pretrained(staging)
    return target


def llama_100m_path() -> Path:
    """The ~100M-parameter (134M) Llama-architecture checkpoint of the CPU benchmarks."""
    return checkpoint_path("100m")


if __name__ == "__main__":
    print(llama_100m_path())


VISION_SHAPES = {"qwen2.5-vl-7b": "Qwen--Qwen2.5-VL-7B-Instruct.json"}
VISION_IMAGE_SIDE = 448  # pixels: (448 / 14)^2 patches, merged 2x2: 256 image tokens


def vision_checkpoint_path(name: str, dtype: str = "bfloat16", device: str = "cpu") -> Path:
    """Checkpoint directory of vision-language shape ``name`` (random weights, seed 0), built on first use on
    ``device``, with the tiny Qwen2.5-VL's processor and token ids."""
    from transformers import AutoConfig

    from fsdp_peft.model.paths import HUB_CONFIGS, resolve_model_path
    from fsdp_peft.model.tiny_vision import load_processor

    target = bench_cache() / f"qwen2-5-vl-{name}-{dtype}-seed{SEED}"
    if (target / "config.json").is_file():
        return target
    processor = load_processor(resolve_model_path("tiny-qwen2.5-vl"))
    tokenizer, pixels = processor.tokenizer, VISION_IMAGE_SIDE * VISION_IMAGE_SIDE
    tokenizer.model_max_length = 4096  # the byte tokenizer says 256; rows here reach ~290 tokens
    processor.image_processor.patch_size, processor.image_processor.merge_size = 14, 2
    processor.image_processor.size = {"shortest_edge": pixels, "longest_edge": pixels}
    values = json.loads((HUB_CONFIGS / VISION_SHAPES[name]).read_text())
    ids = {
        "image_token_id": tokenizer.image_token_id,
        "video_token_id": tokenizer.video_token_id,
        "vision_start_token_id": tokenizer.vision_start_token_id,
        "vision_end_token_id": tokenizer.vision_end_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = AutoConfig.for_model(**{**values, **ids, "dtype": dtype})
    return write_random_checkpoint(config, dtype, device, target, processor, "5GB")
