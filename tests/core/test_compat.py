"""The compat layer: every patched or private upstream symbol is still what fsdp-peft relies on, and a
symbol that moved stops a run with one line at start-up instead of silently changing what it does."""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import subprocess
import sys
import warnings
from unittest import mock

import pytest
import torch

from conftest import REPO, last_json_line, run_command, torchrun
from fsdp_peft.core._compat import bitsandbytes_patches, gate, peft_patches, registry, torch_patches
from fsdp_peft.core._compat.registry import (
    PATCHES,
    TRL_VERIFIED,
    UPSTREAM,
    VERIFIED,
    CompatError,
    upstream_problem,
    version_problem,
)


@pytest.mark.parametrize("entry", UPSTREAM, ids=lambda e: e.path)
def test_each_upstream_symbol_exists_with_what_fsdp_peft_relies_on(entry):
    assert upstream_problem(entry) is None
    assert entry.why and entry.remove_when and entry.used_by


@pytest.mark.parametrize("package", sorted({**VERIFIED, **TRL_VERIFIED}))
def test_installed_releases_are_the_verified_ones(package):
    assert version_problem(package) is None, importlib.metadata.version(package)


def _pins(lines: list[str]) -> dict[str, set[tuple[str, str]]]:
    """``{package: {(operator, version), ...}}`` of requirement lines (comments and blank lines skipped)."""
    from packaging.requirements import Requirement

    pins = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            pins[requirement.name.replace("-", "_")] = {(spec.operator, spec.version) for spec in requirement.specifier}
    return pins


def _pinned_window(pins: set[tuple[str, str]]) -> tuple[str, str | None]:
    """``(lowest, first excluded)`` of a ``>=a,<b`` range, or ``(v, None)`` of ``==v``."""
    operators = dict(pins)
    return (operators["=="], None) if "==" in operators else (operators[">="], operators["<"])


