"""Preference tuning (DPO): data rules, and real 2-rank runs of recipes/llama_dpo.py through TRL's DPOTrainer.

One FSDP2 run of 5 steps (checkpoint at step 3) serves several checks: equivalence with one process of
the same global batch, reference log-probs against a plain unsharded base, resume, memory.json against
SFT's, and the downstream commands on its output.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from conftest import REPO, launch_recipe, logged_losses, read_json, run_launch
from fsdp_peft import cli
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.data.preference import load_preference_data, read_preference_source
from fsdp_peft.data.sources import Source
from fsdp_peft.settings.config import RecipeArguments, read_yaml_config

STEPS = 5
COMMON = [
    "--max_steps",
    str(STEPS),
    "--logging_steps",
    "1",
    "--lr_scheduler_type",
    "constant",
    "--warmup_steps",
    "0",
    "--generate_samples",
    "8",
    "--generate_max_new_tokens",
    "4",
    "--disable_tqdm",
    "true",
]
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from fsdp_peft.model.modeling import load_tokenizer

    return load_tokenizer(RecipeArguments(model_name_or_path=str(tiny_model_dir)))


def _write(tmp_path, rows, name="train.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_pairs_as_strings_and_chats_reach_trl_as_the_prompt_and_answers_the_model_sees(tmp_path, tokenizer):
    chat = [{"role": "user", "content": "reverse: abc"}]
    rows = [
        {"prompt": "reverse: abc", "chosen": "cba", "rejected": "abc"},
        {
            "chosen": [*chat, {"role": "assistant", "content": "cba"}],
            "rejected": [*chat, {"role": "assistant", "content": "abc"}],
        },
        {
            "prompt": chat,
            "chosen": [{"role": "assistant", "content": "cba"}],
            "rejected": [{"role": "assistant", "content": "abc"}],
        },
    ]
    data, examples, dropped = read_preference_source(Source((_write(tmp_path, rows),)), tokenizer, RecipeArguments())
    want = {
        "prompt": "<|begin_of_text|><|user|>reverse: abc<|end|><|assistant|>",
        "chosen": "cba<|end|>",
        "rejected": "abc<|end|>",
    }
    assert [dict(row) for row in data] == [want] * 3 and not dropped
    assert [(e.prompt, e.chosen, e.rejected) for e in examples] == [("reverse: abc", "cba", "abc")] * 3


def test_kto_rows_are_sft_rows_with_a_label(tmp_path, tokenizer):
    rows = [
        {"prompt": "reverse: abc", "completion": "cba", "label": True},
        {"prompt": "x", "completion": "y", "label": "no"},
    ]
    recipe = RecipeArguments()
    with pytest.raises(ConfigError, match=r"row 2: 'label' must be true or false, got str; fix the row or set skip"):
        read_preference_source(Source((_write(tmp_path, rows),)), tokenizer, recipe, unpaired=True)
    data, _, dropped = read_preference_source(Source((_write(tmp_path, rows[:1]),)), tokenizer, recipe, unpaired=True)
    assert dict(data[0]) == {
        "prompt": "<|begin_of_text|><|user|>reverse: abc<|end|><|assistant|>",
        "completion": "cba<|end|>",
        "label": True,
    }


USER, ANSWER = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
BAD_ROWS = {
    "missing rejected": ({"prompt": "p", "chosen": "a"}, "row 1: missing field 'rejected'; fix the row"),
    "identical": ({"prompt": "p", "chosen": "a", "rejected": "a"}, "row 1: 'chosen' and 'rejected' are identical"),
    "empty": ({"prompt": "p", "chosen": "", "rejected": "b"}, "row 1: empty 'chosen' leaves nothing to compare"),
    "roles out of order": (
        {"chosen": [ANSWER, USER, ANSWER], "rejected": [USER, {"role": "assistant", "content": "b"}]},
        "row 1: 'chosen' has roles ['assistant', 'user', 'assistant'] out of order",
    ),
    "empty turn": (
        {"chosen": [USER, {"role": "assistant", "content": " "}], "rejected": [USER, ANSWER]},
        "row 1: 'chosen'[1] (assistant) has empty content",  # the SFT data's own message
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_preference_rows_fail_like_sft_rows_or_are_skipped_and_counted(case, tmp_path, tokenizer):
    row, message = BAD_ROWS[case]
    path = _write(tmp_path, [row])
    with pytest.raises(ConfigError) as error:
        read_preference_source(Source((path,)), tokenizer, RecipeArguments())
    assert str(error.value).startswith(f"{path}: {message}") and str(error.value).endswith(
        "or set skip_invalid_rows: true"
    )
    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    _write(tmp_path, [row, good])
    data, _, dropped = read_preference_source(Source((path,)), tokenizer, RecipeArguments(skip_invalid_rows=True))
    assert len(data) == 1 and sum(dropped.values()) == 1


def test_a_hub_preference_dataset_is_read_by_its_name_and_splits(monkeypatch, tokenizer):
    """The hub is out of reach here: ``datasets.load_dataset`` answers with UltraFeedback-shaped rows."""
    chat = [{"role": "user", "content": "q"}]
    rows = [{"prompt": "q", "chosen": [*chat, ANSWER], "rejected": [*chat, {"role": "assistant", "content": "b"}]}]
    asked = []

    def load_dataset(name, config, split):
        asked.append((name, config, split))
        return Dataset.from_list(rows * 3)

    monkeypatch.setattr("fsdp_peft.data.sources.datasets.load_dataset", load_dataset)
    recipe = RecipeArguments(
        dataset="HuggingFaceH4/ultrafeedback_binarized",
        dataset_train_split="train_prefs",
        dataset_eval_split="test_prefs",
    )
    train, held_out, examples = load_preference_data(recipe, tokenizer)
    assert asked == [(recipe.dataset, None, "train_prefs"), (recipe.dataset, None, "test_prefs")]
    assert len(train) == len(held_out) == len(examples) == 3 and train[0]["rejected"] == "b<|end|>"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """The 2-rank FSDP2 run (checkpoint at 3, harness tasks at the end), one process with the same global batch, a
    resume from step 3 with precomputed reference log-probs, and SFT's first step on the same model and adapter."""
    two = tmp_path_factory.mktemp("dpo_two_ranks")
    checkpoint = ["--save_strategy", "steps", "--save_steps", "3"]
    launch_recipe("llama_dpo", "--output_dir", str(two), *COMMON, *checkpoint, "--eval_tasks", "tiny_reverse_em")
    one = tmp_path_factory.mktemp("dpo_one_process")
    launch_recipe("llama_dpo", "--output_dir", str(one), *COMMON, "--per_device_train_batch_size", "32", processes=1)
    resumed = tmp_path_factory.mktemp("dpo_resumed")
    shutil.copytree(two / "checkpoint-3", resumed / "checkpoint-3")
    resume = ["--resume_from_checkpoint", str(resumed / "checkpoint-3")]
    # with the reference log-probs precomputed: the resumed steps must also equal those of the on-the-fly reference
    printed = launch_recipe(
        "llama_dpo", "--output_dir", str(resumed), *COMMON, *resume, "--precompute_ref_log_probs", "true"
    )
    sft = tmp_path_factory.mktemp("sft")
    launch_recipe("llama_lora", "--output_dir", str(sft), "--max_steps", "1", "--generate_samples", "0")
    printed = printed.stdout + printed.stderr  # a resumed run that precomputes its reference log-probs
    return {"two": two, "one": one, "resumed": resumed, "sft": sft, "model": tiny_model_dir, "printed": printed}


