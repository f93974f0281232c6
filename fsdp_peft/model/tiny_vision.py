"""The embedded vision-language defaults: a tiny Qwen2.5-VL, Qwen3-VL and Gemma 3 with processors, and a colour task.

``tiny-qwen2.5-vl`` (``Qwen2_5_VLForConditionalGeneration``), ``tiny-qwen3-vl`` (``Qwen3VLForConditionalGeneration``,
its first vision block's features also added to the first decoder layer's image positions: Qwen3-VL's "deepstack")
and ``tiny-gemma3-vl`` (``Gemma3ForConditionalGeneration``) have the text tiny models' sizes (width 128, 4 layers,
4/2 heads) and a 2-layer vision tower of width 64 that turns a 32x32 image into 4 image tokens. Their tokenizer is
the embedded byte tokenizer (`fsdp_peft.model.tiny`) plus the family's image special tokens; their chat templates render
a ``{"type": "image"}`` content part as the family's image placeholder. Like the text tiny models they are built from a
fixed seed into the cache on first use (`fsdp_peft.model.paths.tiny_model_path`) as ordinary Hugging Face checkpoints
that reload with ``AutoModelForImageTextToText``; the processor reloads with `load_processor`.

``tiny-colors`` (`fsdp_peft.model.paths.tiny_colors_path`) is the image task: 32x32 PNGs of 8 colours with jitter and
noise, "What color is this?" answered by the colour's name, in the TRL/hub chat format (``messages`` with
content parts, ``images`` relative to the jsonl). A quarter of the training rows are text-only ("Say red." →
"red"), so that batches mixing images and text occur.

LAZY: transformers, safetensors and PIL are imported inside the functions that build: `fsdp_peft.model.paths` reads
the names here on cheap code paths. The module imports no other of the package (it sits on the import layers
below `fsdp_peft.model.paths`): the byte tokenizer's directory and the weights' seed come in as arguments.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

from fsdp_peft.settings.choices import TINY_GEMMA_VL_NAME, TINY_QWEN3_VL_NAME, TINY_QWEN_VL_NAME

COLORS_SEED = 21
IMAGE_SIZE = 32  # pixels per side: 4x4 patches of 8 pixels, merged or pooled 2x2 into 4 image tokens
PATCH_SIZE = 8
IMAGE_TOKENS = 4
MAX_LENGTH = 256
PROJECTOR_SEED = 4321  # Gemma 3's projector is zero-initialised: image features would all be zero

TEXT_SIZES = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": MAX_LENGTH,
}
VISION_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_heads": 2}

# The family's image special tokens, by the names the processors read (``tokenizer.image_token`` ...).
IMAGE_TOKENS_OF = {
    TINY_QWEN_VL_NAME: {
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
    },
    TINY_QWEN3_VL_NAME: {
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
    },
    TINY_GEMMA_VL_NAME: {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    },
}


ROLES = ("system", "user", "assistant")  # each a token of the byte tokenizer: <|system|> ...


def chat_template(image_placeholder: str, begin: str = "") -> str:
    """The text tiny models' template (roles as tokens, every message ending in eos) over content given as a
    string or as a list of parts, an image part rendered as ``image_placeholder``."""
    return (
        begin + "{% for message in messages %}"
        f"{{% if message['role'] not in {list(ROLES)} %}}"
        "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
        "{{ '<|' + message['role'] + '|>' }}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{image_placeholder}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )


QWEN_VL_CHAT_TEMPLATE = chat_template("<|vision_start|><|image_pad|><|vision_end|>")
GEMMA_VL_CHAT_TEMPLATE = chat_template("<start_of_image>", begin="{{ bos_token }}")  # Gemma's starts with bos

COLORS = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 50, 220),
    "yellow": (230, 220, 40),
    "white": (240, 240, 240),
    "black": (15, 15, 15),
    "purple": (130, 40, 160),
    "orange": (240, 140, 20),
}
QUESTION = "What color is this?"
COLORS_TRAIN_ROWS = 400
COLORS_TEXT_ONLY_ROWS = 100  # a quarter of the training rows
COLORS_EVAL_PER_COLOR = 6
NOISE = 20.0  # per-pixel standard deviation
JITTER = 25.0  # per-image shift of each channel, at most


def build_tokenizer(name: str, text_tokenizer: Path):
    """The byte tokenizer saved in ``text_tokenizer`` (its bos, eos, pad and role tokens) plus model ``name``'s
    image tokens."""
    from transformers import TokenizersBackend  # lazy: see LAZY

    saved = json.loads((text_tokenizer / "tokenizer_config.json").read_text())
    tokenizer = TokenizersBackend(
        tokenizer_file=str(text_tokenizer / "tokenizer.json"),
        bos_token=saved["bos_token"],
        eos_token=saved["eos_token"],
        pad_token=saved["pad_token"],
        model_max_length=MAX_LENGTH,
        extra_special_tokens=IMAGE_TOKENS_OF[name],  # also sets tokenizer.image_token, tokenizer.image_token_id ...
    )
    missing = [f"<|{role}|>" for role in ROLES if f"<|{role}|>" not in tokenizer.get_vocab()]
    if missing:
        raise RuntimeError(f"the byte tokenizer in {text_tokenizer} lacks the role tokens {missing}")
    return tokenizer


QWEN_PROCESSORS = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}  # by model_type


@functools.cache
def image_only_qwen_processor(model_type: str = "qwen2_5_vl"):
    """Qwen2.5-VL's or Qwen3-VL's processor without its video processor, which needs torchvision (its ``__init__``
    signature decides what the processor saves and loads)."""
    import transformers  # lazy: see LAZY

    stock = getattr(transformers, QWEN_PROCESSORS[model_type])

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        stock.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(f"ImageOnly{stock.__name__}", (stock,), {"__init__": __init__, "__module__": __name__})


def _qwen_processor(name: str, text_tokenizer: Path, model_type: str):
    """The tokenizer and image-only processor of tiny Qwen VL model ``name``: every image resized to 32x32."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # lazy: see LAZY
        Qwen2VLImageProcessorPil,
    )

    tokenizer = build_tokenizer(name, text_tokenizer)
    pixels = IMAGE_SIZE * IMAGE_SIZE
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE, merge_size=2, temporal_patch_size=2, min_pixels=pixels, max_pixels=pixels
    )
    processor = image_only_qwen_processor(model_type)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN_VL_CHAT_TEMPLATE
    )
    return tokenizer, processor


