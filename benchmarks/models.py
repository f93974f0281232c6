"""Random-weight Llama-architecture checkpoints for the benchmarks, built once into a cache directory.

``llama_100m_path()``: hidden 768, 12 layers, intermediate 2048, 12 heads, vocab 32000, untied head:
134,105,856 parameters in fp32 safetensors, with the embedded tiny model's byte tokenizer (262 tokens;
ids above it are never fed, which changes no parameter count or memory figure).
``llama_config(name)``: the configs of the GPU check (``1b``, ``8b``), shapes only.

    python benchmarks/models.py        # build the ~100M checkpoint and print its path
"""

from __future__ import annotations

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
SEED = 0


def bench_cache() -> Path:
    """``$FSDP_PEFT_CACHE/bench_models`` (default ``~/.cache/fsdp_peft/bench_models``)."""
    return Path(os.environ.get("FSDP_PEFT_CACHE", Path.home() / ".cache" / "fsdp_peft")) / "bench_models"


def llama_config(name: str):
    """A `LlamaConfig` of the shape ``name`` with the tiny tokenizer's special token ids."""
    from transformers import AutoConfig

    from fsdp_peft.tiny import TINY_MODEL_ASSETS

    tiny = AutoConfig.from_pretrained(TINY_MODEL_ASSETS)
    config = AutoConfig.for_model(
        "llama",
        **LLAMA_SHAPES[name],
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tiny.bos_token_id,
        eos_token_id=tiny.eos_token_id,
        pad_token_id=tiny.pad_token_id,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def llama_path(name: str, dtype: str = "float32", device: str = "cpu") -> Path:
    """Checkpoint directory of shape ``name`` (random weights, seed 0), built on first use on ``device``
    (initialising 8B parameters is minutes on a CPU, seconds on a GPU)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from fsdp_peft.files import publish_directory
    from fsdp_peft.tiny import TINY_MODEL_ASSETS

    target = bench_cache() / f"llama-{name}-{dtype}-seed{SEED}"
    if (target / "config.json").is_file():
        return target
    config = llama_config(name)
    config.dtype = dtype
    torch.manual_seed(SEED)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    with publish_directory(target) as staging:
        model.save_pretrained(staging, max_shard_size="2GB")
        AutoTokenizer.from_pretrained(TINY_MODEL_ASSETS).save_pretrained(staging)
    return target


def llama_100m_path() -> Path:
    """The ~100M-parameter (134M) Llama-architecture checkpoint of the CPU benchmarks."""
    return llama_path("100m")


if __name__ == "__main__":
    print(llama_100m_path())
