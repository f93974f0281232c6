"""What export and generate refuse, and what they clean up: an adapter on a base other than the one it
recorded, ``--base-variant nf4`` for an adapter trained on the 16-bit base, and staging directories a
killed export left. Each refusal is one ``error:`` line on stderr, exit code 2, and no change on disk.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_command, run_launch, tiny_llama_in_4bit
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.model.adapter_files import BASE_FILE, base_record
from fsdp_peft.tools.export import export_merged, nf4_round_trip

CLI = [sys.executable, "-m", "fsdp_peft.cli"]
Q_PROJ = "model.layers.1.self_attn.q_proj"
K_PROJ = "model.layers.1.self_attn.k_proj"
# The real CLI export, paused after its tenth tensor (shards already on disk) until `resume` exists.
PAUSED_EXPORT = """
import pathlib, sys, time
from fsdp_peft import cli
from fsdp_peft.tools import export
paused, resume = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
write = export.StreamingShardWriter.write
def write_then_wait(self, key, tensor):
    write(self, key, tensor)
    if self.position == 10:
        self.handle.flush()
        paused.touch()
        while not resume.exists():
            time.sleep(0.05)
export.StreamingShardWriter.write = write_then_wait
cli.main(sys.argv[3:])
"""


def _lora_on(model, directory: Path, recipe: dict) -> Path:
    """Save a LoRA adapter (non-zero B) the way fsdp-peft's Trainer does: peft weights plus its metadata."""
    from peft import LoraConfig, get_peft_model

    from fsdp_peft.procedures.trainer import write_adapter_metadata

    torch.manual_seed(5)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.02)
    peft_model.save_pretrained(directory)
    write_adapter_metadata(peft_model, recipe, directory)
    return directory


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_model_dir) -> Path:
    """A LoRA adapter trained (so to speak) on the 16-bit tiny Llama, with fsdp-peft's records."""
    from transformers import AutoModelForCausalLM

    recipe = {
        "model_name_or_path": str(tiny_model_dir),
        "torch_dtype": "float32",
        "load_in_4bit": False,
        "use_chat_template": False,
    }
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return _lora_on(model, tmp_path_factory.mktemp("adapter"), recipe)


@pytest.fixture(scope="module")
def qlora_adapter(tmp_path_factory, tiny_model_dir) -> Path:
    """A LoRA adapter on the tiny Llama loaded in 4 bits, as the QLoRA recipe loads it."""
    model = tiny_llama_in_4bit(tiny_model_dir)
    directory = tmp_path_factory.mktemp("qlora_adapter")
    model.save_pretrained(directory.parent / f"{directory.name}_prequantized_base")  # a 4-bit checkpoint of it
    recipe = {"model_name_or_path": str(tiny_model_dir), "torch_dtype": "bfloat16", "load_in_4bit": True}
    return _lora_on(model, directory, recipe)


@pytest.fixture(scope="module")
def qwen2_base():
    from fsdp_peft.model.paths import tiny_model_path

    return tiny_model_path("tiny-qwen2")