def _qwen_token_ids(tokenizer) -> dict:
    return {
        "image_token_id": tokenizer.image_token_id,
        "video_token_id": tokenizer.video_token_id,
        "vision_start_token_id": tokenizer.vision_start_token_id,
        "vision_end_token_id": tokenizer.vision_end_token_id,
    }


def _qwen_text_config(tokenizer, head_dim: int | None = None, mrope_interleaved: bool = False) -> dict:
    """A tiny Qwen VL model's language model: the text tiny models' sizes, 3D rotary sections (time, height, width)
    that sum to half the head's width, an untied head."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    return {
        **TEXT_SIZES,
        **({"head_dim": head_dim} if head_dim else {}),
        "vocab_size": len(tokenizer),
        "rope_parameters": {**rope, **({"mrope_interleaved": True} if mrope_interleaved else {})},
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
    }


def _qwen_vision_config(**family) -> dict:
    """A tiny Qwen VL model's vision tower: 2 blocks, 8-pixel patches merged 2x2, then the family's own keys."""
    return {
        **VISION_SIZES,
        "depth": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": TEXT_SIZES["hidden_size"],
        **family,
    }


def build_qwen_vl(text_tokenizer: Path):
    """Tiny Qwen2.5-VL's config and processor."""
    from transformers import Qwen2_5_VLConfig  # lazy: see LAZY

    tokenizer, processor = _qwen_processor(TINY_QWEN_VL_NAME, text_tokenizer, "qwen2_5_vl")
    config = Qwen2_5_VLConfig(
        text_config=_qwen_text_config(tokenizer),
        vision_config=_qwen_vision_config(window_size=64, fullatt_block_indexes=[1]),
        **_qwen_token_ids(tokenizer),
        tie_word_embeddings=False,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    )
    return config, processor


def build_qwen3_vl(text_tokenizer: Path):
    """Tiny Qwen3-VL's config and processor: the first vision block's features also enter the first decoder layer."""
    from transformers import Qwen3VLConfig  # lazy: see LAZY

    tokenizer, processor = _qwen_processor(TINY_QWEN3_VL_NAME, text_tokenizer, "qwen3_vl")
    config = Qwen3VLConfig(
        text_config=_qwen_text_config(
            tokenizer, head_dim=TEXT_SIZES["hidden_size"] // TEXT_SIZES["num_attention_heads"], mrope_interleaved=True
        ),
        vision_config=_qwen_vision_config(
            deepstack_visual_indexes=[0], num_position_embeddings=(IMAGE_SIZE // PATCH_SIZE) ** 2
        ),
        **_qwen_token_ids(tokenizer),
        tie_word_embeddings=False,
        architectures=["Qwen3VLForConditionalGeneration"],
    )
    return config, processor


def build_gemma_vl(text_tokenizer: Path):
    """Tiny Gemma 3's config and processor."""
    from transformers import Gemma3Config, Gemma3Processor  # lazy: see LAZY
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil  # lazy: see LAZY

    tokenizer = build_tokenizer(TINY_GEMMA_VL_NAME, text_tokenizer)
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=GEMMA_VL_CHAT_TEMPLATE,
        image_seq_length=IMAGE_TOKENS,
    )
    config = Gemma3Config(
        text_config={
            **TEXT_SIZES,
            "vocab_size": len(tokenizer),
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 64,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "tie_word_embeddings": True,
        },
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": VISION_SIZES["hidden_size"],
            "intermediate_size": VISION_SIZES["intermediate_size"],
            "num_attention_heads": VISION_SIZES["num_heads"],
            "num_hidden_layers": 2,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH_SIZE,
            "vision_use_head": False,
        },
        mm_tokens_per_image=IMAGE_TOKENS,  # the 4x4 patches average-pooled 2x2
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id,
        tie_word_embeddings=True,
        architectures=["Gemma3ForConditionalGeneration"],
    )
    return config, processor


