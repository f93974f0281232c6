"""Mixtures of experts (tiny Qwen3-MoE, tiny Mixtral): LoRA on attention and on every expert under FSDP2.

Per family one 2-rank FSDP2 run (fp32, the router's auxiliary loss off: it is a product of per-batch means, so a
split batch changes it) and one unsharded process with the same global batch and seed; the tests read what the runs
left: losses, adapters, samples, the checkpoint (resumed once), the merged export.
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, held_out_token_loss, launch_recipe, logged_losses, read_json, run_command, run_launch

STEPS = 5
SAMPLES = 8
COMMON = [
    "--max_steps",
    str(STEPS),
    "--logging_steps",
    "1",
    "--warmup_steps",
    "0",
    "--lr_scheduler_type",
    "constant",
    "--generate_samples",
    str(SAMPLES),
    "--generate_eval_samples",
    "0",
    "--router_aux_loss_coef",
    "0",
    "--per_device_train_batch_size",
    "16",
]
SHARDED = ["--save_strategy", "steps", "--save_steps", "3", "--export_merged", "true", "--export_dtype", "fp32"]
FAMILIES = {"qwen_moe_lora": "tiny-qwen3-moe", "mixtral_lora": "tiny-mixtral"}
EXPERTS = 8
RELATIVE = 1e-5  # fp32 LoRA: 2 ranks vs one process
# generation's decode step compiled on the 2 ranks of one family per method (the one process and the references
# decode eagerly: CPU, generate_compiled: auto)
GENERATE_COMPILED = {"qwen_moe_lora": ["--generate_compiled", "true"], "mixtral_qlora": ["--generate_compiled", "true"]}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def runs(request, tmp_path_factory, tiny_cache) -> dict:
    """The recipe on 2 FSDP2 ranks (checkpoint at step 3, merged fp32 export) and in one process, 32 rows a step."""
    recipe = request.param
    sharded, single = tmp_path_factory.mktemp(f"{recipe}_fsdp2"), tmp_path_factory.mktemp(f"{recipe}_single")
    result = launch_recipe(recipe, "--output_dir", str(sharded), *COMMON, *SHARDED, *GENERATE_COMPILED.get(recipe, []))
    one = [sys.executable, str(REPO / "recipes" / f"{recipe}.py"), "--output_dir", str(single), *COMMON]
    reference = run_launch([*one, "--per_device_train_batch_size", "32"])
    assert reference.returncode == 0, reference.stderr[-4000:]
    return {"recipe": recipe, "model": FAMILIES[recipe], "dir": sharded, "single": single, "stdout": result.stdout}


def _base(run, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    from fsdp_peft.model.paths import tiny_model_path

    return AutoModelForCausalLM.from_pretrained(tiny_model_path(run["model"]), dtype=dtype)


def _trained(run, trainable: bool = False):
    """Base + the run's saved adapter, in one plain process through peft alone."""
    from peft import PeftModel

    return PeftModel.from_pretrained(_base(run), run["dir"] / "adapter", is_trainable=trainable).eval()


def _assert_losses_as_one_process(runs: dict, bound: float) -> dict[int, float]:
    """The 2-rank run's logged losses within ``bound`` (relative) of the one-process run's, step by step."""
    losses, reference = logged_losses(runs["dir"]), logged_losses(runs["single"])
    assert len(losses) == len(reference) == STEPS
    worst = max(abs(losses[s] - reference[s]) / reference[s] for s in reference)
    print(f"{runs['recipe']}: largest relative loss difference over {STEPS} steps: {worst:.2e}")
    assert worst <= bound, (losses, reference)
    return losses