def _logged(output_dir, key):
    history = read_json(output_dir / "trainer_state.json")["log_history"]
    return {e["step"]: e[key] for e in history if key in e}


def _assert_rewards_as_close_as_their_log_probs(got_dir, want_dir, bound: float) -> None:
    """A reward is beta x (policy - reference log-prob), a difference of two nearly equal log-probs (about -33), and
    the margin a difference of two rewards: relative to themselves they magnify the log-probs' rounding, so each is
    held to what its log-probs, equal within ``bound`` of themselves, guarantee (2 of them per reward, 4 per margin)."""
    beta = read_yaml_config(REPO / "configs" / "llama_dpo" / "tiny.yaml")["beta"]
    chosen, rejected = _logged(want_dir, "logps/chosen"), _logged(want_dir, "logps/rejected")
    for key, terms in (("rewards/chosen", 2), ("rewards/rejected", 2), ("rewards/margins", 4)):
        got, want = _logged(got_dir, key), _logged(want_dir, key)
        for step in want:
            largest = max(abs(chosen[step]), abs(rejected[step]))
            assert abs(got[step] - want[step]) <= terms * beta * bound * largest, (key, step)


@pytest.mark.slow
def test_dpo_on_two_ranks_matches_one_process_with_the_same_global_batch(runs):
    assert read_json(runs["two"] / "fsdp_layout.json")["world_size"] == 2
    worst = {}
    for key in METRICS:
        got, want = _logged(runs["two"], key), _logged(runs["one"], key)
        assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), key
        worst[key] = max(abs(got[step] - value) / abs(value) for step, value in want.items() if value)
    print(f"DPO FSDP2 2 ranks vs 1 process, {STEPS} steps, largest relative differences: {worst}")
    assert max(worst[k] for k in ("loss", "logps/chosen", "logps/rejected")) <= 1e-5, worst
    _assert_rewards_as_close_as_their_log_probs(runs["two"], runs["one"], 1e-5)
    assert _logged(runs["two"], "rewards/accuracies") == _logged(runs["one"], "rewards/accuracies")


