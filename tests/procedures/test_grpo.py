"""GRPO (recipes/llama_grpo.py through TRL's GRPOTrainer): real 2-rank FSDP2 runs against one process.

One short SFT run gives the adapter every GRPO run starts from (the SFT -> GRPO chain; its lora_B is not zero, so
every LoRA tensor gets a gradient and the KL to the adapter-disabled reference is not zero from the first step).
With the rollouts held fixed (`tests/distributed/grpo_fixed_rollouts.py`), the loss and gradients of 2 ranks x 16
completions are compared with one process x 32; with real sampling, the rollouts of the recipe's gathered
generation are compared with TRL's own per-layer path, and a resumed run with the uninterrupted one.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import (
    ACCELERATE_CPU_FSDP2,
    REPO,
    launch_recipe,
    read_json,
    run_command,
    run_launch,
    script_launch_command,
)

FIXED_ROLLOUTS = REPO / "tests" / "distributed" / "grpo_fixed_rollouts.py"
STEPS = 3
COMMON = [
    "--max_steps",
    str(STEPS),
    "--logging_steps",
    "1",
    "--num_generations",
    "4",
    "--max_completion_length",
    "6",
    "--beta",
    "0.04",  # the KL term and its adapter-disabled reference pass take part
    "--learning_rate",
    "1e-3",
    "--max_grad_norm",
    "0",  # the gradients compared are the ones the loss gives, unclipped
    "--generate_samples",
    "8",
    "--disable_tqdm",
    "true",
]
FIXED = ["--reward_funcs", "grpo_fixed_rollouts:token_reward"]
# a 5-step SFT adapter reverses no word yet: exact_answer alone would give every group the same zero reward
SAMPLED = ["--reward_funcs", "exact_answer", "tests.distributed.grpo_fixed_rollouts:token_reward"]
QLORA = ["--load_in_4bit", "true", "--bf16", "true", "--torch_dtype", "bfloat16"]


def _launch_fixed(output_dir, *arguments, processes=2, accelerate_config=ACCELERATE_CPU_FSDP2):
    grads = output_dir / "grads.pt"
    arguments = ("--grads_out", str(grads), "--output_dir", str(output_dir), *arguments)
    command = script_launch_command(
        FIXED_ROLLOUTS, *arguments, processes=processes, accelerate_config=accelerate_config
    )
    result = run_launch(command)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return torch.load(grads)


def _logged(output_dir) -> dict[int, dict]:
    history = read_json(output_dir / "trainer_state.json")["log_history"]
    return {e["step"]: e for e in history if "loss" in e}


@pytest.fixture(scope="module")
def sft_start(tmp_path_factory):
    sft = tmp_path_factory.mktemp("sft_start")
    launch_recipe("llama_lora", "--output_dir", str(sft), "--max_steps", "5", "--generate_samples", "0")
    return sft / "adapter"


@pytest.fixture(scope="module")
def fixed_runs(tmp_path_factory, sft_start):
    """LoRA (fp32) with fixed rollouts: 2 ranks x 16 completions, and one process x 32."""
    start = ["--adapter_name_or_path", str(sft_start)]
    two, one = tmp_path_factory.mktemp("grpo_two"), tmp_path_factory.mktemp("grpo_one")
    two_grads = _launch_fixed(two, *COMMON, *FIXED, *start, "--per_device_train_batch_size", "16")
    one_grads = _launch_fixed(one, *COMMON, *FIXED, *start, "--per_device_train_batch_size", "32", processes=1)
    return {"two": two, "one": one, "two_grads": two_grads, "one_grads": one_grads}


def _compare_first_step(two, one, two_grads, one_grads, bound, metrics=("loss", "kl")):
    """The first step's loss (and ``metrics``) and every adapter gradient: the same weights and rollouts on both
    sides, so what differs is only the sharded computation. Each gradient is compared relative to its own norm
    (the claim is "the same gradient"; an element near zero says nothing about it); the loss relative to itself."""
    first_two, first_one = _logged(two)[1], _logged(one)[1]
    assert first_two["reward"] == first_one["reward"]  # the same rollouts and rewards: exactly
    assert first_one["kl"] > 0  # the reference (adapter disabled) is not the policy: the KL term takes part
    worst = {k: abs(first_two[k] - first_one[k]) / abs(first_one[k]) for k in metrics}
    assert sorted(two_grads) == sorted(one_grads), sorted(set(two_grads) ^ set(one_grads))[:4]
    assert len(one_grads) == 56  # 7 modules x 4 layers x A, B
    assert all(g.norm() > 0 for g in one_grads.values())  # from a trained adapter: every tensor gets a gradient
    worst["gradient"] = max(((two_grads[k] - g).norm() / g.norm()).item() for k, g in one_grads.items())
    print(f"GRPO 2 ranks vs 1 process, first step, largest relative differences: {worst}")
    assert max(worst.values()) <= bound, worst
    later = {s: abs(_logged(two)[s]["loss"] - e["loss"]) for s, e in _logged(one).items() if s > 1}
    print(f"later steps' absolute loss differences (after Adam steps on both sides): {later}")
    # rewards depend on the fixed rollouts only: every step sees the same ones on both sides
    assert {s: e["reward"] for s, e in _logged(two).items()} == {s: e["reward"] for s, e in _logged(one).items()}


@pytest.mark.slow
def test_grpo_loss_and_gradients_on_two_ranks_equal_one_process(fixed_runs):
    assert read_json(fixed_runs["two"] / "fsdp_layout.json")["world_size"] == 2
    _compare_first_step(
        fixed_runs["two"], fixed_runs["one"], fixed_runs["two_grads"], fixed_runs["one_grads"], bound=1e-5
    )


@pytest.mark.slow
def test_grpo_under_fsdp1_equals_one_process(fixed_runs, tmp_path, sft_start):
    """FSDP1 (once refused): the head stays in the root unit, where TRL's fused head reads it; rollouts are TRL's
    own FSDP1 path (the root gathered around generate)."""
    start = ["--adapter_name_or_path", str(sft_start), "--per_device_train_batch_size", "16"]
    fsdp1 = REPO / "configs" / "accelerate" / "cpu_fsdp1.yaml"
    grads = _launch_fixed(tmp_path, *COMMON, *FIXED, *start, accelerate_config=fsdp1)
    units = read_json(tmp_path / "fsdp_layout.json")["units"]
    assert any(".lora_A." in u for u in units) and not [u for u in units if u.endswith("lm_head")]  # FSDP1's units
    _compare_first_step(tmp_path, fixed_runs["one"], grads, fixed_runs["one_grads"], bound=1e-5)


@pytest.mark.slow
def test_qlora_grpo_on_two_ranks_equals_one_unsharded_process(tmp_path_factory, sft_start):
    """QLoRA (nf4, bf16 storage and compute), 2 ranks x 16 against one process without FSDP holding the same
    32 completions as 2 accumulated micro-batches of 16 (bf16 results move with the micro-batch size itself)."""
    start = ["--adapter_name_or_path", str(sft_start), *QLORA]
    two, one = tmp_path_factory.mktemp("qlora_two"), tmp_path_factory.mktemp("qlora_one")
    two_grads = _launch_fixed(two, *COMMON, *FIXED, *start, "--per_device_train_batch_size", "16")
    grads = one / "grads.pt"
    unsharded = run_launch(
        [sys.executable, str(FIXED_ROLLOUTS), "--grads_out", str(grads), "--output_dir", str(one), *COMMON, *FIXED]
        + [*start, "--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "2"],
    )
    assert unsharded.returncode == 0, unsharded.stderr[-3000:]
    # TRL logs the KL of accumulated micro-batches as the mean of their means (2 ranks: the mean over all tokens),
    # so the one-process KL figure is another statistic; the loss, normalized by the global token count, is not.
    _compare_first_step(two, one, two_grads, torch.load(grads), bound=1e-4, metrics=("loss",))
    layout = read_json(two / "fsdp_layout.json")
    assert {p["dtype"] for p in layout["parameters"] if ".lora_" in p["name"]} == {"float32"}  # not TRL's bf16


@pytest.fixture(scope="module")
def sampled_runs(tmp_path_factory, sft_start):
    """Real sampling on 2 ranks: the recipe (checkpoint at step 2, harness tasks every 2 steps), TRL's own
    per-layer generation path (``generate_gather_budget: none``) on the same run, and a resume from the checkpoint.
    The decode step compiled (``generate_compiled: true``) where the units are kept gathered: the recipe's runs, not
    TRL's path, which decodes eagerly."""
    common = [*COMMON, "--adapter_name_or_path", str(sft_start), "--per_device_train_batch_size", "16", *SAMPLED]
    common += ["--generate_compiled", "true"]
    common[common.index("--max_steps") + 1] = "4"
    gathered, stock = tmp_path_factory.mktemp("gathered"), tmp_path_factory.mktemp("stock")
    harness = ["--eval_tasks", "tiny_reverse_em", "--eval_tasks_steps", "2"]
    printed = launch_recipe(
        "llama_grpo", "--output_dir", str(gathered), *common, "--save_strategy", "steps", "--save_steps", "2", *harness
    )
    launch_recipe("llama_grpo", "--output_dir", str(stock), *common, "--generate_gather_budget", "none")
    resumed = tmp_path_factory.mktemp("resumed")
    shutil.copytree(gathered / "checkpoint-2", resumed / "checkpoint-2")
    launch_recipe(
        "llama_grpo", "--output_dir", str(resumed), *common, "--resume_from_checkpoint", str(resumed / "checkpoint-2")
    )
    printed = printed.stdout + printed.stderr
    return {"gathered": gathered, "stock": stock, "resumed": resumed, "printed": printed}


