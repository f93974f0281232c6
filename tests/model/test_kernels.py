"""Fused kernels (`fsdp_peft.model.kernels`, ``kernels: liger``).

Triton runs no kernel on these CPUs, so the suite checks what can be checked here: the patch the Trainer applies
reaches the exact modules the recipes build (their forwards, not their class names, which Liger keeps), the
patched forward takes what a training step passes, each refusal is one line before weights, and the plan counts
Liger's own chunk size. Its losses against the eager run are the GPU check's (`benchmarks/gpu_check.py`).
"""

from __future__ import annotations

import inspect
import json
import sys
from types import SimpleNamespace

import pytest
from transformers import GPT2Config

from conftest import REPO, last_json_line, run_command
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.model import kernels
from fsdp_peft.model.kernels import LIGER_RELEASE, kernel_training_values, kernels_problem, liger_chunk_tokens
from fsdp_peft.model.loss import chunked_loss_unavailable
from fsdp_peft.settings.config import RecipeArguments
from fsdp_peft.settings.families import FAMILIES

TEXT_FAMILIES = [family for family in FAMILIES if family.vision is None]

# Liger patches module-level functions of transformers' modeling modules (the rotary embedding), for the whole
# process: it runs in a process of its own. For each family's embedded model, built as the recipes build it
# (LoRA; Llama also QLoRA), the patch the Trainer applies at the start of train() (transformers' own
# apply_liger_kernel, use_liger_kernel's config), then every module whose forward is Liger's.
PATCH_SCRIPT = r"""
import inspect, json, sys, tempfile
import torch
from transformers import TrainingArguments
from transformers.integrations.liger import apply_liger_kernel
from fsdp_peft.model.modeling import build_model, load_tokenizer
from fsdp_peft.settings.config import RecipeArguments

def forward_of(module):
    return getattr(module.forward, "__func__", module.forward)

# Every model built before any is patched: Liger also swaps the modeling module's classes for its own, so a model
# built after a patch would be built from Liger's classes.
training = TrainingArguments(output_dir=tempfile.mkdtemp(), use_liger_kernel=True, report_to=[])
built = {}
for name, four_bit in json.loads(sys.argv[1]):
    recipe = RecipeArguments(model_name_or_path=name, torch_dtype="float32", lora_dropout=0.0, load_in_4bit=four_bit)
    built[name + (" 4-bit" if four_bit else "")] = build_model(recipe, training, load_tokenizer(recipe))
report = {}
for case, model in built.items():
    base = model.get_base_model()
    modeling = sys.modules[type(base).__module__]
    apply_liger_kernel(model, training.liger_kernel_config)
    patched = {}
    for m in base.modules():
        f = forward_of(m)
        if f.__module__.startswith("liger_kernel."):
            patched.setdefault(type(m).__name__, []).append(f.__module__ + "." + f.__qualname__)
    signature = inspect.signature(base.forward)
    step = dict(input_ids=None, attention_mask=None, position_ids=None, labels=None, num_items_in_batch=None,
                shift_labels=None)
    signature.bind(**step)  # what the Trainer's compute_loss and the sequence split pass
    ids = torch.randint(0, 8, (1, 4))
    try:
        model(input_ids=ids, labels=ids)
        failure = None
    except Exception as error:
        failure = str(error)
    report[case] = {
        "patched": {k: sorted(set(v)) for k, v in patched.items()},
        "counts": {k: len(v) for k, v in patched.items()},
        "norms": sum(type(m).__name__.endswith("RMSNorm") for m in base.modules()),
        "mlps": sum(type(m).__name__.endswith("MLP") for m in base.modules()),
        "rotary": modeling.apply_rotary_pos_emb.__module__,
        "keyword_arguments": any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()),
        "cpu_forward": failure,
    }
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def patched():
    cases = [(family.tiny_model, False) for family in TEXT_FAMILIES] + [(TEXT_FAMILIES[0].tiny_model, True)]
    result = run_command([sys.executable, "-c", PATCH_SCRIPT, json.dumps(cases)])
    assert result.returncode == 0, result.stderr[-3000:]
    return last_json_line(result.stdout)


@pytest.mark.parametrize("family", TEXT_FAMILIES, ids=lambda family: family.name)
def test_the_trainers_patch_reaches_every_norm_mlp_head_and_rotary_of_the_model_the_recipe_builds(patched, family):
    report = patched[family.tiny_model]
    liger = report["patched"]
    causal_lm = family.tiny_architecture
    assert liger[causal_lm] == [f"liger_kernel.transformers.model.{family.model_types[0]}.lce_forward"], liger
    norms = [name for name in liger if name.endswith("RMSNorm")]
    assert norms and all(liger[n] == ["liger_kernel.transformers.rms_norm.LigerRMSNorm.forward"] for n in norms)
    assert sum(report["counts"][n] for n in norms) == report["norms"]  # every norm of the model, none left eager
    if family.router_module is None:  # a dense MLP in every layer: Liger's SwiGLU
        mlps = [name for name in liger if name.endswith("MLP")]
        assert [liger[n] for n in mlps] == [["liger_kernel.transformers.swiglu.LigerSwiGLUMLP.forward"]]
        assert report["counts"][mlps[0]] == report["mlps"]
    assert report["rotary"].startswith("liger_kernel."), report
    assert report["keyword_arguments"]  # num_items_in_batch and the split's shift_labels reach its loss
    # What the refusal prevents: the patched forward on a machine without a GPU driver.
    assert "active drivers" in report["cpu_forward"], report["cpu_forward"]


def test_the_patch_reaches_a_4_bit_model_as_it_does_the_16_bit_one(patched):
    name = TEXT_FAMILIES[0].tiny_model
    assert patched[f"{name} 4-bit"]["patched"] == patched[name]["patched"]
    assert patched[f"{name} 4-bit"]["counts"] == patched[name]["counts"]


def recipe(**values) -> RecipeArguments:
    return RecipeArguments(**{"kernels": "liger", **values})


def tiny_config():
    from fsdp_peft.model.paths import known_model_config

    return known_model_config("tiny-llama")


def test_kernels_liger_sets_the_trainers_own_switch_and_steps_the_chunked_loss_aside():
    assert kernel_training_values(recipe()) == {"use_liger_kernel": True}
    assert kernel_training_values(RecipeArguments()) == {}
    reason = chunked_loss_unavailable(None, SimpleNamespace(use_liger_kernel=True))
    assert reason.startswith("use_liger_kernel: Liger's fused linear cross-entropy")


def test_refusals_are_one_line_each_with_the_key_and_the_fix(monkeypatch):
    monkeypatch.delenv("FSDP_PEFT_UNVERIFIED", raising=False)  # the release gate is on here (CI's newest step lifts it)
    config = tiny_config()
    from fsdp_peft.model.paths import known_model_config

    problems = {
        "cpu": kernels_problem(recipe(), {}, False, config),
        "trainer key": kernels_problem(RecipeArguments(), {"use_liger_kernel": True}, False, config),
        "trl": kernels_problem(recipe(), {}, True, config),
        "compile": kernels_problem(recipe(compile=True), {}, False, config),
        "vision": kernels_problem(recipe(), {}, False, SimpleNamespace(model_type="qwen2_5_vl", vision_config={})),
        "experts": kernels_problem(
            recipe(model_name_or_path="tiny-mixtral"), {}, False, known_model_config("tiny-mixtral")
        ),
    }
    # What a GPU machine would say next: this one has no CUDA device, so it is told so first
    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: True)
    assert kernels_problem(recipe(), {}, False, config) is None  # the tested release, a family it patches
    problems["family"] = kernels_problem(recipe(model_name_or_path="a-gpt2"), {}, False, GPT2Config())
    monkeypatch.setattr(kernels, "installed_liger", lambda: None)
    problems["missing"] = kernels_problem(recipe(), {}, False, config)
    monkeypatch.setattr(kernels, "installed_liger", lambda: "0.7.0")
    problems["release"] = kernels_problem(recipe(), {}, False, config)
    monkeypatch.setenv("FSDP_PEFT_UNVERIFIED", "1")
    assert kernels_problem(recipe(), {}, False, config) is None  # another release, taken as for the patched libraries
    assert all(problem and "\n" not in problem for problem in problems.values()), problems
    assert problems["cpu"].startswith("kernels: liger runs Triton kernels on NVIDIA GPUs and this machine has no CUDA")
    assert problems["trainer key"].startswith("use_liger_kernel: true runs Triton kernels on NVIDIA GPUs")
    assert problems["trl"].startswith("kernels: liger with a TRL recipe")
    assert problems["compile"].startswith("kernels: liger with compile: true")
    assert problems["vision"].startswith("kernels: liger with the vision-language model")
    assert problems["experts"].startswith("kernels: liger with the mixture of experts tiny-mixtral: Liger replaces")
    assert problems["family"].startswith("kernels: liger: Liger patches no gpt2 model (a-gpt2)")
    install = (
        f"kernels: liger needs liger-kernel {LIGER_RELEASE} (it is not installed); pip install 'fsdp-peft[kernels]'"
    )
    assert problems["missing"] == install
    assert problems["release"].startswith(f"kernels: liger needs liger-kernel {LIGER_RELEASE} (found 0.7.0)")
    assert kernels_problem(RecipeArguments(), {}, False, config) is None  # not asked for: nothing to say


def test_validate_and_the_recipe_refuse_kernels_liger_here_in_one_line_before_weights(tmp_path):
    config = REPO / "configs" / "llama_lora" / "tiny.yaml"
    liger = tmp_path / "liger.yaml"
    liger.write_text(f"include: {config}\nkernels: liger\n")
    result = run_command(["fsdp-peft", "validate", str(liger), "--recipe", "llama_lora"])
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "kernels: liger" in line]
    assert len(lines) == 1 and "no CUDA device" in lines[0], result.stdout + result.stderr
    from fsdp_peft.recipe import parse_recipe_config

    with pytest.raises(ConfigError) as refused:
        parse_recipe_config(["--kernels", "liger"], config, "outputs/unused")
    assert "kernels: liger runs Triton kernels on NVIDIA GPUs" in str(refused.value)


def test_liger_chunk_size_is_its_own_formula():
    """Held against the source of the installed release (the lines that size a chunk) and its Triton helpers."""
    import triton
    from liger_kernel.ops import fused_linear_cross_entropy

    source = inspect.getsource(fused_linear_cross_entropy)
    assert "inc_factor = triton.cdiv(V, chunk_mem_const * H)" in source
    assert "chunk_size = triton.next_power_of_2(triton.cdiv(BT, inc_factor))" in source
    assert "chunk_size = min(chunk_size, BT)" in source
    for tokens, hidden, vocab in [(8192, 4096, 128256), (16384, 4096, 32000), (100, 64, 256), (1, 64, 1000)]:
        factor = triton.cdiv(vocab, hidden)
        expected = min(triton.next_power_of_2(triton.cdiv(tokens, factor)), tokens)
        assert liger_chunk_tokens(tokens, hidden, vocab) == expected


def test_the_plan_counts_ligers_chunks_in_place_of_the_chunked_loss():
    from fsdp_peft.procedures.sft import SFT_PROCEDURE
    from fsdp_peft.tools.plan import plan_recipe

    config = tiny_config()
    training = {"per_device_train_batch_size": 2}
    values = {"max_seq_length": 64, "torch_dtype": "bfloat16"}  # 2 rows of 64 tokens, computed in bf16
    plain = plan_recipe(RecipeArguments(**values), training, SFT_PROCEDURE, "tiny", 1, 2**30)
    fused = plan_recipe(recipe(**values), training, SFT_PROCEDURE, "tiny", 1, 2**30)
    chunk = liger_chunk_tokens(128, config.hidden_size, config.vocab_size)
    row = "loss logits, transient (est.)"
    assert fused.gpu[row] == chunk * config.vocab_size * 2  # one chunk's logits, its gradient written in place
    assert plain.gpu[row] != fused.gpu[row]
    assert any(f"chunks of {chunk} tokens" in note for note in fused.notes), fused.notes
