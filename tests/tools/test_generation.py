"""Generation from the sharded model: FSDP2 units gathered once per call within a budget, the adapter merged into
the gathered units, same tokens."""

from __future__ import annotations

import pytest

from conftest import REPO, last_json_line, torchrun

CHECK = REPO / "tests" / "distributed" / "generation_check.py"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def report(tiny_model_dir):
    return last_json_line(torchrun(CHECK).stdout)


def test_every_budget_generates_the_unsharded_tokens(report):
    """The reference: each prompt alone on the unsharded model, the adapter unmerged (peft's own forward)."""
    assert {"all", "none", "all unmerged"} < set(report["budgets"]) and len(report["reference"]) > 0  # and bytes
    for budget, run in report["budgets"].items():
        assert run["completions"] == report["reference"], budget


def test_the_compiled_decode_step_draws_the_eager_tokens_greedy_and_sampled(report):
    """The decode step compiled over a static cache (all units kept, their FSDP hooks set aside): the reference's
    greedy tokens, the eager path's sampled tokens for the same seed, one graph per batch size (2 and 1 on rank 0:
    3 prompts, 2 a call); without the units kept (budget none) it decodes eagerly and compiles nothing more."""
    runs = report["budgets"]
    assert runs["all compiled"]["completions"] == report["reference"]
    assert runs["all compiled"]["all_gathers"] == report["units"]  # gathered once, as eager
    assert len(runs["all compiled"]["merged_layers"]) == report["lora_layers"]
    assert runs["all unmerged"]["graphs"] == 0 and runs["all compiled"]["graphs"] == 2
    assert runs["none compiled"]["graphs"] == report["graphs"] == 2
    sampled = report["sampled"]
    assert sampled["true"] == sampled["false"] and sampled["false"] != report["reference"]


def test_the_adapter_is_merged_into_the_gathered_units_only_and_no_shard_changes(report):
    runs = report["budgets"]
    assert report["lora_layers"] == 4 * 7  # q, k, v, o, gate, up, down in each of the 4 layers
    assert len(runs["all"]["merged_layers"]) == report["lora_layers"]
    assert runs["none"]["merged_layers"] == runs["all unmerged"]["merged_layers"] == []
    partial = next(run for budget, run in runs.items() if budget.endswith("B"))  # root + the first 2 layers
    assert {name.split(".layers.")[1].split(".")[0] for name in partial["merged_layers"]} == {"0", "1"}
    assert len(partial["merged_layers"]) == 2 * 7
    # merged into the gathered copies, which resharding drops: every shard bit for bit as before, none left merged
    assert report["shards_unchanged"] and report["merged_after"] == []
    assert report["merged_layers_own_forward"] == [] and report["modules_unchanged"]  # bases stood in, then back
    # units gathered before the call and not kept (FSDP2 leaves them gathered after it): unmerged, the same tokens,
    # and the next forward computes as the one before the call (no adapter applied twice)
    before = report["gathered_before_the_call"]
    assert before["merged_layers"] == [] and before["completions"] == report["reference"]
    assert before["next_forward_unchanged"]


def test_budget_all_gathers_each_unit_once_per_call_and_none_once_per_token(report):
    runs, units = report["budgets"], report["units"]
    assert units == 5  # 4 decoder layers and the root
    assert runs["all"]["all_gathers"] == units
    assert runs["none"]["all_gathers"] >= NEW_TOKENS * (units - 1)
    partial = next(run for budget, run in runs.items() if budget.endswith("B"))  # root + 2 layers fit
    assert runs["all"]["all_gathers"] < partial["all_gathers"] < runs["none"]["all_gathers"]


def test_training_after_generation_reshards_as_before(report):
    before, after = report["training_step_all_gathers"]
    assert after == before > 0


def test_on_one_rank_too_the_merge_goes_into_the_gathered_copy_not_the_shard(tiny_model_dir):
    """FSDP2 on a single rank (one GPU under accelerate launch): its all-gather copies the one shard, so merging into
    the gathered weights leaves the trained weights as they were."""
    one = last_json_line(torchrun(CHECK, processes=1).stdout)
    assert (
        one["budgets"]["all"]["completions"] == one["reference"] and len(one["budgets"]["all"]["merged_layers"]) == 28
    )
    assert one["shards_unchanged"] and one["merged_after"] == []
    assert one["merged_layers_own_forward"] == [] and one["modules_unchanged"]


def test_ranks_agree_on_the_smallest_budget(report):
    assert report["agreed_budget"] == 12345  # rank 0 asked for all, rank 1 for 12345 bytes


def lora_model(tiny_model_dir, dropout: float = 0.0, base=None):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = base if base is not None else AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = LoraConfig(  # lora_alpha 16: a scaling of 2, so a merge that drops or inverts it shows
        r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=dropout, init_lora_weights=False
    )
    return get_peft_model(base, config)