def test_the_pinned_releases_are_the_verified_windows_one_source_of_truth():
    """pyproject.toml's ranges are `VERIFIED`'s windows (an exact pin: the window's lowest release), and so are
    requirements-tpu.txt's exact pins (the TPU route's torch and torch-xla: `VERIFIED_WITH_TORCH_XLA`); every patch
    takes its package's window unless it names one of its own, and no upstream symbol is listed twice."""
    import tomllib

    main = _pins(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
    tpu = _pins((REPO / "requirements-tpu.txt").read_text().splitlines())
    for package, (lowest, unverified) in {**VERIFIED, **TRL_VERIFIED}.items():
        low, high = _pinned_window(main[package])
        assert low == lowest and high in (unverified, None), (package, main[package])
    for package, (lowest, _) in {**VERIFIED, **registry.VERIFIED_WITH_TORCH_XLA}.items():
        if package in tpu and not (package == "torch" and "torch_xla" in tpu):
            assert _pinned_window(tpu[package])[0] == lowest, (package, tpu[package])
    assert _pinned_window(tpu["torch"])[0] == registry.VERIFIED_WITH_TORCH_XLA["torch"][0]
    assert _pinned_window(tpu["torch_xla"])[0] == registry.VERIFIED_WITH_TORCH_XLA["torch_xla"][0]
    assert all(p.verified is None and p.window == {**VERIFIED, **TRL_VERIFIED}[p.package] for p in PATCHES)
    paths = [entry.path for entry in UPSTREAM]
    assert len(paths) == len(set(paths)), sorted(p for p in paths if paths.count(p) > 1)


def test_trls_symbols_and_release_are_checked_where_trl_is_imported_and_cost_sft_nothing():
    check = "import sys, fsdp_peft.core._compat.gate as c; {}c.check_upstream(); print('trl' in sys.modules)"
    sft = subprocess.run([sys.executable, "-c", check.format("")], capture_output=True, text=True, cwd=REPO)
    assert sft.returncode == 0 and sft.stdout.split()[0] == "False", sft.stderr[-2000:]
    renamed = "import trl.trainer.grpo_trainer as g; del g.GRPOTrainer._tokenize_prompts; "
    grpo = subprocess.run([sys.executable, "-c", check.format(renamed)], capture_output=True, text=True, cwd=REPO)
    assert grpo.returncode != 0 and "GRPOTrainer._tokenize_prompts is gone; fsdp-peft relies on it" in grpo.stderr


def test_every_patch_function_says_what_it_replaces_why_and_when_to_remove_it():
    documented = [  # found, not listed: every function of a patch module whose docstring says when to remove it
        value
        for module in gate.PATCH_MODULES
        for value in vars(module).values()
        if callable(value)
        and getattr(value, "__module__", "") == module.__name__
        and "Remove when" in (inspect.getdoc(value) or "")
    ]
    assert {module.__name__.rpartition(".")[2] for module in gate.PATCH_MODULES} == {
        path.stem for path in (REPO / "fsdp_peft" / "core" / "_compat").glob("*_patches.py")
    }
    assert sorted(p.function.__name__ for p in PATCHES) == sorted(f.__name__ for f in documented)
    for patch in PATCHES:
        doc = inspect.getdoc(patch.function)
        assert "Why" in doc and "Remove when" in doc, patch.function.__name__
        assert any(patch.function.__name__ in entry.used_by for entry in UPSTREAM), patch.function.__name__


def test_the_installed_releases_are_inside_every_patch_window():
    for patch in PATCHES:
        assert patch.window_problem() is None, patch.window_problem()


@pytest.mark.parametrize("patch", [p for p in PATCHES if p.still_needed], ids=lambda p: p.function.__name__)
def test_upstream_still_needs_the_patch(patch):
    """Fails once upstream's code no longer does what the patch works around: then remove the patch."""
    assert patch.still_needed(), f"{patch.function.__name__}: upstream changed; see its 'Remove when'"


def test_a_release_outside_a_patch_window_stops_start_up_in_one_line(monkeypatch):
    patch = next(p for p in PATCHES if p.package == "peft")
    narrowed = registry.Patch(patch.function, patch.package, ("0.1.0", "0.2"))
    problem = narrowed.window_problem()
    assert problem.startswith(f"peft {importlib.metadata.version('peft')} is outside the versions ")
    assert f"{patch.function.__module__}.{patch.function.__name__} was verified with (0.1.0 to below 0.2)" in problem
    assert patch.function.__module__ == "fsdp_peft.core._compat.peft_patches"
    monkeypatch.setattr(gate, "PATCHES", [narrowed])
    # the window alone: the installed releases and upstream's symbols have tests of their own (and .ci/run's
    # newest-releases report runs this one where the releases are outside fsdp-peft's windows)
    monkeypatch.setattr(gate, "version_problem", lambda package: None)
    monkeypatch.setattr(gate, "UPSTREAM", ())
    monkeypatch.delenv(registry.UNVERIFIED_VARIABLE, raising=False)  # .ci/run's newest-releases report sets it
    gate._checked.cache_clear()
    try:
        with pytest.raises(CompatError, match="is outside the versions fsdp_peft.core._compat."):
            gate.check_upstream()
        monkeypatch.setenv(registry.UNVERIFIED_VARIABLE, "1")
        gate._checked.cache_clear()
        gate.check_upstream()  # FSDP_PEFT_UNVERIFIED=1 lifts the windows as it lifts the version gate
    finally:
        gate._checked.cache_clear()


def test_adapters_are_attached_without_the_deprecation_warning_peft_raises(tiny_model_dir):
    """peft 0.21 reads transformers' deprecated ``is_gradient_checkpointing``: a FutureWarning on every run, once
    per rank; `peft_wrapped` attaches the same adapters without it (and nothing else is silenced)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def warnings_of(attach) -> list[str]:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            attach(model, LoraConfig(r=4, target_modules=["q_proj"]))
        return [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]

    assert any("is_gradient_checkpointing" in m for m in warnings_of(get_peft_model))  # upstream: remove when not
    assert warnings_of(peft_patches.peft_wrapped) == []


def test_a_renamed_symbol_is_named_in_one_line(monkeypatch):
    import transformers.trainer

    monkeypatch.delattr(transformers.trainer, "update_fsdp_plugin_peft")
    gate._checked.cache_clear()
    try:
        with pytest.raises(CompatError) as error:
            gate.check_upstream()
    finally:
        gate._checked.cache_clear()
    version = importlib.metadata.version("transformers")
    assert str(error.value) == (
        f"transformers {version}: transformers.trainer.update_fsdp_plugin_peft is gone; fsdp-peft relies on it "
        "(Trainer's FSDP1-only PEFT update would overwrite fsdp-peft's policies)"
    )


def test_a_changed_signature_is_named_in_one_line(monkeypatch):
    import accelerate.accelerator

    monkeypatch.setattr(accelerate.accelerator, "fsdp2_prepare_model", lambda accelerator, module, plan: module)
    problem = upstream_problem(next(e for e in UPSTREAM if e.path.endswith("fsdp2_prepare_model")))
    assert problem.endswith(
        "fsdp2_prepare_model no longer has model; fsdp-peft relies on it "
        "(weights stream into a skeleton model only after FSDP2 has sharded it)"
    )


def test_an_unverified_release_is_refused_unless_asked_for(monkeypatch):
    monkeypatch.setitem(VERIFIED, "peft", ("0.30.0", "0.31"))
    installed = importlib.metadata.version("peft")
    assert version_problem("peft") == (
        f"peft {installed} is outside the versions fsdp-peft was verified with (0.30.0 to below 0.31); install a "
        "verified one (pip install -e .), or set FSDP_PEFT_UNVERIFIED=1 to try it"
    )


@pytest.mark.parametrize("entry_point", ["recipe", "validate"])
def test_a_renamed_symbol_stops_recipes_and_commands_at_start_up(entry_point, tmp_path):
    """The whole path a user takes, with one upstream symbol deleted before fsdp-peft starts."""
    rename = "import fsdp_peft, transformers.trainer as t; del t.update_fsdp_plugin_peft; import sys; "
    if entry_point == "recipe":
        start = (
            f"sys.argv = ['llama_lora.py', '--output_dir', {str(tmp_path / 'out')!r}]; import runpy; "
            f"runpy.run_path({str(REPO / 'recipes' / 'llama_lora.py')!r}, run_name='__main__')"
        )
    else:
        config = str(REPO / "configs" / "llama_lora" / "tiny.yaml")
        start = f"from fsdp_peft.cli import main; main(['validate', {config!r}])"
    result = run_command([sys.executable, "-c", rename + start], timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: transformers "), result.stderr
    assert "update_fsdp_plugin_peft is gone" in lines[0]
    assert not (tmp_path / "out").exists()


def _output_and_delta_gradient(layer, inputs: torch.Tensor, weights: torch.Tensor):
    """A trainable-token layer's output for ``inputs`` and the gradient of its trained rows under a fixed
    weighting of the output."""
    delta = layer.trainable_tokens_delta["default"]
    delta.grad = None
    output = layer(inputs)
    (output.float() * weights).sum().backward()
    return output.detach(), delta.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trainable_tokens_through_the_base_layer_give_peft_values_and_gradients(dtype, tiny_model_dir):
    """The patched forward calls the frozen embedding (FSDP1 gathers it) and gives peft's own output and
    gradient of the trained rows, fp32 master rows over an fp32 or bf16 base; a padding token among them gets none."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    base.get_input_embeddings().padding_idx = 5
    config = LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[3, 5, 7], task_type="CAUSAL_LM")
    model = get_peft_model(base, config, autocast_adapter_dtype=True)
    layer = next(m for m in model.modules() if isinstance(m, TrainableTokensLayer))
    delta = layer.trainable_tokens_delta["default"]
    delta.data = delta.data.float() + torch.randn_like(delta.data.float())  # trained rows differ from the base
    ids = torch.tensor([[1, 3, 5, 7, 3, 9, 7, 3], [2, 7, 7, 4, 5, 3, 8, 1]])
    weights = torch.randn(2, 8, base.config.hidden_size)

    calls = []
    layer.base_layer.register_forward_hook(lambda module, inputs, output: calls.append(module))
    expected, expected_grad = _output_and_delta_gradient(layer, ids, weights)
    assert calls == []  # peft's own forward never calls the frozen embedding
    assert peft_patches.trainable_tokens_through_the_base_layer(model) == 1
    output, grad = _output_and_delta_gradient(layer, ids, weights)
    assert calls == [layer.base_layer]
    assert output.dtype == expected.dtype == dtype and torch.equal(output, expected)
    assert grad.dtype == torch.float32 and torch.equal(grad, expected_grad)
    assert torch.equal(grad[1], torch.zeros_like(grad[1])) and grad[0].abs().sum() > 0  # row 5 is the padding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trainable_tokens_of_an_untied_head_call_the_frozen_head_and_give_peft_values(dtype, tiny_model_dir):
    """An untied output head's trained rows (new tokens' rows): the patched forward calls the frozen head (FSDP1
    gathers it) and its trained columns are ``x @ delta.T``: peft's output and gradient of the trained rows."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    assert not base.config.tie_word_embeddings
    indices = {"embed_tokens": [3, 7], "lm_head": [3, 7, 9]}
    config = LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=indices, task_type="CAUSAL_LM")
    model = get_peft_model(base, config, autocast_adapter_dtype=True)
    head = model.get_output_embeddings()
    (layer,) = [m for m in head.modules() if isinstance(m, TrainableTokensLayer)]
    assert isinstance(layer.base_layer, torch.nn.Linear)
    delta = layer.trainable_tokens_delta["default"]
    delta.data = delta.data.float() + torch.randn_like(delta.data.float())
    x = torch.randn(2, 5, base.config.hidden_size, dtype=dtype)
    weights = torch.randn(2, 5, base.config.vocab_size)

    calls = []
    layer.base_layer.register_forward_hook(lambda module, inputs, output: calls.append(module))
    expected, expected_grad = _output_and_delta_gradient(layer, x, weights)
    assert calls == []  # peft's own forward never calls the frozen head
    assert peft_patches.trainable_tokens_through_the_base_layer(model) == 2  # the embedding's rows and the head's
    output, grad = _output_and_delta_gradient(layer, x, weights)
    assert calls == [layer.base_layer] and output.dtype == expected.dtype == dtype
    untrained = [i for i in range(base.config.vocab_size) if i not in indices["lm_head"]]
    assert torch.equal(output[..., untrained], expected[..., untrained])
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # the trained columns: their own (smaller) matmul
    torch.testing.assert_close(output, expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_run_joins_its_process_group_threads_before_the_interpreter_ends():
    """torch's destroy leaves an FSDP2 run's gloo threads running (the state in which finished runs aborted at
    exit); `process_groups_released` joins them. If torch's destroy alone ever joins them, the patch can go."""
    threads = last_json_line(torchrun(REPO / "tests" / "distributed" / "process_group_release_check.py").stdout)
    assert threads["training"] == ["gloo_tcp_loop", "pt_gloo_runloop", "pt_gloo_runloop"]
    assert threads["after_torch_destroy"] == threads["training"]
    assert threads["after_release"] == []