@pytest.mark.slow
def test_qlora_dpo_on_two_ranks_matches_one_process_and_keeps_fp32_adapters(tmp_path_factory, tiny_model_dir):
    """QLoRA (nf4, bf16 storage and compute) with gradient accumulation: 2 ranks x 8 pairs x 2 micro-steps vs one
    unsharded process (no launcher, no FSDP) accumulating the same 4 micro-batches of 8. The reference keeps the
    micro-batch size: in bf16 the batch split itself moves the result (one process, 1 x 32 against 2 x 16: 4.7e-4
    relative on the loss, 2.8e-4 on the log-probs, measured 2026-12-01), independently of sharding. Accumulation
    under FSDP2 was refused until
    `fsdp_peft.core._compat.torch_patches.fsdp2_accumulation_skips_ungathered_parameters`."""
    qlora = ["--load_in_4bit", "true", "--bf16", "true", "--torch_dtype", "bfloat16", "--generate_samples", "0"]
    qlora += ["--per_device_train_batch_size", "8"]
    two, one = tmp_path_factory.mktemp("qlora_two"), tmp_path_factory.mktemp("qlora_one")
    launch_recipe("llama_dpo", "--output_dir", str(two), *COMMON, *qlora, "--gradient_accumulation_steps", "2")
    unsharded = run_launch(
        [sys.executable, str(REPO / "recipes" / "llama_dpo.py"), "--output_dir", str(one), *COMMON, *qlora]
        + ["--gradient_accumulation_steps", "4"],
        timeout=600,
    )
    assert unsharded.returncode == 0, unsharded.stderr[-3000:]
    worst = {}
    for key in METRICS:
        got, want = _logged(two, key), _logged(one, key)
        assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), key
        worst[key] = max(abs(got[step] - value) / abs(value) for step, value in want.items() if value)
    print(f"QLoRA DPO FSDP2 2 ranks vs 1 process, {STEPS} steps, largest relative differences: {worst}")
    assert max(v for k, v in worst.items() if k != "rewards/margins") <= 1e-4, worst
    chosen, rejected = _logged(one, "rewards/chosen"), _logged(one, "rewards/rejected")
    got, want = _logged(two, "rewards/margins"), _logged(one, "rewards/margins")
    for step in want:  # a difference of two nearly equal rewards: measured against them, as in the fp32 test
        assert abs(got[step] - want[step]) <= 1e-4 * max(abs(chosen[step]), abs(rejected[step])), step
    layout = read_json(two / "fsdp_layout.json")
    assert {p["dtype"] for p in layout["parameters"] if ".lora_" in p["name"]} == {"float32"}  # not TRL's bf16
    assert not [p for p in layout["parameters"] if ".ref." in p["name"]]


@pytest.mark.slow
def test_kto_trains_on_the_pairs_split_into_rated_completions_with_the_same_reference(runs, tmp_path):
    """``loss_type: kto``: TRL's KTOTrainer under the same mixin; each pair gives a desirable and an
    undesirable completion. Its KL estimate pairs completions within a rank's batch, so it is not compared
    with one process; what is checked is that it trains sharded, with the adapter as built and no copy."""
    printed = launch_recipe("llama_dpo", "--output_dir", str(tmp_path), *COMMON, "--loss_type", "kto")
    losses, kl = logged_losses(tmp_path), _logged(tmp_path, "kl")
    for run in (printed.stdout + printed.stderr, runs["printed"]):  # TRL's own FutureWarning silenced (_compat)
        assert "FutureWarning" not in run and "DeprecationWarning" not in run
    assert sorted(losses) == sorted(kl) == list(range(1, STEPS + 1)) and abs(losses[1] - 0.5) < 1e-6  # KTO at init
    assert kl[1] == 0.0 and kl[STEPS] > 0  # policy = reference at the start, then they part
    layout = read_json(tmp_path / "fsdp_layout.json")
    assert layout["world_size"] == 2 and not [p for p in layout["parameters"] if ".ref." in p["name"]]
    kto, dpo = read_json(tmp_path / "memory.json"), read_json(runs["two"] / "memory.json")
    key = "parameter_gradient_optimizer_bytes"
    assert [r[key] for r in kto["ranks"]] == [r[key] for r in dpo["ranks"]]
    assert read_json(tmp_path / "results.json")["loss_name"] == "KTO"