def test_two_ranks_train_attention_and_every_expert_as_one_process(runs):
    _assert_losses_as_one_process(runs, RELATIVE)

    adapter = load_file(runs["dir"] / "adapter" / "adapter_model.safetensors")
    wanted = load_file(runs["single"] / "adapter" / "adapter_model.safetensors")
    assert adapter.keys() == wanted.keys()
    experts = [key for key in adapter if ".mlp.experts." in key]
    assert len(experts) == 4 * 2 * 2  # 4 layers x (gate_up_proj, down_proj) x (A, B): every expert stacked
    assert not any(".mlp.gate." in key for key in adapter)  # the router stays frozen
    # Adam divides each element's step by its own running RMS, so elements whose gradients are near zero (an expert
    # few tokens reach) carry the split batch's fp32 rounding amplified: measured 6.8e-6 of the norm on this CPU, the
    # losses 9.4e-8. The bound is the losses' (the acceptance figure); the adapters get ten times it.
    norms = max(((adapter[k] - v).norm() / v.norm()).item() for k, v in wanted.items())
    print(f"{runs['recipe']}: largest adapter tensor difference, relative to its norm: {norms:.2e}")
    assert norms <= 10 * RELATIVE
    layout = read_json(runs["dir"] / "fsdp_layout.json")
    assert [unit for unit in layout["units"] if ".layers." in unit] == [
        f"base_model.model.model.layers.{i}" for i in range(4)
    ]  # each decoder layer, its experts inside
    assert all(p["placements"] == ["S(0)"] for p in layout["parameters"])


def test_every_expert_that_receives_tokens_gets_an_adapter_gradient_and_no_other(runs):
    """Each expert's slice of the stacked A and B: a gradient when the router sent it a token, and only then. Few
    tokens, so that some experts get none; every position's logits count (the last position's have no label)."""
    model = _trained(runs, trainable=True)
    ids = torch.randint(0, 256, (2, 3), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, output_router_logits=True)
    out.logits.square().mean().backward()
    k = model.config.num_experts_per_tok
    checked, idle, a_moved = 0, 0, 0
    for layer, logits in enumerate(out.router_logits):
        hit = torch.zeros(EXPERTS, dtype=torch.bool)
        hit[logits.topk(k, dim=-1).indices.unique()] = True
        idle += int((~hit).sum())
        experts = model.base_model.model.model.layers[layer].mlp.experts
        for wrapper in (experts, experts.base_layer):  # down_proj outside, gate_up_proj inside
            a, b = wrapper.lora_A["default"].weight.grad, wrapper.lora_B["default"].weight.grad
            a_per_expert = a.reshape(EXPERTS, -1, a.shape[-1]).abs().sum(dim=(1, 2))
            b_per_expert = b.reshape(b.shape[0], -1, EXPERTS).abs().sum(dim=(0, 1))
            # B: exactly the experts hit. A: never another (its gradient is B's transpose times the weight gradient,
            # so an expert whose B is still 0, which no labelled token has reached in training yet, has none either)
            assert torch.equal(b_per_expert > 0, hit), (layer, hit, b_per_expert)
            assert not (a_per_expert[~hit] > 0).any(), (layer, hit, a_per_expert)
            a_moved += int((a_per_expert > 0).sum())
            checked += 1
    assert checked == 8 and idle > 0 and a_moved > 0


