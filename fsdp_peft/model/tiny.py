"""The embedded default: a tiny model of each family, a byte-level tokenizer, and a string-reversal dataset.

The tiny Llama's config, the tokenizer and the data ship inside the package (``fsdp_peft/assets``) so
that a recipe runs on a machine with no network. The other families' tiny models (``tiny-qwen2``,
``tiny-qwen3``, ``tiny-mistral``, and the mixtures of experts ``tiny-qwen3-moe`` and ``tiny-mixtral``; see
`fsdp_peft.settings.families`) are the same sizes in their own
architecture, configured in `TINY_FAMILY_CONFIGS`, with the same tokenizer. No weights are shipped:
they are created from a fixed seed and written once to a local cache as an ordinary Hugging Face
checkpoint, so that loading, 4-bit quantization and everything after it run exactly the code a hub
model runs. Where they are written, and when (on first use), is `fsdp_peft.model.paths.tiny_model_path`.

LAZY: the functions that build import transformers, tokenizers and safetensors themselves: the names and
constants here are read by `fsdp_peft.model.paths` on every export, which must not pay seconds of imports for
model code it does not run.

Regenerate the shipped assets (deterministic, byte-identical) with::

    python -m fsdp_peft.model.tiny --write-assets
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import string
from pathlib import Path

import torch

from fsdp_peft.model.real_tasks import write_assets as write_real_tasks
from fsdp_peft.model.real_tasks import write_splits
from fsdp_peft.settings.choices import TINY_MODEL_NAME
from fsdp_peft.settings.families import tiny_family

ASSETS = Path(__file__).parents[1] / "assets"
TINY_MODEL_ASSETS = ASSETS / "tiny_llama"
TINY_DATASET_DIR = ASSETS / "tiny_reverse"
TINY_PREFERENCE_DIR = ASSETS / "tiny_preference"
PREFERENCE_DATA_SEED = 11
WEIGHTS_SEED = 1234
DATA_SEED = 7
WORD_LENGTH = 5
TRAIN_ROWS = 2000
EVAL_ROWS = 200

SPECIAL_TOKENS = {
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|end|>",
    "pad_token": "<|pad|>",
}
ROLE_TOKENS = ["<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}


# The other families' tiny models: the tiny Llama's sizes, plus what their architectures need.
TINY_SIZES = {
    key: TINY_CONFIG[key]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "hidden_act",
        "initializer_range",
        "tie_word_embeddings",
    )
}
HEAD_DIM = TINY_CONFIG["hidden_size"] // TINY_CONFIG["num_attention_heads"]
TINY_FAMILY_CONFIGS = {
    "tiny-qwen2": {**TINY_SIZES, "use_sliding_window": False},  # q/k/v projections carry a bias
    "tiny-qwen3": {**TINY_SIZES, "head_dim": HEAD_DIM, "attention_bias": False},  # q/k norms per head
    "tiny-mistral": {**TINY_SIZES, "head_dim": HEAD_DIM, "sliding_window": None},
    # Mixtures of experts: 8 experts of a quarter of the dense MLP's width, 2 per token; the router's auxiliary
    # loss on (coefficient 0.01), as in a real run's config; Mixtral's router without jitter (what its config says)
    "tiny-qwen3-moe": {
        **TINY_SIZES,
        "head_dim": HEAD_DIM,
        "attention_bias": False,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": TINY_SIZES["intermediate_size"] // 4,
        "norm_topk_prob": True,  # as Qwen3-30B-A3B
        "output_router_logits": True,
        "router_aux_loss_coef": 0.01,
    },
    "tiny-mixtral": {
        **TINY_SIZES,
        "head_dim": HEAD_DIM,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": TINY_SIZES["intermediate_size"] // 4,
        "output_router_logits": True,
        "router_aux_loss_coef": 0.01,
        "router_jitter_noise": 0.0,
    },
}


def build_tokenizer():
    """A byte-level tokenizer: one token per byte plus special and role tokens, with a chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # lazy: see LAZY
    from transformers import PreTrainedTokenizerFast  # lazy: see LAZY

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = list(SPECIAL_TOKENS.values()) + ROLE_TOKENS
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=CHAT_TEMPLATE,
        model_max_length=TINY_CONFIG["max_position_embeddings"],
        padding_side="right",
        **SPECIAL_TOKENS,
    )


def build_config(tokenizer):
    """The tiny model's ``LlamaConfig``, with vocabulary and special token ids taken from the tokenizer."""
    from transformers import LlamaConfig  # lazy: see LAZY

    fields = {key: value for key, value in TINY_CONFIG.items() if key not in ("architectures", "model_type")}
    return LlamaConfig(
        **fields,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=TINY_CONFIG["architectures"],
    )


