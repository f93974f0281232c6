"""Ulysses sequence parallelism (``sequence_parallel_size``): exact against one process on the whole rows.

Each case trains 5 steps twice with the same rows: on 2 gloo ranks that split every row (FSDP2 over the same
ranks), and in one process on the whole rows, which runs no split code. The LoRA cases train with plain SGD,
so each lora_B tensor (zero at the start) is minus the learning rate times the sum of its gradients: comparing
them compares the gradients themselves (Adam would divide each element by its own tiny running RMS).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, launch_recipe, logged_losses, read_json, run_launch, write_tiny_model
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.parallel.sequence_parallel import document_causal_mask, split_rows

STEPS = 5
COMMON = [
    "--max_steps", str(STEPS), "--logging_steps", "1", "--warmup_steps", "0", "--lr_scheduler_type", "constant",
    "--per_device_train_batch_size", "8", "--generate_samples", "0", "--generate_eval_samples", "0",
    "--per_device_eval_batch_size", "25", "--eval_strategy", "no",
]  # fmt: skip
SGD = ["--optim", "sgd", "--learning_rate", "0.5"]
# Bounds: 1e-5 for fp32 LoRA (the issue's; the split only sums the same terms in another order: measured 8e-8 to
# 2.5e-7 on the losses, 1e-6 to 2e-6 on lora_B, on an AVX512-BF16 CPU); 1e-4 for QLoRA, the bound of every
# QLoRA equivalence here (tests/test_recipes_fsdp.py): bf16 compute rounds each partial sum (measured 3.3e-5).
CASES = {  # name: (recipe, overrides, largest relative loss difference allowed)
    "padded-odd-length": ("llama_lora", [*SGD, "--max_seq_length", "23"], 1e-5),  # 23 tokens: padded to 24
    "packed": ("llama_lora", [*SGD, "--packing", "true"], 1e-5),
    "checkpointing-accumulation": (
        "llama_lora",
        [*SGD, "--gradient_checkpointing", "true", "--gradient_accumulation_steps", "2"],
        1e-5,
    ),
    "eager-one-kv-head": (
        "llama_lora",
        [*SGD, "--attn_implementation", "eager", "--model_name_or_path", "{kv1}"],
        1e-5,
    ),
    "moe": ("qwen_moe_lora", [*SGD, "--router_aux_loss_coef", "0"], 1e-5),  # LoRA on the experts, no aux loss
    "qlora": ("llama_qlora", [], 1e-4),  # bf16 storage and compute: the recipe's own optimizer
}


@pytest.fixture(scope="module")
def one_kv_head_model(tmp_path_factory) -> Path:
    """The tiny Llama's shape with one key/value head for its 4 query heads: fewer kv heads than ranks."""
    from transformers import LlamaConfig

    return write_tiny_model(
        tmp_path_factory.mktemp("kv1"), LlamaConfig, num_key_value_heads=1, architectures=["LlamaForCausalLM"]
    )


@pytest.fixture(scope="module", params=list(CASES))
def runs(request, tmp_path_factory, one_kv_head_model):
    recipe, overrides, tolerance = CASES[request.param]
    overrides = [o.replace("{kv1}", str(one_kv_head_model)) for o in overrides]
    split, whole = (tmp_path_factory.mktemp(f"{request.param}-{kind}") for kind in ("split", "whole"))
    result = launch_recipe(recipe, *COMMON, *overrides, "--sequence_parallel_size", "2", "--output_dir", str(split))
    single = run_launch([sys.executable, str(REPO / "recipes" / f"{recipe}.py"), *COMMON, *overrides,
                          "--output_dir", str(whole)])  # fmt: skip
    assert single.returncode == 0, single.stderr[-4000:]
    return {"case": request.param, "split": split, "whole": whole, "stdout": result.stdout, "tolerance": tolerance}


def _losses(output_dir: Path) -> list[float]:
    return [e["loss"] for e in read_json(output_dir / "trainer_state.json")["log_history"] if "loss" in e]


