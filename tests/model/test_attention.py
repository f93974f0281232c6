"""The attention kernel key (`fsdp_peft.model.attention`): checked before anything starts, applied at loading."""

from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest
import torch
import transformers
from transformers import AutoConfig, Gemma2ForCausalLM, LlamaForCausalLM

from conftest import REPO, run_command
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.data.packing import check_packing_keeps_examples_apart
from fsdp_peft.model import attention
from fsdp_peft.model.attention import architecture_problem, attention_problem, chosen_attention, model_class_named
from fsdp_peft.model.modeling import load_base_model
from fsdp_peft.procedures.registry import plan_config
from fsdp_peft.recipe import parse_recipe_config
from fsdp_peft.settings.config import RecipeArguments

LORA_TINY = REPO / "configs" / "llama_lora" / "tiny.yaml"
# A Llama whose class has no kernel but eager (as many remote-code models): transformers falls back to eager
NoKernelLlama = type(
    "NoKernelLlama",
    (LlamaForCausalLM,),
    {"_supports_sdpa": False, "_supports_flash_attn": False, "_supports_flex_attn": False},
)
GEMMA2_SDPA_REFUSAL = (
    f"attn_implementation: sdpa: Gemma2ForCausalLM has no SDPA attention in transformers {transformers.__version__} "
    "(_supports_sdpa is False); use auto (eager for it here) or a kernel it supports: eager, flash_attention_2, "
    "flash_attention_3, flex_attention"
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's answers")
def test_kernels_this_cpu_machine_cannot_run_are_refused_with_the_fix():
    assert chosen_attention("auto", LlamaForCausalLM) == "sdpa"
    for fine in ("auto", "sdpa", "eager", "flex_attention"):
        assert attention_problem(fine) is None, fine
    assert attention_problem("flash_attention_3").startswith("attn_implementation: flash_attention_3 runs on CUDA")
    assert attention_problem("sdpaa").startswith("attn_implementation: 'sdpaa' is not one of auto, sdpa, eager")
    hub = attention_problem("kernels-community/flash-attn")
    if importlib.util.find_spec("kernels") is None:  # not a dependency: the hub kernel needs it installed
        assert "needs the kernels package; pip install kernels" in hub
    else:
        assert hub is None
    assert all("\n" not in (attention_problem(v) or "") for v in ("sdpaa", "flash_attention_2"))


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_the_model_runs_the_chosen_kernel_and_keeps_packed_examples_apart(kernel):
    model = load_base_model(RecipeArguments(torch_dtype="float32", attn_implementation=kernel))
    assert model.config._attn_implementation == kernel
    check_packing_keeps_examples_apart(model)  # raises when a packed example sees the one before it
    input_ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
        model.set_attn_implementation("sdpa" if kernel == "eager" else "eager")
        other = model(input_ids=input_ids).logits
    assert torch.allclose(logits, other, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's answers")
def test_auto_runs_what_transformers_itself_picks_for_each_architecture(tiny_model_dir, tiny_gemma2_dir):
    """SDPA for Llama, eager for Gemma-2 (no SDPA: softcapping) and for a class with neither kernel."""
    picks = {}
    for model_class, path in (
        (LlamaForCausalLM, tiny_model_dir),
        (Gemma2ForCausalLM, tiny_gemma2_dir),
        (NoKernelLlama, tiny_model_dir),
    ):
        model = model_class(AutoConfig.from_pretrained(path))  # no kernel asked for: transformers chooses
        picks[model_class.__name__] = (chosen_attention("auto", model_class), model.config._attn_implementation)
    assert picks == {
        "LlamaForCausalLM": ("sdpa", "sdpa"),
        "Gemma2ForCausalLM": ("eager", "eager"),
        "NoKernelLlama": ("eager", "eager"),
    }


def test_auto_takes_flash_attention_2_on_cuda_where_the_architecture_has_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention, "is_flash_attn_2_available", lambda: True)
    sdpa_only = type("SdpaOnlyLlama", (LlamaForCausalLM,), {"_supports_flash_attn": False})
    chosen = [chosen_attention("auto", c) for c in (LlamaForCausalLM, Gemma2ForCausalLM, sdpa_only, NoKernelLlama)]
    assert chosen == ["flash_attention_2", "flash_attention_2", "sdpa", "eager"]
    assert chosen_attention("auto", None) == "flash_attention_2"  # class unknown: as before, the model decides at load
    assert chosen_attention("sdpa", Gemma2ForCausalLM) == "sdpa"  # explicit: as given (refused by validation)


def test_gemma2_loads_with_eager_attention_under_auto(tiny_gemma2_dir):
    model = load_base_model(RecipeArguments(model_name_or_path=str(tiny_gemma2_dir), torch_dtype="float32"))
    assert type(model) is Gemma2ForCausalLM and model.config._attn_implementation == "eager"


def test_a_kernel_the_architecture_lacks_is_refused_by_validation_with_one_line(tiny_gemma2_dir, tmp_path):
    base = ["--config", str(LORA_TINY), "--output_dir", str(tmp_path), "--model_name_or_path", str(tiny_gemma2_dir)]
    with pytest.raises(ConfigError) as error:
        parse_recipe_config([*base, "--attn_implementation", "sdpa"], LORA_TINY, str(tmp_path))
    assert str(error.value) == GEMMA2_SDPA_REFUSAL
    for fine in ("auto", "eager", "flex_attention"):  # Gemma-2 has flex attention
        recipe, _ = parse_recipe_config([*base, "--attn_implementation", fine], LORA_TINY, str(tmp_path))
        assert recipe.attn_implementation == fine
    assert architecture_problem("flex_attention", NoKernelLlama).startswith(
        "attn_implementation: flex_attention: NoKernelLlama has no flex attention in transformers"
    )
    assert architecture_problem("flex_attention", NoKernelLlama).endswith(
        "use auto (eager for it here) or a kernel it supports: eager"
    )
    assert architecture_problem("sdpa", None) is None  # class not known here: transformers decides at load


def test_a_remote_code_class_is_resolved_offline_when_trusted_and_else_left_to_loading(tiny_gemma2_dir, tmp_path):
    model = tmp_path / "nova"
    shutil.copytree(tiny_gemma2_dir, model)
    (model / "modeling_nova.py").write_text(
        "from transformers import Gemma2ForCausalLM\n\n\nclass NovaForCausalLM(Gemma2ForCausalLM):\n    pass\n"
    )
    config = (model / "config.json").read_text()
    (model / "config.json").write_text(
        config.replace(
            '"architectures"',
            '"auto_map": {"AutoModelForCausalLM": "modeling_nova.NovaForCausalLM"},\n  "architectures"',
            1,
        )
    )
    nova = model_class_named(str(model), trust_remote_code=True)
    assert nova.__name__ == "NovaForCausalLM" and architecture_problem("sdpa", nova).startswith(
        "attn_implementation: sdpa: NovaForCausalLM has no SDPA attention"
    )
    (model / "modeling_nova.py").unlink()  # code not on this machine: not refused before loading
    assert model_class_named(str(model), trust_remote_code=True) is None


def test_the_plan_notes_that_auto_runs_eager_for_gemma2(tiny_gemma2_dir, tmp_path):
    config = tmp_path / "gemma2.yaml"
    config.write_text(f"include: {LORA_TINY}\nmodel_name_or_path: {tiny_gemma2_dir}\n")
    notes = plan_config(config, 1, 80 * 2**30).notes
    expected = "attn_implementation: auto (eager for Gemma2ForCausalLM) keeps seq x seq attention weights per layer"
    assert [note for note in notes if note.startswith("attn_implementation")] == [f"{expected}; not counted"]


@pytest.mark.slow
def test_a_kernel_the_architecture_lacks_is_refused_alike_by_validate_and_the_recipe_before_loading(
    tmp_path, tiny_gemma2_dir
):
    model = tmp_path / "gemma2"
    shutil.copytree(tiny_gemma2_dir, model)
    (model / "model.safetensors").write_bytes(b"not weights")  # a run that read them would fail another way
    recipe = tmp_path / "gemma2_sdpa.yaml"
    recipe.write_text(f"include: {LORA_TINY}\nmodel_name_or_path: {model}\nattn_implementation: sdpa\n")
    validate = run_command(["fsdp-peft", "validate", str(recipe)])
    overrides = [
        "--model_name_or_path",
        str(model),
        "--attn_implementation",
        "sdpa",
        "--output_dir",
        str(tmp_path / "out"),
    ]
    recipe_run = run_command([sys.executable, str(REPO / "recipes" / "llama_lora.py"), *overrides])
    for result in (validate, recipe_run):
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
            f"error: {GEMMA2_SDPA_REFUSAL}"
        ]
    assert not (tmp_path / "out").exists()