def merged_while_generating(model) -> tuple[set[str], set[str]]:
    """The LoRA layers that computed merged in forwards from now on (hooks on their base layers, which compute in both
    forms: inside the LoRA layer, or alone in its place while merged), and those of them whose own forward ran
    (hooks on the LoRA layers: none, when their bases stand in their places)."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    seen: set[str] = set()
    wrapped: set[str] = set()
    for name, layer in model.named_modules():
        if isinstance(layer, LoraLinear):
            layer.base_layer.register_forward_pre_hook(
                lambda _module, _args, name=name, lora=layer: seen.add(name) if lora.merged else None
            )
            layer.register_forward_pre_hook(lambda m, _args, name=name: wrapped.add(name) if m.merged else None)
    return seen, wrapped


def test_unsharded_the_adapter_is_merged_into_copies_within_the_budget_and_the_weights_come_back(tiny_model_dir):
    """Without FSDP the weights are the model's own: each merged layer computes with a merged copy for the call, as
    many as the budget holds, and the weight itself is back after it, the same tensor bit for bit. The reference:
    peft's own unmerged forward."""
    import torch
    from transformers import AutoTokenizer

    from fsdp_peft.tools.generation import GenerationSettings, generate_completions

    model, tokenizer = lora_model(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.batch_decode = lambda rows, **kwargs: [" ".join(map(str, row.tolist())) for row in rows]
    prompts = [f"<|user|>{w}<|assistant|>" for w in ("apple", "river", "cloud")]
    weights = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    modules = dict(model.named_modules())
    seen, wrapped = merged_while_generating(model)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    completions = {}
    for budget, merged in (("all", False), ("all", True), (f"{q_proj.nbytes}B", True)):
        seen.clear()
        settings = GenerationSettings(NEW_TOKENS, batch_size=2, gather_budget=budget, merged_adapter=merged)
        completions[budget, merged] = generate_completions(model, tokenizer, prompts, settings, torch.device("cpu"))
        completions[budget, merged] += [sorted(seen)]
    assert completions["all", False][-1] == [] and len(completions["all", True][-1]) == 4 * 7
    assert completions[f"{q_proj.nbytes}B", True][-1] == ["base_model.model.model.layers.0.self_attn.q_proj"]
    assert (
        completions["all", True][:-1] == completions[f"{q_proj.nbytes}B", True][:-1] == completions["all", False][:-1]
    )
    for name, p in model.named_parameters():
        assert p.data_ptr() == weights[name][0] and torch.equal(p, weights[name][1]), name
    assert wrapped == set() and dict(model.named_modules()) == modules  # every LoRA layer back in its place
    assert not any(getattr(module, "merged", False) for module in model.modules())


def test_a_frozen_model_keeps_its_merged_weights_while_they_are_what_it_would_merge(tiny_model_dir):
    """A model nothing trains (no parameter requires grad, as `fsdp-peft generate` loads it) keeps each call's merged
    copies for the next: the same tensors come back, computing as a fresh merge does, until a weight or adapter
    changes (in place, through ``.data`` behind the version counter, a new tensor in its place, its scale): then that
    layer merges anew, and its logits follow peft's unmerged forward. A kept copy holds no old weight alive; kept
    copies count against the budget (one that does not fit is dropped); a model in training keeps none."""
    import weakref

    import torch
    from peft.tuners.lora.layer import LoraLayer

    from fsdp_peft.tools import generation
    from fsdp_peft.tools.generation import adapters_merged

    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    frozen, training = lora_model(tiny_model_dir).eval(), lora_model(tiny_model_dir).eval()
    frozen.requires_grad_(False)
    layers = [layer.mlp.down_proj for layer in frozen.base_model.model.model.layers]  # for every merged layer
    weights = [layer.base_layer.weight for layer in layers]

    def copies() -> list:  # held here: a copy dropped by the code under test stays alive, its storage not reused
        return [generation._MERGED_COPIES[layer] for layer in layers]

    def kept(model) -> int:  # the merged copies kept for this model's layers (other tests' models may have some)
        return sum(module in generation._MERGED_COPIES for module in model.modules())

    def merged_call(model, budget=None) -> tuple[int, list[int], torch.Tensor]:
        with adapters_merged(model, budget) as count, torch.no_grad():
            pointers = [weight.data_ptr() for weight in weights]
            return count, pointers, model(input_ids=ids).logits

    count, pointers, logits = merged_call(frozen)
    first = copies()
    assert count == 4 * 7 and kept(frozen) == 4 * 7
    assert pointers == [copy.merged.data_ptr() for copy in first]
    with torch.no_grad():
        unmerged = frozen(input_ids=ids).logits
    torch.testing.assert_close(logits, unmerged, rtol=0, atol=1e-5)
    held = sum(module.get_base_layer().weight.nbytes for module in frozen.modules() if isinstance(module, LoraLayer))
    again, again_pointers, kept_logits = merged_call(frozen, budget=held)  # the kept copies count, and just fit
    assert again == 4 * 7 and again_pointers == pointers and torch.equal(kept_logits, logits)
    assert all(now is before for now, before in zip(copies(), first))
    assert torch.equal(merged_call(training)[2], logits)  # what a fresh merge computes, bit for bit
    assert kept(training) == 0
    layer = layers[1]
    changes = (
        lambda: layer.lora_B["default"].weight.data.mul_(3),  # behind the version counter: seen by value
        lambda: layer.base_layer.weight.add_(0.5),  # in place: the version counter moves
        lambda: setattr(layer.base_layer.weight, "data", layer.base_layer.weight * 2),  # new storage, same version
        lambda: layer.scaling.update(default=0.5),
    )
    for change in changes:
        with torch.no_grad():
            change()
            unmerged = frozen(input_ids=ids).logits
        _, pointers, logits = merged_call(frozen)
        now = copies()
        assert [a is b for a, b in zip(now, first)] == [True, False, True, True], change
        assert pointers[1] == now[1].merged.data_ptr() != first[1].merged.data_ptr()
        torch.testing.assert_close(logits, unmerged, rtol=0, atol=1e-5)
        assert not torch.allclose(logits, kept_logits, atol=1e-3)
        first = now
    replaced = weakref.ref(weights[2].untyped_storage())
    weights[2].data = weights[2].data.clone()  # the old weight goes: no kept copy holds it
    assert replaced() is None
    assert merged_call(frozen, budget=0)[0] == 0 and kept(frozen) == 0  # kept copies count: none fits, all dropped
    assert merged_call(frozen)[0] == 4 * 7 and kept(frozen) == 4 * 7
    frozen.requires_grad_(True)  # trained from now on: the copies go
    assert merged_call(frozen)[0] == 4 * 7 and kept(frozen) == 0


def test_a_merged_weight_is_the_base_plus_the_scaled_adapter_product(tiny_model_dir):
    """The merge against its definition, ``W + s B A`` in float64 (scaling 2): fused where the adapter has the
    weight's dtype (fp32, bf16 as under mixed precision), peft's delta (made in the adapter's dtype) where it has not
    (a bf16 weight, an fp32 adapter); in place (a gathered copy) or into a new tensor."""
    import torch

    from fsdp_peft.tools.generation import _add_delta

    layer = lora_model(tiny_model_dir).base_model.model.model.layers[0].mlp.down_proj
    assert layer.scaling["default"] == 2
    cases = (
        (torch.float32, torch.float32, 1e-6),  # fp32: one rounding of a sum over r=8 products (~1e-7 relative)
        (torch.bfloat16, torch.float32, 1e-2),  # bf16: the result rounded to 8 significant bits (2^-9 relative)
        (torch.bfloat16,) * 2 + (1e-2,),  # and the adapter's own bf16 rounding, already in the float64 reference
    )
    for dtype, adapter_dtype, tolerance in cases:
        layer.to(adapter_dtype)
        weight = layer.base_layer.weight.detach().to(dtype)
        a, b = (layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double())
        expected = weight.double() + 2 * (b @ a)
        merged = _add_delta(layer, "default", weight)
        assert merged.dtype == dtype and merged.data_ptr() != weight.data_ptr()
        torch.testing.assert_close(merged.double(), expected, rtol=tolerance, atol=tolerance)
        in_place = weight.clone()
        assert _add_delta(layer, "default", in_place, in_place=True).data_ptr() == in_place.data_ptr()
        assert torch.equal(in_place, merged)


def test_active_dropout_and_4_bit_bases_stay_unmerged(tiny_model_dir):
    """Merging drops LoRA dropout from the forward: only where it is inactive (eval mode, or ``lora_dropout: 0`` in
    training mode, as GRPO's rollouts run). A 4-bit base has no full-precision weight to merge into."""
    from conftest import tiny_llama_in_4bit
    from fsdp_peft.tools.generation import adapters_merged

    dropping = lora_model(tiny_model_dir, dropout=0.1)
    for training, merged in ((True, 0), (False, 4 * 7)):
        dropping.train(training)
        with adapters_merged(dropping, None) as count:
            assert count == merged, training
    without_dropout = lora_model(tiny_model_dir, dropout=0.0).train()
    with adapters_merged(without_dropout, None) as count:
        assert count == 4 * 7
    with adapters_merged(lora_model(tiny_model_dir, base=tiny_llama_in_4bit(tiny_model_dir)).eval(), None) as count:
        assert count == 0


def test_a_weight_tied_to_another_module_stays_unmerged(tiny_model_dir):
    """An adapter on a tied output layer: merging into its weight would change the input embedding too."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fsdp_peft.tools.generation import adapters_merged

    tied = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    embedding = tied.model.embed_tokens.weight.detach().clone()
    config = LoraConfig(r=8, target_modules=["lm_head", "q_proj"], init_lora_weights=False)
    model = get_peft_model(tied, config).eval()
    with adapters_merged(model, None) as count:
        assert count == 4  # the 4 layers' q_proj; not lm_head
        assert torch.equal(model.get_base_model().model.embed_tokens.weight, embedding)
