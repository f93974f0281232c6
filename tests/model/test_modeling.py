"""Model loading: 4-bit loading on CPU must not corrupt sharded weights."""

from __future__ import annotations

import pytest

from conftest import REPO, last_json_line, torchrun
from fsdp_peft.model.modeling import disable_cpu_weight_repacking, load_base_model
from fsdp_peft.settings.config import RecipeArguments

CHECK = REPO / "tests" / "distributed" / "repacking_check.py"


def test_qlora_base_loads_in_4_bits_with_the_storage_dtype(tiny_model_dir):
    import bitsandbytes as bnb
    import torch

    model = load_base_model(RecipeArguments(load_in_4bit=True, torch_dtype="bfloat16"))
    linear4bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linear4bit) == 4 * 7  # q, k, v, o, gate, up, down in each of the 4 layers
    assert all(m.weight.dtype == torch.bfloat16 and m.weight.quant_state.quant_type == "nf4" for m in linear4bit)
    assert all(not getattr(m, "support_avx512bf16_for_cpu", False) for m in linear4bit)
    assert disable_cpu_weight_repacking(model) == 0  # already off


@pytest.mark.slow
def test_eval_forward_leaves_the_sharded_qlora_model_unchanged(tiny_model_dir):
    """Holds on every CPU; what it guards against (bitsandbytes repacking the gathered weights in place) happens
    only on CPUs with AVX512-BF16, where the next test shows the loss moving without the guard."""
    guarded = last_json_line(torchrun(CHECK).stdout)["losses"]
    assert guarded[0] == guarded[1] == guarded[2], guarded


@pytest.mark.slow
def test_without_the_guard_an_eval_forward_corrupts_the_sharded_model(tiny_model_dir):
    """The guard is not decorative: with bitsandbytes' CPU repacking left on, the same batch changes loss."""
    from bitsandbytes.functional import has_avx512bf16

    if not has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks here")
    unguarded = last_json_line(torchrun(CHECK, "--unguarded").stdout)["losses"]
    assert unguarded[2] != unguarded[0], unguarded