@pytest.mark.slow
def test_split_rows_train_as_one_process_on_the_whole_rows(runs):
    assert "sequence parallel: each row split over 2 ranks" in runs["stdout"]
    if runs["case"] == "padded-odd-length":  # every tiny-reverse row is 24 tokens; cut to 23, the split pads one
        assert "(12 of 23 tokens of the first batch on each)" in runs["stdout"]
    split, whole = _losses(runs["split"]), _losses(runs["whole"])
    assert len(split) == len(whole) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(split, whole))
    adapter = load_file(runs["split"] / "adapter" / "adapter_model.safetensors")
    reference = load_file(runs["whole"] / "adapter" / "adapter_model.safetensors")
    assert adapter.keys() == reference.keys()
    gradients = max(((adapter[k] - v).norm() / v.norm()).item() for k, v in reference.items() if "lora_B" in k)
    print(f"{runs['case']}: largest relative loss difference {worst:.2e}, lora_B (summed steps) {gradients:.2e}")
    assert worst <= runs["tolerance"], (split, whole)
    if runs["case"] != "qlora":  # bf16 gradients round differently per split (test_recipes_fsdp: tensors to 5e-2)
        assert gradients <= 1e-5
    results = [json.loads((d / "results.json").read_text()) for d in (runs["split"], runs["whole"])]
    assert results[0]["tokens"] == results[1]["tokens"] > 0  # a group's rows counted once
    assert abs(results[0]["eval_loss"] - results[1]["eval_loss"]) <= runs["tolerance"] * results[1]["eval_loss"]


# Quick: the row split and the mask, against what they must be by definition.


def test_split_rows_shift_labels_before_splitting_and_pad_at_the_end():
    ids = torch.arange(1, 8).reshape(1, 7)  # 7 tokens: padded to 8 over 2 ranks
    labels = torch.tensor([[-100, -100, 3, 4, 5, 6, 7]])
    mask = torch.ones(1, 7, dtype=torch.long)
    parts = [split_rows({"input_ids": ids, "labels": labels, "attention_mask": mask}, r, 2, 0) for r in (0, 1)]
    assert [p["input_ids"].tolist() for p in parts] == [[[1, 2, 3, 4]], [[5, 6, 7, 0]]]
    assert [p["position_ids"].tolist() for p in parts] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    # position i's target is token i+1: rank 0's last target is rank 1's first token
    assert [p["shift_labels"].tolist() for p in parts] == [[[-100, 3, 4, 5]], [[6, 7, -100, -100]]]
    assert all("attention_mask" not in p for p in parts)


def test_a_left_padded_row_is_refused():
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="left-padded"):
        split_rows({"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[0, 1, 1, 1]])}, 0, 2, 0)


def test_the_document_mask_keeps_packed_documents_apart():
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    mask = document_causal_mask(positions, 1)[0, 0]
    want = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]])
    assert torch.equal(mask, want.bool())
    assert document_causal_mask(torch.arange(5)[None], 2) is None  # one document a row: plain causal


