"""The compiled decode step's choices (`fsdp_peft.tools.decoding`) and 4-bit weights dequantized for a generation call
(`fsdp_peft.tools.generation.four_bit_dequantized`). The compiled step's tokens against the eager path's: under FSDP2
in tests/tools/test_generation.py, for every family's recipe in tests/test_recipes_fsdp.py, tests/model/test_moe.py
and tests/model/test_vision.py."""

from __future__ import annotations

import pytest
import torch
from test_generation import lora_model


@pytest.fixture(autouse=True)
def _project_logger_made():
    """The project's logger made before each test's call: pytest's log capture attaches to the loggers that do not
    propagate (ours) as they are when a test's call starts, and misses one a first import inside the test makes."""
    import fsdp_peft.core.log  # noqa: F401  # lazy: as the tests import the package; importing it makes the logger


def test_a_call_compiles_over_a_static_cache_of_bucketed_length(tiny_model_dir):
    from fsdp_peft.tools.decoding import CACHE_BUCKET, decoding_for_call

    model = lora_model(tiny_model_dir)
    short = decoding_for_call(model, "true", True, 10, 32)
    assert short.eager_because is None and short.kwargs["cache_implementation"] == "static"
    assert short.kwargs["max_cache_len"] == CACHE_BUCKET == 64 and short.kwargs["disable_compile"] is False
    config = short.kwargs["compile_config"]
    assert config._compile_all_devices and config.mode == "default" and config.dynamic is False
    assert decoding_for_call(model, "true", True, 40, 32).kwargs["max_cache_len"] == 128  # 72 positions, 2 buckets


def test_each_reason_to_decode_eagerly_is_said_once(tiny_model_dir, caplog, monkeypatch):
    from conftest import tiny_llama_in_4bit
    from fsdp_peft.tools import decoding

    model = lora_model(tiny_model_dir)
    assert decoding.eager_because(model, "false", True) == "generate_compiled: false"
    # asked for here (4-bit layers are then dequantized for the call): true, or auto off CPU
    assert [decoding.compiles_here(model, setting) for setting in ("true", "auto", "false")] == [True, False, False]
    assert decoding.eager_because(model, "true", False).startswith("the weights gather in every forward (FSDP1")
    assert decoding.eager_because(model, "auto", True).startswith("on CPU compiling costs more")
    monkeypatch.setenv("PATH", "")  # no C++ compiler to be found
    monkeypatch.delenv("CXX", raising=False)
    assert decoding.eager_because(model, "true", True).startswith("no C++ compiler")
    monkeypatch.undo()
    four_bit = lora_model(tiny_model_dir, base=tiny_llama_in_4bit(tiny_model_dir))
    assert decoding.eager_because(four_bit, "true", True).startswith("4-bit layers")
    decoding._SAID.clear()
    with caplog.at_level("INFO", logger="fsdp_peft"):
        for _ in range(3):
            assert decoding.decoding_for_call(model, "false", True, 10, 8).kwargs == {}
    lines = [r.getMessage() for r in caplog.records if "decodes eagerly" in r.getMessage()]
    assert lines == ["generation decodes eagerly: generate_compiled: false"]