def checksums(*roots: Path) -> dict[str, str]:
    """sha256 of every file (and a mark for every directory) under ``roots``: 'nothing changed' compares these."""
    files = {}
    for root in roots:
        for path in sorted(Path(root).rglob("*")):
            files[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "directory"
    return files


def refused(arguments: list[str], *roots: Path) -> str:
    """Run the CLI; assert it refused with exactly one stderr line, exit code 2, nothing changed; return the line."""
    before = checksums(*roots)
    result = run_command([*CLI, *arguments])
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(result.stderr.splitlines()) == 1, result.stderr[-3000:]
    assert checksums(*roots) == before
    return result.stderr.strip()


def stderr_lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def merged_with_delta(base_weight: torch.Tensor, adapter_dir: Path, module: str) -> torch.Tensor:
    """``W + (alpha / r) * B @ A`` computed as export does (fp32), from the files on disk."""
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    lora_a, lora_b = (tensors[f"base_model.model.{module}.lora_{x}.weight"] for x in "AB")
    return base_weight.float() + (lora_b.float() @ lora_a.float()) * 2.0


# An adapter is checked against the base it is merged onto or generated with.


def test_adapter_records_the_base_it_was_trained_on(adapter, tiny_model_dir):
    record = json.loads((adapter / BASE_FILE).read_text())
    assert record["architecture"] == "LlamaForCausalLM" and record["model_type"] == "llama"
    assert record["fields"] == {
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 262,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
    assert len(record["fingerprint"]) == 16


def test_base_loaded_in_4bit_and_a_prequantized_copy_have_the_original_fingerprint(qlora_adapter, tiny_model_dir):
    from transformers import AutoConfig

    recorded = json.loads((qlora_adapter / BASE_FILE).read_text())
    prequantized = AutoConfig.from_pretrained(qlora_adapter.parent / f"{qlora_adapter.name}_prequantized_base")
    assert prequantized.quantization_config["load_in_4bit"] is True
    assert recorded == base_record(AutoConfig.from_pretrained(tiny_model_dir)) == base_record(prequantized)


def test_export_refuses_an_adapter_on_a_base_of_another_architecture(adapter, qwen2_base, tmp_path):
    line = refused(
        ["export", str(adapter), "--base", "tiny-qwen2", "--out", str(tmp_path / "out")], tmp_path, adapter, qwen2_base
    )
    assert line == (
        f"error: --base: adapter {adapter} was trained on a LlamaForCausalLM (model_type llama) base, but "
        f"{qwen2_base} is a Qwen2ForCausalLM (model_type qwen2); pass the base it was trained on with --base, "
        f"or add --allow-base-mismatch to use {qwen2_base} anyway"
    )


def test_generate_refuses_an_adapter_on_a_base_of_another_architecture(adapter, qwen2_base, tmp_path):
    line = refused(
        ["generate", str(adapter), "--base", str(qwen2_base), "--prompt", "reverse: hello"],
        tmp_path,
        adapter,
        qwen2_base,
    )
    assert line.startswith(f"error: --base: adapter {adapter} was trained on a LlamaForCausalLM (model_type llama) ")
    assert line.endswith(f"or add --allow-base-mismatch to use {qwen2_base} anyway")


def test_export_refuses_the_same_architecture_with_another_config(adapter, tiny_model_dir, tmp_path):
    """Six layers instead of four: every adapted tensor still has its name and shape in this base."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_hidden_layers = 6
    deeper = tmp_path / "deeper_llama"
    LlamaForCausalLM(config).save_pretrained(deeper)
    line = refused(["export", str(adapter), "--base", str(deeper), "--out", str(tmp_path / "out")], tmp_path, adapter)
    assert line == (
        f"error: --base: adapter {adapter} was trained on another LlamaForCausalLM (model_type llama) than {deeper}: "
        "same architecture, different config (trained vs given): num_hidden_layers 4 vs 6; pass the base it was "
        f"trained on with --base, or add --allow-base-mismatch to use {deeper} anyway"
    )


def test_allow_base_mismatch_merges_onto_the_other_base_with_one_warning(adapter, qwen2_base, tmp_path):
    out = tmp_path / "out"
    result = run_command(
        [
            *CLI,
            "export",
            str(adapter),
            "--base",
            str(qwen2_base),
            "--out",
            str(out),
            "--dtype",
            "fp32",
            "--allow-base-mismatch",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert stderr_lines(result.stderr, "warning:") == [
        f"warning: --allow-base-mismatch: adapter {adapter} was trained on a LlamaForCausalLM (model_type llama) "
        f"base, but {qwen2_base} is a Qwen2ForCausalLM (model_type qwen2); using it anyway, as asked"
    ]
    merged, base = load_file(out / "model.safetensors"), load_file(qwen2_base / "model.safetensors")
    assert torch.equal(merged[f"{Q_PROJ}.weight"], merged_with_delta(base[f"{Q_PROJ}.weight"], adapter, Q_PROJ))
    assert torch.equal(merged[f"{Q_PROJ}.bias"], base[f"{Q_PROJ}.bias"].float())  # Qwen2's own bias, kept


def test_generate_with_allow_base_mismatch_warns_once_and_generates(adapter, qwen2_base):
    result = run_command(
        [
            *CLI,
            "generate",
            str(adapter),
            "--base",
            str(qwen2_base),
            "--allow-base-mismatch",
            "--prompt",
            "reverse: hello",
            "--max-new-tokens",
            "4",
            "--json",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(stderr_lines(result.stderr, "warning: --allow-base-mismatch: adapter ")) == 1
    assert [json.loads(line)["prompt"] for line in result.stdout.splitlines()] == ["reverse: hello"]
    assert f"generating from adapter {adapter} on {qwen2_base}" in result.stderr


def test_the_recorded_base_exports_and_generates_without_a_note(adapter, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    exported = run_launch([*CLI, "export", str(adapter), "--out", str(out), "--dtype", "fp32"])
    assert exported.returncode == 0, exported.stderr[-3000:]
    merged, base = load_file(out / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert torch.equal(merged[f"{Q_PROJ}.weight"], merged_with_delta(base[f"{Q_PROJ}.weight"], adapter, Q_PROJ))
    generated = run_launch([*CLI, "generate", str(adapter), "--prompt", "reverse: hello", "--max-new-tokens", "4"])
    assert generated.returncode == 0, generated.stderr[-3000:]
    for result in (exported, generated):
        assert not stderr_lines(result.stderr, "[fsdp-peft] note:") and not stderr_lines(result.stderr, "warning:")


IMPORTS_AFTER_EXPORT = """
import json, sys
from fsdp_peft.tools.export import export_merged
export_merged(sys.argv[1], sys.argv[2], base=sys.argv[3], dtype="fp32", progress=False)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"transformers", "peft", "bitsandbytes"})))
"""


def test_export_runs_without_transformers_unless_the_config_leaves_a_field_to_the_class(
    adapter, tiny_model_dir, tmp_path
):
    """The base's config.json states every recorded field: no transformers, peft or bitsandbytes is imported,
    and the copied config, generation config and tokenizer load as the base's. A config.json that leaves
    ``mlp_bias`` to the class default is checked through transformers' config class, and accepted."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out = tmp_path / "out"
    result = run_command([sys.executable, "-c", IMPORTS_AFTER_EXPORT, str(adapter), str(out), str(tiny_model_dir)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
    exported, base = AutoConfig.from_pretrained(out), AutoConfig.from_pretrained(tiny_model_dir)
    assert exported.dtype == torch.float32 and base_record(exported) == base_record(base)
    assert GenerationConfig.from_pretrained(out).to_dict() == GenerationConfig.from_pretrained(tiny_model_dir).to_dict()
    text = "<|user|>reverse: hello<|end|>"
    ids = [AutoTokenizer.from_pretrained(directory)(text)["input_ids"] for directory in (out, tiny_model_dir)]
    assert ids[0] == ids[1] and len(ids[0]) > 3

    sparse = tmp_path / "sparse_base"
    shutil.copytree(tiny_model_dir, sparse)
    config = json.loads((sparse / "config.json").read_text())
    assert config.pop("mlp_bias") is False
    (sparse / "config.json").write_text(json.dumps(config))
    result = run_command([sys.executable, "-c", IMPORTS_AFTER_EXPORT, str(adapter), str(tmp_path / "o2"), str(sparse)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == ["transformers"]


def test_adapter_without_a_record_is_accepted_with_one_note(adapter, tiny_model_dir, tmp_path, capsys):
    plain = tmp_path / "plain_peft_adapter"
    plain.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (plain / name).write_bytes((adapter / name).read_bytes())
    out = export_merged(plain, tmp_path / "out", dtype="fp32", progress=False)
    assert capsys.readouterr().out.splitlines() == [  # in-process, the library logs to stdout
        f"[fsdp-peft] note: {plain} has no {BASE_FILE} (older fsdp-peft run or plain peft adapter): "
        f"its base could not be checked against {tiny_model_dir}"
    ]
    assert load_file(out / "model.safetensors").keys() == load_file(tiny_model_dir / "model.safetensors").keys()


# --base-variant nf4 only for an adapter trained on the 4-bit base, unless forced.


def test_nf4_variant_of_an_adapter_trained_in_16_bit_is_refused(adapter, tiny_model_dir, tmp_path):
    line = refused(
        ["export", str(adapter), "--out", str(tmp_path / "out"), "--base-variant", "nf4"],
        tmp_path,
        adapter,
        tiny_model_dir,
    )
    assert line == (
        f"error: --base-variant nf4: adapter {adapter} was trained on the 16-bit base (its fsdp_peft_recipe.json "
        "has load_in_4bit: false), so merging it onto NF4 weights changes the model it learned; use --base-variant "
        "exact, or add --force-base-variant to merge onto the NF4 round trip anyway"
    )


def test_forced_nf4_variant_merges_and_the_card_says_the_adapter_was_16_bit(adapter, tiny_model_dir, tmp_path, capsys):
    out = export_merged(
        adapter, tmp_path / "out", dtype="fp32", base_variant="nf4", force_base_variant=True, progress=False
    )
    assert capsys.readouterr().err.splitlines() == [
        f"warning: --force-base-variant: adapter {adapter} was trained on the 16-bit base (its fsdp_peft_recipe.json "
        "has load_in_4bit: false); merging it onto the NF4 round trip of the base, as asked"
    ]
    assert (
        "- merged onto: the NF4 round trip of the base, at the user's request (--force-base-variant); the adapter "
        "was trained on the 16-bit base (load_in_4bit: false), not on these 4-bit weights"
    ) in (out / "README.md").read_text().splitlines()
    merged, base = load_file(out / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert torch.equal(merged[f"{K_PROJ}.weight"], nf4_round_trip(base[f"{K_PROJ}.weight"], {"torch_dtype": "float32"}))
    assert not torch.equal(merged[f"{K_PROJ}.weight"], base[f"{K_PROJ}.weight"])


def test_qlora_adapter_merges_onto_nf4_as_trained(qlora_adapter, tmp_path, capsys):
    out = export_merged(qlora_adapter, tmp_path / "out", dtype="fp32", base_variant="nf4", progress=False)
    assert capsys.readouterr().err == ""  # base checked and matching (the 4-bit load fingerprints as the original)
    assert "- merged onto: the NF4 round trip of the base (what QLoRA training saw)" in (out / "README.md").read_text()


# Staging directories left by a killed export are removed by the next export to the same --out.


def _paused_export(adapter: Path, out: Path, control: Path) -> subprocess.Popen:
    """Start a CLI export of ``adapter`` to ``out`` and return once it is paused mid-write (shards on disk)."""
    control.mkdir(exist_ok=True)
    arguments = [
        str(control / "paused"),
        str(control / "resume"),
        "export",
        str(adapter),
        "--out",
        str(out),
        "--dtype",
        "fp32",
        "--max-shard-size",
        "200KB",
    ]
    process = subprocess.Popen(
        [sys.executable, "-c", PAUSED_EXPORT, *arguments],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not (control / "paused").exists():
        assert process.poll() is None and time.time() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.05)
    return process


def test_next_export_removes_the_staging_directory_a_killed_export_left(adapter, tmp_path):
    work = tmp_path / "work"
    out = work / "out"
    process = _paused_export(adapter, out, tmp_path / "control")
    process.send_signal(signal.SIGKILL)
    process.wait()
    [leftover] = work.glob(".out.partial.*")
    size = sum(p.stat().st_size for p in leftover.rglob("*") if p.is_file())
    assert size > 1_000_000 and len(list(leftover.glob("model-*.safetensors"))) >= 4
    dead_writer_lock = leftover / ".fsdp_peft_writer.lock"
    others = {  # not this export's to remove: another target's, a longer name's, and one no writer marked
        work / ".out2.partial.abcd1234": dead_writer_lock,
        work / ".out.partial.x.partial.abcd1234": dead_writer_lock,
        work / ".out.partial.unmarked": None,
    }
    for directory, lock in others.items():
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"partial")
        if lock:
            (directory / lock.name).write_bytes(lock.read_bytes())
    before = checksums(*others)

    result = run_launch([*CLI, "export", str(adapter), "--out", str(out), "--dtype", "fp32"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert stderr_lines(result.stderr, "[fsdp-peft]") == [
        f"[fsdp-peft] removed 1 stale staging directory of {out} left by an interrupted export "
        f"({leftover.name}): freed {size} bytes ({size / 2**20:.1f} MiB)"
    ]
    assert not leftover.exists() and (out / "model.safetensors").is_file()
    assert not (out / ".fsdp_peft_writer.lock").exists()
    assert checksums(*others) == before


def test_staging_directory_of_a_live_export_is_left_alone(adapter, tmp_path):
    work = tmp_path / "work"
    out = work / "out"
    control = tmp_path / "control"
    writer = _paused_export(adapter, out, control)
    try:
        [live] = work.glob(".out.partial.*")
        before = checksums(live)
        result = run_launch([*CLI, "export", str(adapter), "--out", str(out), "--dtype", "fp32"])
        assert result.returncode == 0, result.stderr[-3000:]
        assert not stderr_lines(result.stderr, "[fsdp-peft] removed")
        assert checksums(live) == before and writer.poll() is None
    finally:
        (control / "resume").touch()
    stdout, stderr = writer.communicate(timeout=120)
    assert writer.returncode == 0, stderr[-3000:]
    assert stdout.strip() == f"merged model written to {out}"  # the other export published first; this one yields
    assert [p.name for p in work.iterdir()] == ["out"]


def test_export_refuses_a_prequantized_base(adapter, tiny_model_dir, tmp_path):
    base = tmp_path / "prequantized"
    tiny_llama_in_4bit(tiny_model_dir).save_pretrained(base)
    with pytest.raises(ConfigError) as error:
        export_merged(adapter, tmp_path / "out", base=str(base), dtype="fp32", progress=False)
    assert str(error.value) == (
        f"--base: {base} is a pre-quantized (bitsandbytes) checkpoint; merging needs the 16-bit weights: pass "
        "the 16-bit original with --base (--base-variant nf4 reproduces the 4-bit weights training saw)"
    )
    assert not (tmp_path / "out").exists()