def _metrics(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if not k.startswith(("step_time", "epoch")) and "timing" not in k}


@pytest.mark.slow
def test_rollouts_from_the_gathered_model_are_the_ones_trl_samples(sampled_runs):
    """Same seed, same generator state: the recipe's rollouts (units gathered once per call, the decode step
    compiled) and TRL's (a gather per layer per token, eager) give the same completions, hence the same rewards,
    losses and everything logged. The recipe's run also evaluated harness tasks after step 2 (the harness seeds every
    generator): steps 3 and 4 still sample what the run without it samples."""
    got, want = _logged(sampled_runs["gathered"]), _logged(sampled_runs["stock"])
    assert "compiled decode step:" in sampled_runs["printed"]  # the recipe's rollouts compiled, TRL's path eager
    assert sorted(got) == [1, 2, 3, 4]
    assert {s: _metrics(e) for s, e in got.items()} == {s: _metrics(e) for s, e in want.items()}
    assert len({e["reward"] for e in got.values()}) > 1  # the policy moved: rewards are not one constant


@pytest.mark.slow
def test_a_grpo_run_prints_no_future_or_deprecation_warning(sampled_runs):
    """TRL reads transformers' deprecated ``is_gradient_checkpointing`` around every rollout batch; the recipe's
    trainer silences that one warning (`fsdp_peft.core._compat.trl_patches.trl_without_the_checkpointing_warning`)."""
    warned = [line for line in sampled_runs["printed"].splitlines() if "Warning" in line and "deprecat" in line.lower()]
    assert "FutureWarning" not in sampled_runs["printed"] and "DeprecationWarning" not in sampled_runs["printed"], (
        warned
    )