LORA_TINY = REPO / "configs" / "llama_lora" / "tiny.yaml"
FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}
REFUSALS = {  # name: (config, environment, overrides, the line)
    "world": (LORA_TINY, {**FSDP2, "WORLD_SIZE": "3"}, ["--sequence_parallel_size", "2"],
              "sequence_parallel_size: 2 does not divide this launch's 3 process(es)"),
    "no-fsdp": (LORA_TINY, {"WORLD_SIZE": "2"}, ["--sequence_parallel_size", "2"],
                "sequence_parallel_size: 2: the split runs under FSDP2"),
    "fsdp1": (LORA_TINY, {**FSDP2, "FSDP_VERSION": "1", "WORLD_SIZE": "2"}, ["--sequence_parallel_size", "2"],
              "sequence_parallel_size: 2: FSDP1 cannot shard over the sequence mesh"),
    "hsdp": (LORA_TINY, {**FSDP2, "WORLD_SIZE": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
                         "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"}, ["--sequence_parallel_size", "2"],
             "sequence_parallel_size: 2 with the launcher's parallelism_config"),
    "heads": (LORA_TINY, {**FSDP2, "WORLD_SIZE": "3"}, ["--sequence_parallel_size", "3"],
              "sequence_parallel_size: 3: tiny-llama has 4 query heads, which do not split over 3 ranks"),
    "sliding-window": (LORA_TINY, {**FSDP2, "WORLD_SIZE": "2"},
                       ["--sequence_parallel_size", "2", "--model_name_or_path", "{gemma2}"],
                       "sequence_parallel_size: 2: {gemma2} has sliding-window or chunked attention layers"),
    "moe": (REPO / "configs" / "qwen_moe_lora" / "tiny.yaml", {**FSDP2, "WORLD_SIZE": "2"},
            ["--sequence_parallel_size", "2"],
            "sequence_parallel_size: 2: tiny-qwen3-moe is a mixture of experts whose router's load-balancing"),
    "dpo": (REPO / "configs" / "llama_dpo" / "tiny.yaml", {**FSDP2, "WORLD_SIZE": "2"},
            ["--sequence_parallel_size", "2"], "sequence_parallel_size: 2: the preference and GRPO recipes train"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REFUSALS))
def test_what_the_split_cannot_make_exact_is_refused_in_one_line(name, monkeypatch, tmp_path, tiny_gemma2_dir):
    from conftest import procedure_of
    from fsdp_peft.recipe import parse_recipe_config

    config, env, argv, line = REFUSALS[name]
    argv = [a.replace("{gemma2}", str(tiny_gemma2_dir)) for a in argv]
    line = line.replace("{gemma2}", str(tiny_gemma2_dir))
    for key in [k for k in __import__("os").environ if k.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as error:
        parse_recipe_config(["--config", str(config), "--output_dir", str(tmp_path), *argv], config, str(tmp_path),
                            procedure_of(config))  # fmt: skip
    problems = str(error.value).split("\n")
    assert any(p.strip().startswith(line) for p in problems), str(error.value)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A split run of 5 steps that checkpoints at step 3 and exports fp32 merged weights, and the same run
    resumed from that checkpoint in another directory."""
    full, again = tmp_path_factory.mktemp("split-full"), tmp_path_factory.mktemp("split-resumed")
    split = [*COMMON, "--sequence_parallel_size", "2", "--save_strategy", "steps", "--save_steps", "3"]
    exported = ["--export_merged", "true", "--export_dtype", "fp32", "--generate_samples", "8"]  # and samples
    launch_recipe("llama_lora", *split, "--output_dir", str(full), *exported)
    shutil.copytree(full / "checkpoint-3", again / "checkpoint-3")
    launch_recipe(
        "llama_lora", *split, "--output_dir", str(again), "--resume_from_checkpoint", str(again / "checkpoint-3")
    )
    return full, again


@pytest.mark.slow
def test_a_split_run_generates_resumes_exactly_and_exports_peft_merge(resumed, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    full, again = resumed
    samples = [json.loads(line) for line in (full / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and all("generated" in s for s in samples)  # generation after a split run: unsplit
    want, got = logged_losses(full), logged_losses(again)
    assert [got[step] for step in (4, 5)] == [want[step] for step in (4, 5)]  # the same ranks, the same sums: 0.0
    reference = load_file(full / "adapter" / "adapter_model.safetensors")
    adapter = load_file(again / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(adapter[k], v) for k, v in reference.items())
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, full / "adapter").merge_and_unload().state_dict()
    exported = {}
    for shard in (full / "merged").glob("*.safetensors"):
        exported.update(load_file(shard))
    assert set(exported) <= set(merged) and set(merged) - set(exported) <= {"lm_head.weight"}  # tied: one copy
    worst = max(((exported[k] - merged[k]).abs().max() / merged[k].abs().max()).item() for k in exported)
    print(f"split run: resumed losses equal; merged export vs peft merge_and_unload: {worst:.1e}")
    assert worst <= 1e-6