def test_torch_compile_deferred_compiles_on_the_first_call_with_the_same_options():
    calls, compile_now = [], torch.compile

    def twice(x):
        calls.append(1)
        return 2 * x

    with bitsandbytes_patches.torch_compile_deferred():
        deferred = torch.compile(twice, backend="eager", dynamic=False)
        decorated = torch.compile(backend="eager")(twice)
    assert torch.compile is compile_now  # restored on leaving
    assert deferred.__wrapped__ is twice and decorated.__wrapped__ is twice and not calls  # nothing compiled yet
    x = torch.arange(4.0)
    assert torch.equal(deferred(x), 2 * x) and torch.equal(decorated(x), 2 * x) and calls


@pytest.mark.slow
def test_a_rank_imports_no_compiler_and_bitsandbytes_kernels_still_compile_and_match_eager(tmp_path):
    """bitsandbytes' default backend imported through fsdp_peft: inductor stays unloaded until a kernel runs; the
    kernel's first call then goes through ``torch.compile`` (which loads it) and equals its eager function.
    ``TORCH_COMPILE_DISABLE=1`` keeps torch from compiling for real (20-90 s on this CPU; torch's own business)."""
    script = tmp_path / "check.py"
    script.write_text(
        "import sys\n"
        "import torch\n"
        "import fsdp_peft.recipe  # everything a recipe's rank imports\n"
        "assert 'torch._inductor.compile_fx' not in sys.modules\n"
        "from bitsandbytes.backends.default import ops\n"
        "A = torch.randint(0, 256, (256,), dtype=torch.uint8)\n"
        "absmax, code = torch.rand(4), torch.linspace(-1, 1, 256)\n"
        "out = ops._dequantize_blockwise_compute(A, absmax, code, 64, torch.float32)\n"
        "assert 'torch._inductor.compile_fx' in sys.modules  # compiled on the first call\n"
        "eager = ops._dequantize_blockwise_compute.__wrapped__(A, absmax, code, 64, torch.float32)\n"
        "assert torch.equal(out, eager)\n"
        "print('ok')\n"
    )
    with mock.patch.dict(os.environ, {"TORCH_COMPILE_DISABLE": "1"}):
        result = run_command([sys.executable, str(script)])
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