def _plain_log_probs(model_dir, tokenizer_texts):
    """Summed log-probs of each completion after its prompt, by the base model alone (no peft, no FSDP)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sums = []
    for prompt, completion in tokenizer_texts:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        log_probs = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        sums.append(log_probs[len(prompt_ids) - 1 :].sum().item())
    return sums


@pytest.mark.slow
def test_reference_log_probs_are_the_unsharded_base_models_before_after_and_after_resume(runs):
    from fsdp_peft.model.tiny import TINY_PREFERENCE_DIR

    pairs = [json.loads(line) for line in (TINY_PREFERENCE_DIR / "eval.jsonl").read_text().splitlines()[:8]]
    prompt = "<|begin_of_text|><|user|>{}<|end|><|assistant|>"
    texts = [(prompt.format(p["prompt"]), p[key] + "<|end|>") for p in pairs for key in ("chosen", "rejected")]
    want = _plain_log_probs(runs["model"], texts)
    for run, name in (
        (runs["two"], "held_out_before"),
        (runs["two"], "held_out_after"),
        (runs["resumed"], "held_out_after"),
    ):
        rows = [json.loads(line) for line in (run / f"{name}.jsonl").read_text().splitlines()]
        got = [value for row in rows for value in row["reference"]]
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
        print(f"reference log-probs, {run.name} {name}: largest relative difference to the plain base {worst:.1e}")
        assert len(got) == len(want) == 16 and worst <= 1e-5
    before = [json.loads(line) for line in (runs["two"] / "held_out_before.jsonl").read_text().splitlines()]
    assert all(row["policy"] == row["reference"] for row in before)  # a fresh adapter is the reference


@pytest.mark.slow
def test_resume_with_precomputed_reference_repeats_the_uninterrupted_losses(runs):
    want, got = logged_losses(runs["two"]), logged_losses(runs["resumed"])
    assert sorted(got) == list(range(1, STEPS + 1))  # steps 1-3 come with the checkpoint's trainer state
    for step in (4, 5):
        assert abs(got[step] - want[step]) <= 1e-6 * abs(want[step]), (step, got[step], want[step])


@pytest.mark.slow
def test_dpo_holds_no_second_copy_per_rank_bytes_equal_sft(runs):
    dpo, sft = read_json(runs["two"] / "memory.json"), read_json(runs["sft"] / "memory.json")
    keys = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "parameter_gradient_optimizer_bytes")
    for dpo_rank, sft_rank in zip(dpo["ranks"], sft["ranks"]):
        print(
            f"rank {dpo_rank['rank']}: DPO {dpo_rank['parameter_gradient_optimizer_bytes']:,} bytes, SFT "
            f"{sft_rank['parameter_gradient_optimizer_bytes']:,}"
        )
        assert {k: dpo_rank[k] for k in keys} == {k: sft_rank[k] for k in keys}
    layout = read_json(runs["two"] / "fsdp_layout.json")
    assert not [p for p in layout["parameters"] if ".ref." in p["name"]]  # TRL's "ref" adapter was removed
    dtypes = {p["dtype"] for p in layout["parameters"] if ".lora_" in p["name"]}
    assert dtypes == {"float32"}


@pytest.mark.slow
def test_results_report_preference_before_and_after(runs):
    results = read_json(runs["two"] / "results.json")
    before, after = results["preference_before"], results["preference_after"]
    assert before["reward_accuracy"] == 0.5 and before["margin"] == 0.0 and before["pairs"] == 8
    assert after["pairs"] == 8 and after["logp_chosen"] != before["logp_chosen"]
    assert results["generation_before"]["prompts"] == results["generation_after"]["prompts"] == 8
    harness = results["eval_tasks"]["tiny_reverse_em"]  # lm-eval on the DPO-trained model, sharded, at the end
    assert harness["samples"] == 200 and 0 <= harness["exact_match,strip"] <= 1
    assert Path(results["eval_tasks_results"]).is_file()


@pytest.mark.slow
def test_generate_and_export_work_on_dpo_output(runs, tmp_path):
    two = runs["two"]
    command = [sys.executable, "-m", "fsdp_peft.cli"]
    generated = run_launch(
        [*command, "generate", str(two / "adapter"), "--prompt", "reverse: abcde", "--max-new-tokens", "4", "--json"]
    )
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert json.loads(generated.stdout.strip().splitlines()[-1])["prompt"] == "reverse: abcde"
    exported = run_launch(
        [*command, "export", str(two / "checkpoint-3"), "--out", str(tmp_path / "merged"), "--dtype", "fp32"]
    )
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (tmp_path / "merged" / "config.json").is_file()


def test_validate_plan_ls_and_cp_know_the_dpo_recipes(tmp_path, capsys):
    config = REPO / "configs" / "llama_dpo" / "tiny.yaml"
    cli.main(["validate", str(config)])
    assert capsys.readouterr().out.strip() == f"{config}: ok"
    plans = {}
    for name in ("llama_dpo", "llama_lora"):
        cli.main(["plan", str(REPO / "configs" / name / "tiny.yaml"), "--gpus", "2", "--json"])
        plans[name] = json.loads(capsys.readouterr().out)
    assert plans["llama_dpo"]["tokens_per_rank"] == 2 * plans["llama_lora"]["tokens_per_rank"] == 2 * 16 * 64
    assert any("chosen + rejected" in note for note in plans["llama_dpo"]["notes"])
    pgo = "parameter_gradient_optimizer_bytes"
    assert plans["llama_dpo"][pgo] == plans["llama_lora"][pgo]  # no reference copy
    cli.main(["ls"])
    listed = capsys.readouterr().out
    assert "llama_dpo" in listed and "llama_dpo/llama3_1_8b_qlora.yaml" in listed and "qwen_dpo" in listed
    cli.main(["cp", "llama_dpo/tiny", str(tmp_path)])
    assert (tmp_path / "tiny.yaml").read_text().startswith("# DPO with LoRA")


def launched_with_fsdp(monkeypatch, version: int) -> None:
    """The environment ``accelerate launch`` sets for an FSDP accelerate config of this version."""
    for key, value in {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": str(version),
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    }.items():
        monkeypatch.setenv(key, value)


def test_the_preference_config_is_taken_under_fsdp1_and_fsdp2(monkeypatch, tmp_path, capsys):
    from fsdp_peft.procedures.preference import PREFERENCE_PROCEDURE
    from fsdp_peft.recipe import parse_recipe_config

    config = REPO / "configs" / "llama_dpo" / "tiny.yaml"
    for version in (1, 2):
        launched_with_fsdp(monkeypatch, version)
        argv = ["--output_dir", str(tmp_path), "--beta", "0.2"]
        recipe, training = parse_recipe_config(argv, config, str(tmp_path), PREFERENCE_PROCEDURE)
        assert (training.beta, training.loss_type, training.max_length) == (0.2, ["sigmoid"], recipe.max_seq_length)
        accelerate = REPO / "configs" / "accelerate" / f"cpu_fsdp{version}.yaml"
        cli.main(["validate", str(config), "--accelerate-config", str(accelerate)])
        assert capsys.readouterr().out.strip() == f"{config}: ok under {accelerate}"


@pytest.mark.slow
def test_dpo_under_fsdp1_matches_one_process(runs, tmp_path):
    """FSDP1 (once refused): the output head stays in the root unit, gathered for the whole forward, where TRL's
    fused head reads its weight (`fsdp_peft.parallel.fsdp_policies.fsdp1_wrap_policy`, ``head_in_root``)."""
    fsdp1 = REPO / "configs" / "accelerate" / "cpu_fsdp1.yaml"
    launch_recipe("llama_dpo", "--output_dir", str(tmp_path), *COMMON, accelerate_config=fsdp1)
    units = read_json(tmp_path / "fsdp_layout.json")["units"]
    assert not [u for u in units if u.endswith("lm_head")]
    worst = {}
    for key in ("loss", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"):
        got, want = _logged(tmp_path, key), _logged(runs["one"], key)
        assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), key
        worst[key] = max(abs(got[step] - value) / abs(value) for step, value in want.items() if value)
    print(f"DPO FSDP1 2 ranks vs 1 process, {STEPS} steps, largest relative differences: {worst}")
    assert max(worst[k] for k in ("loss", "logps/chosen", "logps/rejected")) <= 1e-5, worst
    _assert_rewards_as_close_as_their_log_probs(tmp_path, runs["one"], 1e-5)


def test_xla_is_refused_before_training_with_one_line(monkeypatch, tmp_path):
    from fsdp_peft.procedures.preference import PREFERENCE_PROCEDURE
    from fsdp_peft.recipe import parse_recipe_config

    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    config = REPO / "configs" / "llama_dpo" / "tiny.yaml"
    with pytest.raises(ConfigError, match=r"^PJRT_DEVICE=TPU: the preference and GRPO recipes do not run on XLA"):
        parse_recipe_config(["--output_dir", str(tmp_path)], config, str(tmp_path), PREFERENCE_PROCEDURE)