def make_reverse_rows(count: int, rng: random.Random, exclude: set[str]) -> list[dict]:
    """Rows asking to reverse a random lowercase word; words in ``exclude`` are never drawn."""
    rows = []
    while len(rows) < count:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(WORD_LENGTH))
        if word in exclude:
            continue
        exclude.add(word)
        rows.append({"prompt": f"reverse: {word}", "completion": word[::-1]})
    return rows


def make_preference_rows(count: int, rng: random.Random, exclude: set[str]) -> list[dict]:
    """Preference pairs for reversal: chosen is the reversed word, rejected the plausible mistake of copying it."""
    rows = []
    while len(rows) < count:
        (row,) = make_reverse_rows(1, rng, exclude)
        if row["completion"] != row["completion"][::-1]:  # a palindrome has no wrong copy
            rows.append({"prompt": row["prompt"], "chosen": row["completion"], "rejected": row["completion"][::-1]})
    return rows


def write_assets(assets: Path = ASSETS) -> None:
    """Write the shipped tokenizer, config and dataset; deterministic, so reruns give identical files."""
    tokenizer = build_tokenizer()
    model_dir = assets / "tiny_llama"
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(model_dir)
    build_config(tokenizer).save_pretrained(model_dir)

    rng = random.Random(DATA_SEED)
    seen: set[str] = set()
    reversal = {
        split: make_reverse_rows(count, rng, seen) for split, count in (("train", TRAIN_ROWS), ("eval", EVAL_ROWS))
    }
    write_splits(assets / "tiny_reverse", reversal)
    rng = random.Random(PREFERENCE_DATA_SEED)
    seen = set()
    splits = (("train", TRAIN_ROWS), ("eval", EVAL_ROWS))
    write_splits(assets / "tiny_preference", {split: make_preference_rows(n, rng, seen) for split, n in splits})
    write_real_tasks(assets)  # SmolLM2's tasks, from their own seeds


def build_family_config(name: str, tokenizer):
    """The config of tiny model ``name`` (not the Llama: its config ships in the assets)."""
    from transformers import CONFIG_MAPPING  # lazy: see LAZY

    family = tiny_family(name)
    return CONFIG_MAPPING[family.model_types[0]](
        **TINY_FAMILY_CONFIGS[name],
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[family.tiny_architecture],
    )


def write_tiny_model(name: str, directory: Path) -> None:
    """Tiny model ``name`` (tokenizer, config, weights from the seed) written into ``directory``."""
    from transformers import AutoConfig, AutoTokenizer  # lazy: see LAZY

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_ASSETS)
    config = (
        AutoConfig.from_pretrained(TINY_MODEL_ASSETS)
        if name == TINY_MODEL_NAME
        else build_family_config(name, tokenizer)
    )
    write_checkpoint(directory, config, tokenizer)


def write_checkpoint(directory: Path, config, tokenizer) -> None:
    """Weights from the seed, as ``model.safetensors`` next to config, generation config and tokenizer.

    Written with safetensors directly rather than ``save_pretrained``, which writes on global rank 0
    only: every rank (and every node) may need to build its own copy. The global random state is left as it
    was: a recipe that builds the model on first use, after seeding, must draw the same LoRA init as one that
    finds it built (and every rank the same, whichever ranks built it).
    """
    import transformers  # lazy: see LAZY
    from safetensors.torch import save_file  # lazy: see LAZY
    from transformers import GenerationConfig  # lazy: see LAZY

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(WEIGHTS_SEED)
        model = getattr(transformers, config.architectures[0])(config)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # stored once, as the embedding
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if not (directory / "config.json").is_file():
        raise RuntimeError(f"building the tiny model in {directory} left no config.json")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="`fsdp-peft tiny-model NAME` builds a tiny model in the cache and prints its path",
    )
    parser.add_argument(
        "--write-assets", action="store_true", required=True, help="rewrite fsdp_peft/assets from the seeds"
    )
    parser.parse_args()
    write_assets()
    print(f"wrote {ASSETS}")


if __name__ == "__main__":
    main()


def write_remote_code_copy(source: Path, destination: Path) -> Path:
    """A copy of model ``source`` whose code lives in its directory (``NovaForCausalLM``, a Llama subclass, behind
    ``auto_map``): a model that loads only with ``trust_remote_code``, for the tests and the exit-code stress
    check. Returns ``destination``."""
    shutil.copytree(source, destination)
    (destination / "configuration_nova.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass NovaConfig(LlamaConfig):\n    model_type = 'nova_llama'\n"
    )
    (destination / "modeling_nova.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_nova import NovaConfig\n\n\n"
        "class NovaForCausalLM(LlamaForCausalLM):\n    config_class = NovaConfig\n"
    )
    config = json.loads((destination / "config.json").read_text())
    config.update(
        model_type="nova_llama",
        architectures=["NovaForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_nova.NovaConfig",
            "AutoModelForCausalLM": "modeling_nova.NovaForCausalLM",
        },
    )
    (destination / "config.json").write_text(json.dumps(config))
    return destination