BF16_PRODUCTS = {  # op: operands (bf16 where they are to be multiplied), keyword arguments
    "mm": (((48, 96), (96, 40)), {}),
    "addmm": (((40,), (48, 96), (96, 40)), {"beta": 0.5, "alpha": 2.0}),
    "bmm": (((3, 48, 96), (3, 96, 40)), {}),
    "baddbmm": (((3, 48, 40), (3, 48, 96), (3, 96, 40)), {"beta": 0.5, "alpha": 2.0}),
}
FORMS = [
    (op, form) for op in BF16_PRODUCTS for form in ("returned", "out", "in_place") if form != "in_place" or "add" in op
]


@pytest.mark.parametrize(("op", "form"), FORMS, ids=[f"{op}-{form}" for op, form in FORMS])
def test_bf16_products_in_fp32_are_float64s_product_rounded_once(op, form):
    """The replacement kernels (installed only on CPUs without native bf16 products, built here on any CPU from
    aten's own kernels) against a reference that is no kernel of theirs: the float64 product of the same bf16
    values, rounded to bf16. Every result within one bf16 step of it plus the fp32 sums' error bound, nearly all
    equal to it, as often as aten's own bf16 kernel's; fp32 operands, and bf16 products of fewer rows than
    `FP32_FROM_ROWS`, get aten's own result, bitwise; mixed dtypes aten's own error."""
    shapes, options = BF16_PRODUCTS[op]
    name = {"returned": op, "out": f"{op}.out", "in_place": f"{op}_"}[form]
    original, product = torch_patches.aten_cpu_kernel(name), torch_patches.aten_cpu_kernel(op)
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    ours = torch_patches._in_fp32(original, product, form)
    generator = torch.Generator().manual_seed(0)
    if form == "in_place":  # the added term is the result's own tensor
        shapes = ((48, 40), *shapes[1:]) if op == "addmm" else shapes
    operands = [torch.randn(shape, generator=generator).bfloat16() for shape in shapes]

    def run(kernel, *tensors):
        tensors = [t.clone() for t in tensors]  # an in-place form writes into its first operand
        call = kernel.call_boxed if kernel is original else kernel
        if form != "out":
            result = call(keys, *tensors, **options)
            assert form == "returned" or result.data_ptr() == tensors[0].data_ptr()
            return result
        out = torch.empty(0, dtype=tensors[0].dtype)
        assert call(keys, *tensors, **options, out=out).data_ptr() == out.data_ptr()
        return out

    result = run(ours, *operands)
    reference = getattr(torch, op)(*(t.double() for t in operands), **options)
    size = getattr(torch, op)(*(t.double().abs() for t in operands), **options)  # what the fp32 sums' error scales with
    summed = shapes[-2][-1]
    bound = torch.finfo(torch.bfloat16).eps * reference.abs() + 2 * summed * 2.0**-24 * size
    assert result.dtype == torch.bfloat16 and result.shape == reference.shape
    assert ((result.double() - reference).abs() <= bound).all()
    rounded = reference.bfloat16()
    native = run(original, *operands)
    equal, native_equal = (result == rounded).double().mean(), (native == rounded).double().mean()
    assert equal >= 0.99 and equal >= native_equal - 0.005, (equal, native_equal)
    single = [t.float() for t in operands]
    assert torch.equal(run(ours, *single), run(original, *single))
    few_rows = [t[..., :3, :] if t.dim() > 1 and i < len(operands) - 1 else t for i, t in enumerate(operands)]
    if op.startswith("add"):  # the added term's rows follow the product's
        few_rows[0] = operands[0] if operands[0].dim() == 1 else operands[0][..., :3, :]
    assert torch.equal(run(ours, *few_rows), run(original, *few_rows))
    mixed = [operands[0].float(), *operands[1:]]
    with pytest.raises(RuntimeError) as ours_error:
        run(ours, *mixed)
    with pytest.raises(RuntimeError) as aten_error:
        run(original, *mixed)
    assert str(ours_error.value) == str(aten_error.value)


