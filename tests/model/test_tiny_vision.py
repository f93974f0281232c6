"""The embedded vision-language models and image task: they reload as hub checkpoints, images become 4 tokens,
builds are deterministic, and the colour data has the promised shape."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fsdp_peft.model import paths, tiny_vision
from fsdp_peft.model.tiny_vision import COLORS, QUESTION, load_processor
from fsdp_peft.settings.choices import TINY_VISION_MODEL_NAMES

ARCHITECTURES = {
    "tiny-qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration",
    "tiny-qwen3-vl": "Qwen3VLForConditionalGeneration",
    "tiny-gemma3-vl": "Gemma3ForConditionalGeneration",
}
QUESTION_ROW = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def pixels(path: Path) -> bytes:
    from PIL import Image

    with Image.open(path) as image:
        return image.tobytes()


@pytest.mark.parametrize("name", TINY_VISION_MODEL_NAMES)
def test_a_tiny_vision_model_reloads_with_the_auto_class_and_its_processor(name):
    from transformers import AutoModelForImageTextToText

    path = Path(paths.resolve_model_path(name))
    assert path == paths.cache_dir() / f"{name}-seed{paths.WEIGHTS_SEED}"
    model, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == ARCHITECTURES[name]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    saved = load_file(path / "model.safetensors")
    assert all(torch.equal(model.state_dict()[key], tensor) for key, tensor in saved.items())
    text = model.config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (
        128,
        4,
        4,
        2,
    )
    processor = load_processor(path)
    tokenizer = processor.tokenizer
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|begin_of_text|>",
        "<|end|>",
        "<|pad|>",
    )
    assert tokenizer.image_token_id == model.config.image_token_id
    assert all(token in tokenizer.get_vocab() for token in ("<|user|>", "<|assistant|>", "<|system|>"))


@pytest.mark.parametrize(
    ("name", "prompt"),
    [
        (
            "tiny-qwen2.5-vl",
            "<|user|><|vision_start|><|image_pad|><|vision_end|>What color is this?<|end|><|assistant|>",
        ),
        (
            "tiny-qwen3-vl",
            "<|user|><|vision_start|><|image_pad|><|vision_end|>What color is this?<|end|><|assistant|>",
        ),
        ("tiny-gemma3-vl", "<|begin_of_text|><|user|><start_of_image>What color is this?<|end|><|assistant|>"),
    ],
)
def test_one_image_becomes_four_image_tokens_and_its_colour_changes_the_logits(name, prompt):
    from transformers import AutoModelForImageTextToText

    path = paths.resolve_model_path(name)
    processor = load_processor(path)
    text = processor.apply_chat_template(QUESTION_ROW, add_generation_prompt=True, tokenize=False)
    assert text == prompt
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    rng = np.random.default_rng(0)
    logits = []
    for color in ("red", "blue"):
        inputs = processor(images=[[tiny_vision.color_image(color, rng)]], text=[text], return_tensors="pt")
        assert int((inputs["input_ids"][0] == model.config.image_token_id).sum()) == 4
        with torch.no_grad():
            logits.append(model(**inputs).logits[0, -1])
    assert all(torch.isfinite(row).all() for row in logits)
    assert not torch.allclose(*logits)  # image features reach the language model (Gemma's projector is not zero)


def test_the_chat_templates_take_string_content_and_end_every_message_with_eos():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say red."}]
    for name, begin in (("tiny-qwen2.5-vl", ""), ("tiny-qwen3-vl", ""), ("tiny-gemma3-vl", "<|begin_of_text|>")):
        processor = load_processor(paths.resolve_model_path(name))
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text == f"{begin}<|system|>be brief<|end|><|user|>Say red.<|end|><|assistant|>"


def test_building_twice_gives_identical_files_and_leaves_the_global_random_state_alone(tmp_path, monkeypatch):
    first = [Path(paths.resolve_model_path(name)) for name in TINY_VISION_MODEL_NAMES] + [paths.tiny_colors_path()]
    monkeypatch.setenv("FSDP_PEFT_CACHE", str(tmp_path))
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    second = [Path(paths.resolve_model_path(name)) for name in TINY_VISION_MODEL_NAMES] + [paths.tiny_colors_path()]
    assert torch.equal(torch.rand(4), expected)
    for old, new in zip(first, second):
        assert new.parent == tmp_path and old != new
        files = sorted(p.relative_to(old) for p in old.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(new) for p in new.rglob("*") if p.is_file())
        assert all((old / f).read_bytes() == (new / f).read_bytes() for f in files), old.name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging directory left behind


def test_the_colour_task_has_its_row_counts_a_quarter_text_only_and_disjoint_32px_images():
    from PIL import Image

    directory = paths.tiny_colors_path()
    train, evaluation = read_rows(directory / "train.jsonl"), read_rows(directory / "eval.jsonl")
    assert (len(train), len(evaluation)) == (400, 48)
    text_only = [row for row in train if not row["images"]]
    assert len(text_only) == 100
    for row in text_only:
        answer = row["messages"][1]["content"][0]["text"]
        assert row["messages"][0]["content"] == [{"type": "text", "text": f"Say {answer}."}]
    for row in [row for row in train if row["images"]] + evaluation:
        user, assistant = row["messages"]
        assert user == {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
        assert assistant["role"] == "assistant" and assistant["content"][0]["text"] in COLORS
        assert len(row["images"]) == 1 and not Path(row["images"][0]).is_absolute()
    answers = [row["messages"][1]["content"][0]["text"] for row in evaluation]
    assert {color: answers.count(color) for color in COLORS} == dict.fromkeys(COLORS, 6)
    images = {
        split: [directory / row["images"][0] for row in rows if row["images"]]
        for split, rows in (("train", train), ("eval", evaluation))
    }
    for path in images["train"] + images["eval"]:
        with Image.open(path) as image:
            assert (image.size, image.mode) == ((32, 32), "RGB")
    train_pixels = {pixels(path) for path in images["train"]}
    assert not train_pixels & {pixels(path) for path in images["eval"]}
    assert len(train_pixels) == 300


def test_an_unknown_embedded_model_name_lists_the_vision_models_too():
    with pytest.raises(ValueError, match="tiny-llama.*tiny-qwen2.5-vl, tiny-qwen3-vl, tiny-gemma3-vl"):
        paths.tiny_model_path("tiny-llava")
