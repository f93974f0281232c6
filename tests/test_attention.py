"""The attention kernel key (`fsdp_peft.attention`): checked before anything starts, applied at loading."""

from __future__ import annotations

import pytest
import torch

from fsdp_peft.attention import attention_problem, resolved_attention
from fsdp_peft.config import RecipeArguments
from fsdp_peft.data import check_packing_keeps_examples_apart
from fsdp_peft.modeling import load_base_model


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's answers")
def test_kernels_this_cpu_machine_cannot_run_are_refused_with_the_fix():
    assert resolved_attention("auto") == "sdpa"
    for fine in ("auto", "sdpa", "eager", "flex_attention"):
        assert attention_problem(fine) is None, fine
    assert attention_problem("flash_attention_3").startswith("attn_implementation: flash_attention_3 runs on CUDA")
    assert attention_problem("sdpaa").startswith("attn_implementation: 'sdpaa' is not one of auto, sdpa, eager")
    hub = attention_problem("kernels-community/flash-attn")
    assert hub is None or "needs the kernels package; pip install kernels" in hub
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
