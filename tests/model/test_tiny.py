"""The embedded default: shipped assets are reproducible, the data is sound, the weights deterministic."""

from __future__ import annotations

import json
import re

import torch
from safetensors.torch import load_file

from fsdp_peft.model import paths, tiny


def _unstamped(content: bytes) -> bytes:
    """A file's bytes without the version stamp transformers writes into a config (``"transformers_version"``)."""
    return re.sub(rb'"transformers_version": "[^"]*"', b'"transformers_version": ""', content)


def test_shipped_assets_are_exactly_what_the_generator_writes(tmp_path):
    """Byte for byte, but for the stamp of the transformers release that wrote a config (CI's newest-releases step
    regenerates them with another)."""
    tiny.write_assets(tmp_path)
    shipped = sorted(p.relative_to(tiny.ASSETS) for p in tiny.ASSETS.rglob("*") if p.is_file())
    regenerated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert shipped == regenerated
    for relative in shipped:
        ours, theirs = (tiny.ASSETS / relative).read_bytes(), (tmp_path / relative).read_bytes()
        assert _unstamped(ours) == _unstamped(theirs), relative


def test_reversal_data_has_disjoint_splits_of_the_promised_size():
    splits = {}
    for split in ("train", "eval"):
        rows = [json.loads(line) for line in (tiny.TINY_DATASET_DIR / f"{split}.jsonl").read_text().splitlines()]
        for row in rows:
            word = row["prompt"].removeprefix("reverse: ")
            assert len(word) == tiny.WORD_LENGTH and word.isalpha() and row["completion"] == word[::-1]
        splits[split] = {row["prompt"] for row in rows}
        assert len(splits[split]) == len(rows)
    assert len(splits["train"]) == 2000 and len(splits["eval"]) == 200
    assert not splits["train"] & splits["eval"]


def test_tokenizer_is_byte_level_with_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "reverse: héllo ✓"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ih"}], tokenize=False
    )
    assert chat == "<|begin_of_text|><|user|>hi<|end|><|assistant|>ih<|end|>"
    specials = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert len(set(specials)) == 3 and all(i >= 256 for i in specials)


def test_weights_are_built_from_the_seed_and_load_through_from_pretrained(tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("FSDP_PEFT_CACHE", str(tmp_path))
    rebuilt = paths.tiny_model_path()
    assert rebuilt != tiny_model_dir
    first, second = load_file(tiny_model_dir / "model.safetensors"), load_file(rebuilt / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    model = AutoModelForCausalLM.from_pretrained(rebuilt)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 4
    assert torch.equal(model.model.embed_tokens.weight, first["model.embed_tokens.weight"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging directory left behind


def test_building_a_tiny_model_leaves_the_global_random_state_alone(tmp_path):
    from fsdp_peft.model.tiny import TINY_MODEL_NAME, write_tiny_model

    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    write_tiny_model(TINY_MODEL_NAME, tmp_path)
    assert torch.equal(torch.rand(4), expected)