@pytest.mark.slow
def test_harness_tasks_every_two_steps_of_grpo_and_at_the_end(sampled_runs):
    results = read_json(sampled_runs["gathered"] / "results.json")
    during = results["eval_tasks_during"]
    assert [entry["step"] for entry in during] == [2, 4] and set(during[0]) == {"step", "tiny_reverse_em"}
    assert results["eval_tasks"]["tiny_reverse_em"] == {"samples": 200, **during[1]["tiny_reverse_em"]}  # step 4's
    assert (sampled_runs["gathered"] / "eval" / "step-2" / "eval.json").is_file()


@pytest.mark.slow
def test_resume_repeats_the_uninterrupted_rollouts_and_losses_exactly(sampled_runs):
    got, want = _logged(sampled_runs["resumed"]), _logged(sampled_runs["gathered"])
    assert sorted(got) == [1, 2, 3, 4]  # 1 and 2 from the checkpoint's trainer state, 3 and 4 trained again
    assert {s: _metrics(got[s]) for s in got} == {s: _metrics(want[s]) for s in got}


@pytest.mark.slow
def test_results_report_held_out_exact_match_and_rewards_before_and_after(sampled_runs):
    results = read_json(sampled_runs["gathered"] / "results.json")
    for moment in ("held_out_before", "held_out_after"):
        held_out = results[moment]
        assert held_out["prompts"] == 8 and 0.0 <= held_out["exact_match"] <= 1.0
        assert list(held_out["rewards"]) == SAMPLED[1:]  # as the YAML names them
    samples = (sampled_runs["gathered"] / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 8 and {"prompt", "expected", "generated", "exact"} <= set(json.loads(samples[0]))
    assert (sampled_runs["gathered"] / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_grpo_holds_no_second_copy_per_rank_bytes_equal_sft(sampled_runs, sft_start):
    """beta > 0: the reference is the adapter-disabled policy; parameters, gradients and optimizer state per rank
    are those of the SFT run of the same model and adapter."""
    grpo, sft = read_json(sampled_runs["gathered"] / "memory.json"), read_json(sft_start.parent / "memory.json")
    keys = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "parameter_gradient_optimizer_bytes")
    for grpo_rank, sft_rank in zip(grpo["ranks"], sft["ranks"], strict=True):
        assert {k: grpo_rank[k] for k in keys} == {k: sft_rank[k] for k in keys}
    layout = read_json(sampled_runs["gathered"] / "fsdp_layout.json")
    assert not [p for p in layout["parameters"] if ".ref." in p["name"]]  # TRL's "ref" adapter was removed


@pytest.mark.slow
def test_generate_and_export_work_on_grpo_output(sampled_runs, tmp_path):
    run = sampled_runs["gathered"]
    command = [sys.executable, "-m", "fsdp_peft.cli"]
    generated = run_launch(
        [*command, "generate", str(run / "adapter"), "--prompt", "reverse: abcde", "--max-new-tokens", "4", "--json"]
    )
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert json.loads(generated.stdout.strip().splitlines()[-1])["prompt"] == "reverse: abcde"
    exported = run_launch(
        [*command, "export", str(run / "checkpoint-2"), "--out", str(tmp_path / "merged"), "--dtype", "fp32"]
    )
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (tmp_path / "merged" / "config.json").is_file()


@pytest.mark.slow
def test_an_adapter_of_another_rank_is_refused_with_one_line_and_output_dir_left_as_found(sft_start, tmp_path):
    out = tmp_path / "out"
    result = run_command(
        [sys.executable, str(REPO / "recipes" / "llama_grpo.py"), "--output_dir", str(out)]
        + ["--adapter_name_or_path", str(sft_start), "--lora_r", "8", "--max_steps", "1"]
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: adapter_name_or_path: {sft_start} was trained with lora_r 32, this recipe has 8; set lora_r: 32 to "
        "continue from it"
    ]
    assert not out.exists() or not any(out.iterdir())


def test_plan_counts_the_rollouts_kv_cache_and_prompt_plus_completion_tokens():
    from fsdp_peft.procedures.registry import plan_config
    from fsdp_peft.tools.plan import ROLLOUT_ROW, load_model_config

    config = REPO / "configs" / "llama_grpo" / "tiny.yaml"
    plan = plan_config(config, 2, 80 * 2**30)
    model = load_model_config("tiny-llama")
    head_size = model.hidden_size // model.num_attention_heads
    per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * head_size * 4  # fp32 keys and values
    assert plan.tokens_per_rank == 32 * (64 + 8)  # per_device_train_batch_size x (max_seq_length + completion)
    others = plan.gpu["base weights (shard)"]  # 2 ranks: the other rank's shard, gathered for generate
    assert plan.gpu[ROLLOUT_ROW] == 32 * (64 + 8) * per_token + others
    assert any(note.startswith("GRPO: each rank samples 32 completions per generate call") for note in plan.notes)


def test_a_prompt_longer_than_max_seq_length_is_refused_with_its_row_or_skipped(tmp_path):
    from fsdp_peft.core.errors import ConfigError
    from fsdp_peft.data.sources import Source
    from fsdp_peft.model.modeling import load_tokenizer
    from fsdp_peft.procedures.rl import read_prompts
    from fsdp_peft.settings.config import RecipeArguments

    rows = [{"prompt": "reverse: abcde", "completion": "edcba"}, {"prompt": "reverse: " + "a" * 40, "completion": "a"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    path = Source(files=(tmp_path / "train.jsonl",))
    recipe = RecipeArguments(model_name_or_path="tiny-llama", max_seq_length=30, use_chat_template=False)
    tokenizer = load_tokenizer(recipe)
    with pytest.raises(ConfigError, match=r"row 2: its prompt has 49 tokens, above max_seq_length 30 \(1 such rows\)"):
        read_prompts(path, tokenizer, recipe)
    kept, examples = read_prompts(path, tokenizer, RecipeArguments(**{**vars(recipe), "skip_invalid_rows": True}))
    assert [row["answer"] for row in kept] == ["edcba"] and len(examples) == 1


@pytest.mark.slow
def test_the_gsm8k_config_trains_two_steps_with_the_tiny_qwen_on_gsm8k_shaped_rows(tmp_path):
    """The real config as shipped (QLoRA, rewards, rollout cycle, dataset_columns), with the tiny model and local
    rows in GSM8K's columns instead of the download; short lengths so that it runs here."""
    rows = [
        {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
        for a in range(8)
        for b in range(4)
    ]
    for name, part in (("train.jsonl", rows[:24]), ("eval.jsonl", rows[24:])):
        (tmp_path / name).write_text("".join(json.dumps(row) + "\n" for row in part))
    out = tmp_path / "out"
    launch_recipe(
        "qwen_grpo",
        "--config",
        str(REPO / "configs" / "qwen_grpo" / "qwen2_5_7b_gsm8k_qlora.yaml"),
        "--model_name_or_path",
        "tiny-qwen2",
        "--train_file",
        str(tmp_path / "train.jsonl"),
        "--eval_file",
        str(tmp_path / "eval.jsonl"),
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--max_seq_length",
        "64",
        "--max_completion_length",
        "8",
        "--generate_samples",
        "4",
        "--save_strategy",
        "no",
        "--logging_steps",
        "1",
        "--eval_tasks",
        "tiny_reverse_em",  # the config's gsm8k is on the hub: the shipped task stands in, at the end of GRPO
    )
    results = read_json(out / "results.json")
    assert results["steps"] == 2 and list(results["held_out_after"]["rewards"]) == ["math_answer", "math_format"]
    assert results["eval_tasks"]["tiny_reverse_em"]["samples"] == 200 and Path(results["eval_tasks_results"]).is_file()
    logged = _logged(out)
    assert sorted(logged) == [1, 2] and "rewards/math_answer/mean" in logged[1]
    layout = read_json(out / "fsdp_layout.json")
    assert {p["dtype"] for p in layout["parameters"] if ".lora_" in p["name"]} == {"float32"}


def _qlora_grpo_plan(tmp_path, memory: int, *arguments: str):
    """The plan of the tiny GRPO recipe as QLoRA (bf16) on one GPU of ``memory`` bytes, ``arguments`` overriding."""
    from fsdp_peft.procedures.rl import GRPO_PROCEDURE
    from fsdp_peft.settings.config import resolve_recipe_config
    from fsdp_peft.tools.plan import plan_recipe

    config = REPO / "configs" / "llama_grpo" / "tiny.yaml"
    argv = ["--config", str(config), *QLORA, *arguments]
    recipe, training, _ = resolve_recipe_config(argv, config, str(tmp_path))
    return plan_recipe(GRPO_PROCEDURE.with_defaults(recipe), training, GRPO_PROCEDURE, "tiny", 1, memory)


def _four_bit_linear_bytes() -> int:
    """bf16 bytes of every decoder-layer linear weight of the tiny Llama, from its config (what QLoRA stores 4-bit)."""
    from fsdp_peft.tools.plan import load_model_config

    c = load_model_config("tiny-llama")
    head = c.hidden_size // c.num_attention_heads
    attention = 2 * c.hidden_size * c.num_attention_heads * head + 2 * c.hidden_size * c.num_key_value_heads * head
    return c.num_hidden_layers * (attention + 3 * c.hidden_size * c.intermediate_size) * 2


def test_the_rollouts_dequantized_copies_row_is_what_a_generate_call_dequantizes(tmp_path):
    """The plan's row against the copies `four_bit_dequantized` makes of the tiny Llama loaded in 4 bits (real
    bitsandbytes layers, LoRA attached), and against the linear weights counted from its config."""
    from transformers import TrainingArguments

    from fsdp_peft.model.modeling import attach_lora, load_base_model
    from fsdp_peft.procedures.rl import GRPO_PROCEDURE
    from fsdp_peft.settings.config import resolve_recipe_config
    from fsdp_peft.tools.generation import four_bit_dequantized
    from fsdp_peft.tools.plan import DEQUANTIZED_ROW, plan_recipe

    config = REPO / "configs" / "llama_grpo" / "tiny.yaml"
    recipe, training, _ = resolve_recipe_config(["--config", str(config), *QLORA], config, "unused")
    planned = plan_recipe(GRPO_PROCEDURE.with_defaults(recipe), training, GRPO_PROCEDURE, "tiny", 1, 80 * 2**30)
    arguments = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    model = attach_lora(load_base_model(recipe), recipe, arguments).train()  # train(): no CPU repacking
    with four_bit_dequantized(model, None) as made:
        dense = sum(m.weight.nbytes for m in model.modules() if type(m).__name__ == "DequantizedLinear")
    assert planned.gpu[DEQUANTIZED_ROW] == made == dense == _four_bit_linear_bytes()


def test_the_plan_counts_qlora_rollouts_dequantized_copies_and_keeps_4_bit_where_they_do_not_fit(tmp_path):
    """generate_compiled: auto: the 16-bit copies of the 4-bit layers (the compiled decode step's) are a row of their
    own where the total with them is within 90% of the GPU, else left out and the layers kept 4-bit; true plans them
    always, false never; switching the copies off is offered as a saving."""
    from fsdp_peft.tools.plan import DEQUANTIZED_ROW, rollouts_line

    fixed = ("--activation_checkpointing", "false")
    large = _qlora_grpo_plan(tmp_path, 80 * 2**30, *fixed)
    assert large.gpu[DEQUANTIZED_ROW] == _four_bit_linear_bytes() and large.rollouts_dequantized
    assert list(large.gpu)[-2:] == [DEQUANTIZED_ROW, "CUDA context and slack (est.)"]
    assert rollouts_line(large).startswith("4-bit layers in rollouts: dequantized for each generate call (auto: ")
    without = large.gpu_total - large.gpu[DEQUANTIZED_ROW]
    between = int((without + large.gpu[DEQUANTIZED_ROW] / 2) / 0.9)  # the total fits without the copies, not with
    tight = _qlora_grpo_plan(tmp_path, between, *fixed)
    assert DEQUANTIZED_ROW not in tight.gpu and tight.rollouts_dequantized is False and tight.gpu_total == without
    assert "kept (an eager decode step) (auto: with their dequantized copies" in rollouts_line(tight)
    forced = _qlora_grpo_plan(tmp_path, between, *fixed, "--generate_compiled", "true")
    assert forced.gpu[DEQUANTIZED_ROW] == large.gpu[DEQUANTIZED_ROW]
    assert forced.rollouts_reason == "generate_compiled: true"
    assert any(s["switch"].startswith("generate_compiled: false") for s in forced.suggestions)
    for none in (
        _qlora_grpo_plan(tmp_path, between, *fixed, "--generate_compiled", "false"),
        _qlora_grpo_plan(tmp_path, between, *fixed, "--generate_gather_budget", "none"),  # nothing gathered
        _qlora_grpo_plan(tmp_path, between, *fixed, "--bnb_4bit_compute_dtype", "float16"),  # a layer that casts
        _qlora_grpo_plan(tmp_path, between, *fixed, "--load_in_4bit", "false"),  # LoRA: nothing to dequantize
    ):
        assert DEQUANTIZED_ROW not in none.gpu and none.rollouts_dequantized is None and rollouts_line(none) is None
        assert not any(s["switch"].startswith("generate_compiled") for s in none.suggestions)


def test_under_auto_checkpointing_the_copies_are_chosen_after_the_layers_and_true_checkpoints_for_them(tmp_path):
    """Both auto: checkpointing is chosen as without the copies (rollouts and activations do not overlap: no layer
    recomputed for the copies' sake), then the copies kept where the total fits; generate_compiled: true counts them
    while choosing, so more layers are checkpointed. GPUs sized from the plan's own peaks per choice."""
    from fsdp_peft.tools.plan import DEQUANTIZED_ROW

    eager_large = _qlora_grpo_plan(tmp_path, 80 * 2**30, "--generate_compiled", "false")
    peaks = [choice["peak"] for choice in eager_large.checkpointing_choices]  # fewest layers first, none first
    copies = _qlora_grpo_plan(tmp_path, 80 * 2**30).gpu[DEQUANTIZED_ROW]
    memory = math.ceil((peaks[0] + copies // 2) / 0.9)  # none checkpointed fits, but not with the copies
    plan = _qlora_grpo_plan(tmp_path, memory)
    eager = _qlora_grpo_plan(tmp_path, memory, "--generate_compiled", "false")
    forced = _qlora_grpo_plan(tmp_path, memory, "--generate_compiled", "true")
    assert plan.rollouts_dequantized is False and plan.gpu == eager.gpu
    assert plan.checkpointing == eager.checkpointing and eager.checkpointing.count == 0
    assert forced.gpu[DEQUANTIZED_ROW] == copies and forced.checkpointing.count > 0 and forced.gpu_peak <= 0.9 * memory
    roomy = math.ceil((peaks[0] + copies) / 0.9) + 1
    plan = _qlora_grpo_plan(tmp_path, roomy)
    assert plan.rollouts_dequantized and plan.checkpointing.count == 0 and plan.gpu[DEQUANTIZED_ROW] == copies


def test_a_qlora_run_on_a_gpu_makes_generate_compiled_auto_false_where_the_plan_keeps_4_bit(tmp_path, monkeypatch):
    """The run side (`fsdp_peft.recipe.parse_run_config`): with device_memory below what the copies need, the resolved
    recipe computes its rollouts through the 4-bit layers (generate_compiled: false) and says why; with room, auto
    stays (the copies made at each call). A GPU is stood in for: on CPU auto compiles nothing, so there is no choice."""
    import fsdp_peft.tools.plan as plan_module
    from fsdp_peft.procedures.rl import GRPO_PROCEDURE
    from fsdp_peft.recipe import parse_run_config

    monkeypatch.setattr(plan_module, "_on_gpu", lambda: True)
    fixed = ("--activation_checkpointing", "false")
    large = _qlora_grpo_plan(tmp_path, 80 * 2**30, *fixed)
    between = int((large.gpu_total - large.gpu[plan_module.DEQUANTIZED_ROW] / 2) / 0.9)
    config = REPO / "configs" / "llama_grpo" / "tiny.yaml"
    for memory, compiled in ((between, "false"), (80 * 2**30, "auto")):
        argv = ["--config", str(config), *QLORA, *fixed, "--device_memory", str(memory), "--output_dir", str(tmp_path)]
        recipe, _, _, line = parse_run_config(argv, config, str(tmp_path), GRPO_PROCEDURE)
        assert recipe.generate_compiled == compiled, line
        assert line.startswith("4-bit layers in rollouts: " + ("kept" if compiled == "false" else "dequantized"))