@pytest.mark.parametrize("limit", ["recompile_limit", "accumulated_recompile_limit"])
def test_a_call_past_dynamos_recompile_limit_decodes_eagerly_and_says_so(tiny_model_dir, caplog, limit):
    """One of dynamo's recompile limits met by the decode step (1 here: one graph, then a call of another batch size):
    that call decodes eagerly, the eager path's tokens, no graph compiled for it, and one line says which limit was
    met and what keeps it compiled."""
    from transformers import AutoTokenizer

    from fsdp_peft.tools import decoding
    from fsdp_peft.tools.generation import GenerationSettings, generate_completions

    torch._dynamo.reset()  # no graphs of an earlier test: the first call below compiles, the second meets the limit
    model, tokenizer = lora_model(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = ["the cat sat", "a b c"]
    settings = {"max_new_tokens": 8, "ignore_eos": True}
    eager = generate_completions(model, tokenizer, prompts, GenerationSettings(**settings, batch_size=2), "cpu")
    decoding._SAID.clear()
    one = GenerationSettings(**settings, batch_size=1, compiled="true")
    generate_completions(model, tokenizer, prompts[:1], one, torch.device("cpu"))
    met, graphs = decoding.recompile_limits_met(), decoding.graphs_compiled()
    assert graphs > 0
    two = GenerationSettings(**settings, batch_size=2, compiled="true")
    with torch._dynamo.config.patch({limit: 1}), caplog.at_level("INFO", logger="fsdp_peft"):
        assert generate_completions(model, tokenizer, prompts, two, torch.device("cpu")) == eager
    setting = f"torch._dynamo.config.{limit} = 1"
    assert decoding.recompile_limits_met() - met == {setting: 1} and decoding.graphs_compiled() == graphs
    lines = [r.getMessage() for r in caplog.records if "recompile limit" in r.getMessage()]
    assert lines == [
        "generation decodes eagerly for batch sizes and cache lengths without a graph: dynamo's recompile limit "
        f"({setting}) met by the decode step; fewer distinct batch sizes (a call's last batch may be smaller) or a "
        "higher limit keep them compiled"
    ]


def test_generate_compiled_reads_yaml_booleans_as_the_words():
    """``generate_compiled: true`` in YAML arrives as a bool; validate refuses what is not auto, true or false
    (tests/tools/test_validation.py)."""
    from fsdp_peft.settings.config import RecipeArguments

    assert RecipeArguments(generate_compiled=True).generate_compiled == "true"
    assert RecipeArguments(generate_compiled=" Auto").generate_compiled == "auto"


def test_4_bit_layers_compute_with_their_weights_dequantized_for_the_block_then_are_back(tiny_model_dir):
    """Every 4-bit layer replaced by a plain one holding its weight dequantized, computing what bitsandbytes'
    own forward computes (training mode: its dequantize-and-multiply path; eval mode on an AVX512-BF16 CPU repacks
    the weight for a kernel of its own), within the budget; the 4-bit layers back, untouched, after."""
    import bitsandbytes as bnb

    from conftest import tiny_llama_in_4bit
    from fsdp_peft.tools.generation import DequantizedLinear, adapters_merged, four_bit_dequantized

    model = lora_model(tiny_model_dir, base=tiny_llama_in_4bit(tiny_model_dir)).train()
    layers = {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(layers) == 4 * 7
    name = next(n for n in layers if n.endswith("q_proj.base_layer"))
    x = torch.randn(3, layers[name].in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = layers[name](x)
    each = {n: m.in_features * m.out_features * 2 for n, m in layers.items()}  # bf16 bytes
    with four_bit_dequantized(model, None) as used:
        dense = dict(model.named_modules())
        assert used == sum(each.values()) and not any(isinstance(dense[n], bnb.nn.Linear4bit) for n in layers)
        assert type(dense[name]) is DequantizedLinear and dense[name].weight.dtype == torch.bfloat16
        with torch.no_grad():
            assert torch.equal(dense[name](x), expected)
        with adapters_merged(model, None) as merged:  # QLoRA's update stays apart from the 16-bit weight
            assert merged == 0
    assert all(dict(model.named_modules())[n] is m for n, m in layers.items())
    budget = sum(sorted(each.values())[:3])
    with four_bit_dequantized(model, budget) as used:
        assert 0 < used <= budget
        assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) < len(layers)


PRODUCTS = {  # the compiled step's product of each kind, its class maker, and the inputs it is for
    "weight_first": (
        "weight_first_product",
        "weight_first_class",
        "WeightFirstLinear",
        ((5, 48), (2, 7, 48), (3, 1, 48)),
    ),
    "row_reduction": ("row_reduction_product", "row_reduction_class", "RowReductionLinear", ((1, 48), (1, 1, 48))),
}


@pytest.mark.parametrize("kind", PRODUCTS)
def test_each_product_is_the_layers_and_an_eager_forward_is_the_layers_own(kind):
    """``(W xᵀ)ᵀ + b`` (a decode step's rows, a prefill's 3-D input) and ``Σₖ W[:, k] x[k] + b`` (one row, 2-D and
    3-D) against the definition ``x Wᵀ + b`` in float64, with and without a bias; the weight-first output is the
    transposed view of ``W xᵀ``. A layer of either class outside a compiled step computes ``nn.Linear``'s own
    forward, bit for bit, and is still an instance of its class."""
    from fsdp_peft.tools import decoding
    from fsdp_peft.tools.generation import DequantizedLinear

    product_name, class_name, plain_name, shapes = PRODUCTS[kind]
    product, class_for = getattr(decoding, product_name), getattr(decoding, class_name)
    torch.manual_seed(0)
    assert class_for(torch.nn.Linear) is getattr(decoding, plain_name)
    assert issubclass(class_for(DequantizedLinear), DequantizedLinear)
    for layer in (torch.nn.Linear(48, 80), torch.nn.Linear(48, 80, bias=False), DequantizedLinear(48, 80)):
        for x in (torch.randn(*shape) for shape in shapes):
            expected = x.double() @ layer.weight.double().T
            expected = expected if layer.bias is None else expected + layer.bias.double()
            with torch.no_grad():
                got = product(x, layer.weight, layer.bias)
                own = layer(x)
                original = type(layer)
                layer.__class__ = class_for(original)
                assert torch.equal(layer(x), own) and isinstance(layer, original)
                layer.__class__ = original
            # fp32 sums of 48 products (weights within 1/sqrt(48), seeded normal inputs, sum|x w| <= 3.94 here): the
            # worst-case rounding 48 x 2^-24 x 3.94 is 1.1e-5, the typical one (random signs) ~1e-7; 1e-5 holds short
            # of an adversarial summation order
            assert got.shape == expected.shape and torch.allclose(got.double(), expected, rtol=0, atol=1e-5)
            if kind == "weight_first" and layer.bias is None and x.dim() == 2:
                assert got.stride() == (1, x.shape[0])  # W xᵀ, read transposed


def test_only_plain_linear_layers_over_plain_cpu_weights_are_swapped_and_all_come_back(monkeypatch):
    """Not a layer with an instance-level forward (an accelerate hook's), an uninitialized (lazy) or meta weight, or
    a weight of a tensor subclass; the classes back after an error in the block, a class changed meanwhile left."""
    from fsdp_peft.tools import decoding

    monkeypatch.setattr(decoding, "weight_first_is_faster", lambda weight, rows: True)
    hooked, meta, plain, other = (torch.nn.Linear(8, 8) for _ in range(4))
    hooked.forward = lambda x: x
    meta.to("meta")
    lazy = torch.nn.LazyLinear(8)
    model = torch.nn.Sequential(hooked, meta, lazy, plain, other)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        try:
            with decoding.weight_first_layers(model, 4) as swapped:
                assert swapped == 2 and type(plain) is type(other) is decoding.WeightFirstLinear
                assert type(hooked) is type(meta) is torch.nn.Linear and type(lazy) is torch.nn.LazyLinear
                other.__class__ = torch.nn.Identity  # changed during the block by something else: left so
                raise RuntimeError("inside the block")
        except RuntimeError:
            pass
        assert type(plain) is torch.nn.Linear and type(other) is torch.nn.Identity
    finally:
        torch.set_num_threads(threads)


def test_each_layer_shape_is_timed_both_ways_once_and_swapped_past_the_margin(monkeypatch):
    """The orientation is measured, not assumed: ``(W xᵀ)ᵀ`` chosen only when at least `ORIENTATION_MARGIN` faster,
    each shape, dtype, rows and threads timed once per process."""
    from fsdp_peft.tools import decoding

    timings = iter([1.0, 0.85, 1.0, 0.95])  # x Wᵀ, then (W xᵀ)ᵀ: 1.18x faster, then 1.05x
    timed = []
    monkeypatch.setattr(decoding, "_best_seconds", lambda call: timed.append(call) or next(timings))
    monkeypatch.setattr(decoding, "_ORIENTATION", {})
    assert decoding.weight_first_is_faster(torch.zeros(64, 32), rows=16)
    assert decoding.weight_first_is_faster(torch.zeros(64, 32), rows=16) and len(timed) == 2  # cached
    assert not decoding.weight_first_is_faster(torch.zeros(64, 32), rows=8) and len(timed) == 4
    assert decoding.ORIENTATION_MARGIN == 1.1


def _types_while_generating(model) -> dict[str, set[str]]:
    """The class names each linear layer of ``model`` was of in the forwards from now on (forward hooks: they run in
    the eager prompt forward; the layers keep their hooks while of a weight-first class)."""
    seen: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(
                lambda m, _i, _o, name=name: seen.setdefault(name, set()).add(type(m).__name__)
            )
    return seen


def _products_recorded(monkeypatch, name: str) -> list:
    """The weight shapes ``fsdp_peft.tools.decoding``'s product ``name`` is called with from now on, in a fresh
    dynamo (a fresh budget of recompiles: past dynamo's limit a frame runs eagerly, compiling none): the compiled
    step traces it once and replays the record at every step."""
    from fsdp_peft.tools import decoding

    torch._dynamo.reset()
    products = []
    product = getattr(decoding, name)
    monkeypatch.setattr(decoding, name, lambda *a: products.append(a[1].shape) or product(*a))
    return products


def _none_swapped(swapping, model, cases, layers: list) -> None:
    """With each ``(threads, rows)`` of ``cases``, ``swapping(model, rows)`` swaps no layer's class (the caller
    restores the thread count)."""
    for threads, rows in cases:
        torch.set_num_threads(threads)
        with swapping(model, rows) as swapped:
            assert swapped == 0 and all(type(layer) is torch.nn.Linear for layer in layers)


@pytest.mark.parametrize("merged", [True, False])
def test_linear_layers_compute_weight_first_for_a_compiled_cpu_call_and_draw_the_eager_tokens(
    tiny_model_dir, monkeypatch, merged
):
    """With 2 threads, every plain linear layer found faster weight first (all of them here: the check forced) is of a
    weight-first class for the call, and the compiled step computes weight first: the merged bases and the output
    layer, or, unmerged, each LoRA layer's base and adapter layers too and the trained copy of a ``modules_to_save``
    layer; the same modules in the same places, their hooks kept, and their classes back after. Greedy generation
    compiled: the eager path's tokens, and a second call compiles no new graph. With one thread, or one row, nothing
    changes."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_peft.tools import decoding
    from fsdp_peft.tools.generation import GenerationSettings, generate_completions

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
        modules_to_save=["lm_head"],
        init_lora_weights=False,
    )
    model = get_peft_model(base, config)
    before = dict(model.named_modules())
    plain = {name for name, m in before.items() if type(m) is torch.nn.Linear}
    assert any(".lora_A." in name for name in plain) and any("lm_head.modules_to_save" in name for name in plain)
    monkeypatch.setattr(decoding, "weight_first_is_faster", lambda weight, rows: True)
    products = _products_recorded(monkeypatch, "weight_first_product")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with decoding.weight_first_layers(model, 3) as swapped:
            assert swapped == len(plain) and dict(model.named_modules()) == before
            assert all(type(before[name]) is decoding.WeightFirstLinear for name in plain)
        assert all(type(before[name]) is torch.nn.Linear for name in plain)
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        prompts = ["hello there", "a b c", "the cat sat"]
        settings = {"max_new_tokens": 12, "batch_size": 3, "merged_adapter": merged}
        eager = generate_completions(model, tokenizer, prompts, GenerationSettings(**settings), "cpu")
        seen = _types_while_generating(model)
        compiled = GenerationSettings(**settings, compiled="true")
        assert generate_completions(model, tokenizer, prompts, compiled, torch.device("cpu")) == eager
        weight_first = {name for name, types in seen.items() if types == {"WeightFirstLinear"}}
        called = {name for name in plain if not name.endswith("lm_head.original_module")}  # the trained copy computes
        lora_parts = {name for name in plain if ".lora_" in name}
        assert weight_first == (called - lora_parts if merged else called), seen  # merged: no adapter layer called
        assert products and decoding.graphs_compiled() > 0  # the compiled step computed weight first
        graphs = decoding.graphs_compiled()
        assert generate_completions(model, tokenizer, prompts, compiled, torch.device("cpu")) == eager
        assert decoding.graphs_compiled() == graphs > 0 and dict(model.named_modules()) == before
        assert all(type(before[name]) is torch.nn.Linear for name in plain)
        _none_swapped(decoding.weight_first_layers, model, ((1, 3), (2, 1)), [before[name] for name in plain])
    finally:
        torch.set_num_threads(threads)


def test_at_one_row_linear_layers_reduce_over_weight_rows_in_a_compiled_cpu_call_and_draw_the_eager_tokens(
    tiny_model_dir, monkeypatch
):
    """With 2 threads and one prompt, every plain linear layer (the merged bases and the output layer) is of a
    row-reduction class for the call, the same modules in the same places, and the compiled step computes each as a
    reduction: the eager path's greedy tokens, and a second call compiles no new graph; the classes are back after.
    With one thread, or more rows, nothing changes (more rows: `weight_first_layers`)."""
    from transformers import AutoTokenizer

    from fsdp_peft.tools import decoding
    from fsdp_peft.tools.generation import GenerationSettings, generate_completions

    model = lora_model(tiny_model_dir).eval().requires_grad_(False)  # frozen: its merged weights kept
    before = dict(model.named_modules())
    plain = {name for name, m in before.items() if type(m) is torch.nn.Linear}
    products = _products_recorded(monkeypatch, "row_reduction_product")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        settings = {"max_new_tokens": 12, "batch_size": 1, "ignore_eos": True}  # this prompt draws EOS first
        eager = generate_completions(model, tokenizer, ["the cat sat"], GenerationSettings(**settings), "cpu")
        seen = _types_while_generating(model)
        compiled = GenerationSettings(**settings, compiled="true")
        assert generate_completions(model, tokenizer, ["the cat sat"], compiled, torch.device("cpu")) == eager
        reduced = {name for name, types in seen.items() if types == {"RowReductionLinear"}}
        assert reduced == {name for name in plain if ".lora_" not in name}, seen  # merged: no adapter layer called
        assert set(products) == {before[name].weight.shape for name in reduced}  # each ran as a reduction
        assert len(products) % len(reduced) == 0 and decoding.graphs_compiled() > 0  # all of them, at every step
        graphs = decoding.graphs_compiled()
        assert generate_completions(model, tokenizer, ["the cat sat"], compiled, torch.device("cpu")) == eager
        assert decoding.graphs_compiled() == graphs and dict(model.named_modules()) == before
        assert all(type(before[name]) is torch.nn.Linear for name in plain)
        _none_swapped(decoding.row_reduction_layers, model, ((1, 1), (2, 2)), [before[name] for name in plain])
    finally:
        torch.set_num_threads(threads)
