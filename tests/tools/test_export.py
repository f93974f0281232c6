"""Merged export on the tiny model: bad input is refused before writing, interruptions leave nothing, NF4."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_command, tiny_llama_in_4bit
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.safetensors_io import parse_size
from fsdp_peft.model.paths import tiny_model_path
from fsdp_peft.tools.export import CHAT_TEMPLATE_NOTE, export_merged, has_chat_template, has_processor, usage_section


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_model_dir):
    """A LoRA adapter on q_proj and v_proj with non-zero B, saved by peft itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.02)
    directory = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(directory)
    return directory


def _base_variant(tmp_path, tiny_model_dir, **changes):
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    for key, value in changes.items():
        setattr(config, key, value)
    directory = tmp_path / "other_base"
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_hidden_layers": 2}, "adapts 'model.layers.2.self_attn.q_proj.weight', which base"),
        ({"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}, "is [64, 64] in base"),
    ],
)
def test_adapter_that_does_not_fit_the_base_is_refused_before_writing(
    adapter_dir, tiny_model_dir, tmp_path, changes, message
):
    base = _base_variant(tmp_path, tiny_model_dir, **changes)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        export_merged(adapter_dir, tmp_path / "out", base=str(base), progress=False)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_adapter_for_another_architecture_is_refused_before_writing(adapter_dir, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    base = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=300)).save_pretrained(base)
    with pytest.raises(
        ConfigError, match="which base .* does not have \\(different architecture, or the wrong --base\\)"
    ):
        export_merged(adapter_dir, tmp_path / "out", base=str(base), progress=False)
    assert not (tmp_path / "out").exists()


def test_existing_output_is_refused_unless_overwrite(adapter_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match=f"--out: {out} exists; pass --overwrite to replace it"):
        export_merged(adapter_dir, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    export_merged(adapter_dir, out, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_source_that_is_none_of_the_kinds_is_a_clear_cli_error(tmp_path):
    result = run_command([sys.executable, "-m", "fsdp_peft.cli", "export", str(tmp_path), "--out", str(tmp_path / "o")])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"error: SOURCE: {tmp_path} is none of: an adapter directory" in result.stderr


def test_shards_respect_the_maximum_size_and_are_indexed(adapter_dir, tmp_path):
    out = export_merged(adapter_dir, tmp_path / "out", dtype="fp32", max_shard_size="1MB", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and set(index["weight_map"].values()) == {p.name for p in shards}
    largest_tensor = max(t.numel() * 4 for p in shards for t in load_file(p).values())
    assert all(p.stat().st_size <= max(1_000_000, largest_tensor) + 100_000 for p in shards)
    readme = (out / "README.md").read_text()  # the tiny Llama's tokenizer has a chat template
    assert "AutoModelForCausalLM.from_pretrained" in readme and "AutoModelForImageTextToText" not in readme
    assert CHAT_TEMPLATE_NOTE in readme and "apply_chat_template(" in readme


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-gemma3-vl"])
@pytest.mark.parametrize("chat_template", [True, False])
def test_the_model_card_loads_with_the_model_auto_class_and_prompts_as_its_tokenizer_needs(name, chat_template):
    """Vision-language models load with AutoModelForImageTextToText and their processor (AutoModelForCausalLM
    fails on them); a tokenizer with a chat template gets the template snippet and the note, else a raw prompt."""
    directory = tiny_model_path(name)
    vision = name.endswith("-vl")
    assert has_processor(directory) == vision
    readme = "\n".join(usage_section(json.loads((directory / "config.json").read_text()), chat_template, vision))
    assert ("AutoModelForImageTextToText.from_pretrained(" in readme) == vision
    assert ("AutoModelForCausalLM" in readme) != vision  # the class that fails on a vision-language model
    assert ("AutoProcessor.from_pretrained(" in readme) == vision
    assert (CHAT_TEMPLATE_NOTE in readme) == chat_template
    assert ("apply_chat_template(" in readme) == chat_template
    assert ('(text="The capital of France is"' in readme) != chat_template


def test_a_chat_template_is_found_in_any_file_that_carries_one(tmp_path):
    """The template file, or tokenizer_config.json or processor_config.json holding one; not an empty entry."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": None}))
    assert not has_chat_template(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert has_chat_template(tmp_path)
    (tmp_path / "processor_config.json").unlink()
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert has_chat_template(tmp_path)


def test_nf4_variant_merges_onto_the_weights_4bit_training_saw(adapter_dir, tiny_model_dir, tmp_path):
    """The independent reference: transformers' own 4-bit load of the base, decoded by the reference decoder
    (tests/four_bit_reference.py: the NF4 definition, not bitsandbytes' dequantization)."""
    from four_bit_reference import decode

    out = export_merged(adapter_dir, tmp_path / "nf4", dtype="fp32", base_variant="nf4", progress=False)
    merged = load_file(out / "model.safetensors")
    exact = load_file(
        export_merged(adapter_dir, tmp_path / "exact", dtype="fp32", progress=False) / "model.safetensors"
    )
    quantized = tiny_llama_in_4bit(tiny_model_dir)
    adapter = load_file(adapter_dir / "adapter_model.safetensors")
    for name in ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"):
        weight = quantized.get_submodule(name).weight
        expected = decode(weight.data, weight.quant_state).float()  # in the load dtype, as training computed
        if name.endswith("q_proj"):  # adapted: plus the LoRA delta (alpha / r = 2)
            prefix = f"base_model.model.{name}"
            expected = expected + (adapter[f"{prefix}.lora_B.weight"] @ adapter[f"{prefix}.lora_A.weight"]) * 2.0
        assert torch.equal(merged[f"{name}.weight"], expected), name
        assert not torch.equal(merged[f"{name}.weight"], exact[f"{name}.weight"])
    assert torch.equal(merged["model.embed_tokens.weight"], exact["model.embed_tokens.weight"])  # never quantized


def test_killed_export_leaves_no_output_that_looks_complete(adapter_dir, tmp_path):
    out = tmp_path / "out"
    script = (
        "import sys, time\n"
        "from fsdp_peft.tools import export\n"
        "write = export.StreamingShardWriter.write\n"
        "def slow_write(self, key, tensor):\n"
        "    write(self, key, tensor); time.sleep(0.05)\n"
        "export.StreamingShardWriter.write = slow_write\n"
        f"export.export_merged({str(adapter_dir)!r}, {str(out)!r}, dtype='fp32', max_shard_size='200KB', "
        "progress=False)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 60
    while not list(tmp_path.glob(".out.partial.*/model-00002-of-*.safetensors")) and time.time() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the export finished before it could be interrupted"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not out.exists()
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert leftovers and all(name.startswith(".out.partial.") for name in leftovers)  # hidden, never named out


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30), ("1024", 1024)])
def test_shard_sizes_parse_like_hugging_face(text, size):
    assert parse_size(text) == size


def test_verify_reports_the_logit_difference(adapter_dir, tmp_path, capsys):
    export_merged(adapter_dir, tmp_path / "out", dtype="fp32", verify=True, progress=False)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("verify: largest logit difference to base + adapter on 3 prompts:")
    assert float(line.split(": ")[-1].split(" ")[0]) <= 1e-3