def test_sharded_greedy_generation_matches_the_unsharded_model(runs):
    from transformers import AutoTokenizer

    from fsdp_peft.data.templates import render_prompt
    from fsdp_peft.model.paths import tiny_model_path
    from fsdp_peft.tools.generation import GenerationSettings, generate_completions

    samples = [__import__("json").loads(line) for line in (runs["dir"] / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == SAMPLES
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path(runs["model"]))
    prompts = [render_prompt(tokenizer, s["prompt"], use_chat_template=True) for s in samples]
    unsharded = generate_completions(_trained(runs), tokenizer, prompts, GenerationSettings(8, 50), torch.device("cpu"))
    assert unsharded == [s["generated"] for s in samples]
    assert ("compiled decode step:" in runs["stdout"]) == (runs["recipe"] in GENERATE_COMPILED)


def test_merged_export_is_peft_merge_and_loads_as_a_plain_model_with_the_trained_logits(runs, tmp_path):
    """The recipe's fp32 export: peft's ``merge_and_unload`` bit for bit; loaded without peft, its logits are the
    trained model's."""
    from peft import PeftModel

    merged = load_file(runs["dir"] / "merged" / "model.safetensors")
    reference = PeftModel.from_pretrained(_base(runs), runs["dir"] / "adapter").merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[key], want) for key, want in reference.items())
    script = (
        "import sys, json, torch; sys.modules['peft'] = None\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(runs['dir'] / 'merged')!r}).eval()\n"
        "ids = torch.tensor([[256, 259, 81, 68, 85, 68, 81, 82, 68, 25, 220, 64, 65, 66, 67, 68, 257, 260]])\n"
        "print(json.dumps(model(input_ids=ids).logits[0].tolist()))\n"
    )
    result = run_command([sys.executable, "-c", script], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    logits = torch.tensor(__import__("json").loads(result.stdout.strip().splitlines()[-1]))
    ids = torch.tensor([[256, 259, 81, 68, 85, 68, 81, 82, 68, 25, 220, 64, 65, 66, 67, 68, 257, 260]])
    with torch.no_grad():
        want = _trained(runs)(input_ids=ids).logits[0]
    print(f"{runs['recipe']}: exported logits vs the trained model: {(logits - want).abs().max():.2e}")
    assert (logits - want).abs().max() <= 1e-5


def test_resumed_from_the_checkpoint_a_killed_run_leaves_the_run_continues_exactly(runs, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(runs["dir"] / "checkpoint-3", resumed / "checkpoint-3")  # all a run killed after step 3 leaves
    launch_recipe(
        runs["recipe"],
        "--output_dir",
        str(resumed),
        *COMMON,
        *SHARDED[:4],
        "--resume_from_checkpoint",
        str(resumed / "checkpoint-3"),
        "--generate_samples",
        "0",
    )
    losses, uninterrupted = logged_losses(resumed), logged_losses(runs["dir"])
    assert sorted(losses) == [1, 2, 3, 4, 5]  # steps 1-3 as the checkpoint recorded them
    assert [losses[s] for s in (4, 5)] == [uninterrupted[s] for s in (4, 5)]


def test_the_routers_auxiliary_loss_is_applied_once_per_step_and_logged(tmp_path, tiny_cache):
    """With accumulation 2 the logged loss is the cross-entropy plus coefficient x aux, not 2 x (Trainer's sum); the
    eval loss is the held-out cross-entropy alone (docs/checkpoints.md), as plain peft computes it on the adapter."""
    from transformers import AutoTokenizer

    from fsdp_peft.data.formats import read_examples
    from fsdp_peft.data.sources import data_files
    from fsdp_peft.data.tokenize import tokenized_dataset
    from fsdp_peft.model.paths import tiny_model_path
    from fsdp_peft.settings.config import RecipeArguments

    common = ["--max_steps", "2", "--logging_steps", "1", "--generate_samples", "0", "--generate_eval_samples", "0"]
    common += ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"]
    logs = {}
    for coefficient in ("0", "0.5"):
        out = tmp_path / coefficient
        command = [sys.executable, str(REPO / "recipes" / "mixtral_lora.py"), "--output_dir", str(out), *common]
        result = run_launch([*command, "--router_aux_loss_coef", coefficient])
        assert result.returncode == 0, result.stderr[-3000:]
        logs[coefficient] = [e for e in read_json(out / "trainer_state.json")["log_history"] if "loss" in e]
    first_off, first_on = logs["0"][0], logs["0.5"][0]
    assert "aux_loss" not in first_off and first_on["aux_loss"] > 1.0  # top-2 of 8: balanced is 1, at least
    assert first_on["loss"] - first_off["loss"] == pytest.approx(0.5 * first_on["aux_loss"], abs=2e-4)
    run = {"model": "tiny-mixtral", "dir": tmp_path / "0.5"}
    recipe = RecipeArguments(max_seq_length=64)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path(run["model"]))
    _, eval_path = data_files(recipe)
    rows = tokenized_dataset(read_examples(eval_path), tokenizer, recipe, eval_path)
    reference = held_out_token_loss(_trained(run), rows)
    evaluated = read_json(run["dir"] / "results.json")["eval_loss"]
    print(f"mixtral_lora, router_aux_loss_coef 0.5: eval loss {evaluated:.6f}, plain peft {reference:.6f}")
    assert evaluated == pytest.approx(reference, rel=1e-5)


# QLoRA: the experts in 4 bits (fsdp_peft.model.moe_quantization). bf16 compute, so 16 rows a rank as the dense QLoRA
# tests
QLORA_RELATIVE = 1e-4
QLORA = {"qwen_moe_qlora": "tiny-qwen3-moe", "mixtral_qlora": "tiny-mixtral"}


@pytest.fixture(scope="module", params=sorted(QLORA))
def qlora_runs(request, tmp_path_factory, tiny_cache) -> dict:
    """The QLoRA recipe on 2 FSDP2 ranks and in one process (same global batch and seed), and on 2 ranks with
    low-memory loading (rank 0 reads and quantizes each tensor, every rank keeps its shard)."""
    recipe = request.param
    sharded, single = tmp_path_factory.mktemp(f"{recipe}_fsdp2"), tmp_path_factory.mktemp(f"{recipe}_single")
    result = launch_recipe(recipe, "--output_dir", str(sharded), *COMMON, *GENERATE_COMPILED.get(recipe, []))
    one = [sys.executable, str(REPO / "recipes" / f"{recipe}.py"), "--output_dir", str(single), *COMMON]
    reference = run_launch([*one, "--per_device_train_batch_size", "32"])
    assert reference.returncode == 0, reference.stderr[-4000:]
    runs = {"recipe": recipe, "model": QLORA[recipe], "dir": sharded, "single": single, "stdout": result.stdout}
    launcher = tmp_path_factory.mktemp("launcher") / "low_memory.yaml"
    text = (REPO / "configs" / "accelerate" / "cpu_fsdp2.yaml").read_text()
    launcher.write_text(text.replace("fsdp_cpu_ram_efficient_loading: false", "fsdp_cpu_ram_efficient_loading: true"))
    low = tmp_path_factory.mktemp(f"{recipe}_low_memory")
    runs["low_stdout"] = launch_recipe(recipe, "--output_dir", str(low), *COMMON, accelerate_config=launcher).stdout
    runs["low"] = low
    return runs


def test_qlora_on_two_ranks_trains_as_one_process_with_the_experts_in_4_bits(qlora_runs):
    losses = _assert_losses_as_one_process(qlora_runs, QLORA_RELATIVE)
    assert losses[STEPS] < losses[1]
    layout = read_json(qlora_runs["dir"] / "fsdp_layout.json")
    stored = {p["name"]: p for p in layout["parameters"]}
    rows = [name for name in stored if name.endswith("_4bit")]
    assert len(rows) == 4 * 2 and all(stored[name]["placements"] == ["S(0)"] for name in rows)  # sharded by expert
    assert not [name for name in stored if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]


def test_the_experts_take_at_most_0_3_of_their_bf16_bytes_per_rank_and_the_plan_counts_them_exactly(qlora_runs):
    """Measured on each rank from the run's layout (its shard of the 4-bit rows: values and constants) against the
    same experts' bf16 bytes split over 2 ranks; `fsdp-peft plan` of the config gives the same figure."""
    import math

    from fsdp_peft.model.paths import tiny_model_path
    from fsdp_peft.procedures.registry import plan_config

    layout = read_json(qlora_runs["dir"] / "fsdp_layout.json")
    measured = sum(
        math.prod(p["local_shape"]) * 2 for p in layout["parameters"] if p["name"].endswith("_4bit")
    )  # bf16 storage: 2 bytes an element
    config = read_json(tiny_model_path(qlora_runs["model"]) / "config.json")
    experts = config.get("num_experts") or config["num_local_experts"]
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    bf16 = 4 * 3 * experts * width * config["hidden_size"] * 2 // 2  # 4 layers, gate_up + down, over 2 ranks
    print(f"{qlora_runs['recipe']}: experts per rank {measured} bytes in 4 bits, {bf16} in bf16: {measured / bf16:.3f}")
    assert measured <= 0.3 * bf16
    plan = plan_config(REPO / "configs" / qlora_runs["recipe"] / "tiny.yaml", 2, 24 * 2**30)
    assert plan.counts.expert_bytes == measured


def test_low_memory_loading_quantizes_the_experts_as_ordinary_loading_does(qlora_runs):
    assert "low-memory loading: rank 0 read" in qlora_runs["low_stdout"]
    assert logged_losses(qlora_runs["low"]) == logged_losses(qlora_runs["dir"])  # bit for bit


def test_qlora_sharded_generation_matches_the_unsharded_4bit_model(qlora_runs):
    """The samples of the 2-rank run against `fsdp-peft generate`'s one-process load of the adapter (its base
    quantized, experts included, on load)."""
    from fsdp_peft.tools.generation import GenerationSettings, generate_completions
    from fsdp_peft.tools.inference import load_for_generation

    samples = [
        __import__("json").loads(line) for line in (qlora_runs["dir"] / "samples.jsonl").read_text().splitlines()
    ]
    loaded = load_for_generation(qlora_runs["dir"] / "adapter", None, torch.device("cpu"))
    from fsdp_peft.data.templates import render_prompt

    prompts = [render_prompt(loaded.tokenizer, s["prompt"], use_chat_template=True) for s in samples]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unsharded = generate_completions(
            loaded.model, loaded.tokenizer, prompts, GenerationSettings(8, 50), torch.device("cpu")
        )
    assert unsharded == [s["generated"] for s in samples]
    assert ("compiled decode step:" in qlora_runs["stdout"]) == (qlora_runs["recipe"] in GENERATE_COMPILED)


def test_nf4_export_merges_onto_the_experts_training_saw_as_peft_would(qlora_runs, tmp_path):
    """``--base-variant nf4``: every expert dequantized as in training, then the adapter merged: peft's
    ``merge_and_unload`` on that base, bit for bit (fp32); the base's experts are bitsandbytes' quantization of each
    expert decoded by the reference decoder (tests/four_bit_reference.py), not by the code under test."""
    import bitsandbytes.functional as bnb_functional
    from four_bit_reference import decode
    from peft import PeftModel

    from fsdp_peft.tools.export import export_merged

    out = export_merged(qlora_runs["dir"], tmp_path / "nf4", dtype="fp32", base_variant="nf4", progress=False)
    merged = load_file(out / "model.safetensors")
    base = _base(qlora_runs)
    with torch.no_grad():
        for name, parameter in base.named_parameters():
            if ".experts." in name:
                for expert, weight in enumerate(parameter.to(torch.bfloat16)):
                    packed, state = bnb_functional.quantize_4bit(
                        weight, blocksize=64, compress_statistics=True, quant_type="nf4"
                    )
                    parameter[expert] = decode(packed, state, torch.float32)
    reference = PeftModel.from_pretrained(base, qlora_runs["dir"] / "adapter").merge_and_unload().state_dict()
    experts = [key for key in reference if ".experts." in key]
    assert len(experts) == 8
    assert all(torch.equal(merged[key], reference[key]) for key in experts)


def test_the_experts_the_qlora_forward_reads_are_the_reference_decode_of_the_stored_rows(qlora_runs):
    """Held out from the code under test: the run's base loaded as `fsdp-peft generate --base-only` loads it (quantized
    on load, as training did: the 2-rank samples equal the same load's with the adapter, above). In one forward, the
    weights each experts module reads (captured as it is called) equal the reference decoder's reading of the stored
    4-bit rows (tests/four_bit_reference.py: the NF4 definition, the documented row layout), exactly; and each is
    within 0.1 (relative) of the checkpoint's bf16 weights, where a right NF4 round trip is 0.09 (a misplaced block
    scale, as bitsandbytes' CPU kernel did for these 96-wide experts, 0.25)."""
    from four_bit_reference import decode_expert_rows, relative_error

    from fsdp_peft.model.paths import tiny_model_path
    from fsdp_peft.tools.inference import load_for_generation

    loaded = load_for_generation(qlora_runs["dir"] / "adapter", None, torch.device("cpu"), base_only=True)
    read, stored = {}, {}

    def reading(key: str, attribute: str):
        def hook(module, args) -> None:  # returns nothing: the call's arguments stay as they are
            read.setdefault(key, getattr(module, attribute).detach().clone())

        return hook

    for name, module in loaded.model.named_modules():
        for row_name, rows in module.named_parameters(recurse=False):
            if row_name.endswith("_4bit"):
                attribute = row_name.removesuffix("_4bit")
                stored[key := f"{name}.{attribute}"] = rows.detach().clone()
                module.register_forward_pre_hook(reading(key, attribute))
    ids = torch.tensor([[256, 259, 81, 68, 85, 68, 81, 82, 68, 25, 220, 64, 65, 66, 67, 68, 257, 260]])
    with torch.no_grad():
        loaded.model(input_ids=ids)
    original = load_file(tiny_model_path(qlora_runs["model"]) / "model.safetensors")
    assert len(read) == len(stored) == 4 * 2  # 4 layers x (gate_up_proj, down_proj)
    worst = 0.0
    for key, weights in read.items():
        want = decode_expert_rows(stored[key], weights.shape, "nf4", True, weights.dtype)
        assert torch.equal(weights, want), key
        worst = max(worst, relative_error(weights, original[key]))
    print(f"{qlora_runs['recipe']}: experts read vs bf16 weights, largest relative error {worst:.3f}")
    assert worst <= 0.1