def random_model(config, seed: int):
    """The model of ``config`` with weights from ``seed``; the global random state is left as it was (see
    `fsdp_peft.model.tiny.write_checkpoint`). Gemma 3's zero projector is redrawn, else image features are all zero."""
    import transformers  # lazy: see LAZY

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, config.architectures[0])(config)
    projector = getattr(model.model, "multi_modal_projector", None)
    if projector is not None and hasattr(projector, "mm_input_projection_weight"):
        weight = projector.mm_input_projection_weight
        generator = torch.Generator().manual_seed(PROJECTOR_SEED)
        with torch.no_grad():
            weight.copy_(torch.randn(weight.shape, generator=generator) / weight.shape[0] ** 0.5)
    return model


def write_tiny_vision_model(name: str, directory: Path, text_tokenizer: Path, seed: int) -> None:
    """Tiny vision-language model ``name`` (weights from ``seed``, config, generation config, tokenizer and
    processor) written into ``directory``, by every rank that calls it (no rank-0-only ``save_pretrained``).
    ``text_tokenizer``: the directory of the embedded byte tokenizer (`fsdp_peft.model.tiny.TINY_MODEL_ASSETS`)."""
    from safetensors.torch import save_file  # lazy: see LAZY
    from transformers import GenerationConfig  # lazy: see LAZY

    builders = {
        TINY_QWEN_VL_NAME: build_qwen_vl,
        TINY_QWEN3_VL_NAME: build_qwen3_vl,
        TINY_GEMMA_VL_NAME: build_gemma_vl,
    }
    config, processor = builders[name](text_tokenizer)
    model = random_model(config, seed)
    state = {key: tensor.contiguous() for key, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # stored once, as the embedding
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(directory)
    tokenizer = processor.tokenizer
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(directory)
    processor.save_pretrained(directory)  # the tokenizer's files too
    if not (directory / "config.json").is_file():
        raise RuntimeError(f"building the tiny model in {directory} left no config.json")


def load_processor(path):
    """The processor saved at ``path``: the image-only Qwen processor for a Qwen2.5-VL or Qwen3-VL checkpoint (the
    stock one needs torchvision for videos), else ``AutoProcessor``'s."""
    from transformers import AutoProcessor  # lazy: see LAZY

    config = Path(path) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type in QWEN_PROCESSORS:
        return image_only_qwen_processor(model_type).from_pretrained(path)
    return AutoProcessor.from_pretrained(path)


def color_image(color: str, rng: np.random.Generator):
    """A 32x32 RGB image of ``color``, each channel shifted by up to ``JITTER`` and each pixel noised."""
    from PIL import Image  # lazy: see LAZY

    base = np.array(COLORS[color], dtype=np.float32) + rng.uniform(-JITTER, JITTER, 3)
    pixels = np.tile(base, (IMAGE_SIZE, IMAGE_SIZE, 1)) + rng.normal(0, NOISE, (IMAGE_SIZE, IMAGE_SIZE, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def color_row(color: str, image: str | None) -> dict:
    """One chat row: the question about ``image`` (a path), or without one the text-only "Say <color>."."""
    if image is None:
        user = [{"type": "text", "text": f"Say {color}."}]
    else:
        user = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    messages = [
        {"role": "user", "content": user},
        {"role": "assistant", "content": [{"type": "text", "text": color}]},
    ]
    return {"messages": messages, "images": [] if image is None else [image]}


def write_tiny_colors(directory: Path) -> None:
    """The colour task from its seed into ``directory``: ``train.jsonl``, ``eval.jsonl`` and ``images/``."""
    rng = np.random.default_rng(COLORS_SEED)
    names = list(COLORS)
    (directory / "images").mkdir()
    text_only = set(rng.choice(COLORS_TRAIN_ROWS, COLORS_TEXT_ONLY_ROWS, replace=False).tolist())
    splits = {
        "train": [names[i] for i in rng.integers(len(names), size=COLORS_TRAIN_ROWS)],
        "eval": [names[i] for i in rng.permutation(np.repeat(np.arange(len(names)), COLORS_EVAL_PER_COLOR))],
    }
    for split, colors in splits.items():
        rows = []
        for index, color in enumerate(colors):
            if split == "train" and index in text_only:
                rows.append(color_row(color, None))
                continue
            image = f"images/{split}_{index:04d}.png"
            color_image(color, rng).save(directory / image)
            rows.append(color_row(color, image))
        with open(directory / f"{split}.jsonl", "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