def test_a_bf16_model_on_cpu_gets_fp32_products_only_where_the_cpu_has_none_of_its_own():
    """In a fresh process: an fp32 model installs nothing; a bf16 one installs the kernels where the CPU has no native
    bf16 products (AVX2) and not where it has (AVX512), saying so in one line. Installed, torch's own calls reach
    them (the profiler sees the operands copied to fp32 inside ``aten::mm``, and an fp32 product copies nothing), and
    a bf16 Linear's forward and backward, on a contiguous and on a transposed input, give the fp32 computation's
    values rounded once, bitwise."""
    check = """
import torch
from torch.profiler import profile
from fsdp_peft.core._compat import torch_patches
from fsdp_peft.model.modeling import bf16_products_prepared
torch.manual_seed(0)
layer = torch.nn.Linear(96, 40, bias=False)  # a 3-D input's bias is added after the product, in bf16
bf16_products_prepared(layer)
fp32_installed = "originals" in torch_patches._CPU_BF16
bf16_products_prepared(layer.bfloat16())
def copies(a, b):
    with profile() as trace:
        torch.mm(a, b)
    return any(event.name == "aten::_to_copy" for event in trace.events())
a, b = torch.randn(48, 96), torch.randn(96, 40)
w = layer.weight.float()
same = []
for x in (torch.randn(4, 40, 96), torch.randn(40, 4, 96).transpose(0, 1)):
    x = x.bfloat16().requires_grad_()
    y = layer(x)
    (2 * y).sum().backward()
    same += [torch.equal(y, torch.nn.functional.linear(x.float(), w).bfloat16())]
    same += [torch.equal(x.grad, torch.matmul(torch.full(y.shape, 2.0), w).bfloat16())]
print(fp32_installed, "originals" in torch_patches._CPU_BF16, torch_patches.cpu_has_native_bf16_products(),
      copies(a.bfloat16(), b.bfloat16()), copies(a, b), all(same))
"""
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    fp32_installed, installed, native, bf16_copies, fp32_copies, same = result.stdout.splitlines()[-1].split()
    assert fp32_installed == "False" and installed == str(native == "False")
    said = "run as fp32 products of the same values, rounded once" in result.stdout + result.stderr
    assert said == (native == "False") and bf16_copies == installed and fp32_copies == "False"
    assert same == "True" or installed == "False"  # with native bf16 products aten's sums need not be the fp32 ones


def test_bf16_products_in_fp32_leave_what_is_no_matrix_product_to_aten():
    """An empty batch multiplied by an expanded matrix gives aten's empty result, and an operand that is no matrix
    aten's own error, in every dtype."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    bmm = torch_patches.aten_cpu_kernel("bmm")
    ours_bmm = torch_patches._in_fp32(bmm, bmm)
    empty, weight = torch.randn(0, 40, 96).bfloat16(), torch.randn(96, 40).bfloat16().expand(0, 96, 40)
    assert ours_bmm(keys, empty, weight).shape == bmm.call_boxed(keys, empty, weight).shape == (0, 40, 40)
    mm = torch_patches.aten_cpu_kernel("mm")
    ours_mm = torch_patches._in_fp32(mm, mm)
    for dtype in (torch.float32, torch.bfloat16):
        vector, matrix = torch.randn(96, dtype=dtype), torch.randn(96, 40, dtype=dtype)
        with pytest.raises(RuntimeError) as ours_error:
            ours_mm(keys, vector, matrix)
        with pytest.raises(RuntimeError) as aten_error:
            mm.call_boxed(keys, vector, matrix)
        assert str(ours_error.value) == str(aten_error.value)
