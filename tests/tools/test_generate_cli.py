"""``fsdp-peft generate`` from every kind of source, against plain transformers + peft on the adapter.

One short LoRA run (100 steps, enough to reverse words; evaluated at steps 50 and 100, each showing
held-out completions) leaves all source kinds: ``adapter/``, the
sharded ``checkpoint-100/``, the fp32 merged export ``merged/``, and the ``output_dir`` itself.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import ACCELERATE_CPU_FSDP2, REPO, free_port, launch_recipe, run_command, run_launch

pytestmark = pytest.mark.slow
PROMPTS = ["reverse: hello", "reverse: world", "reverse: abcde"]
CLI = [sys.executable, "-m", "fsdp_peft.cli", "generate"]
NEW_TOKENS = ["--max-new-tokens", "12"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    output_dir = tmp_path_factory.mktemp("generate_source")
    launch_recipe(
        "llama_lora",
        "--output_dir",
        str(output_dir),
        "--max_steps",
        "100",
        "--warmup_steps",
        "0",
        "--lr_scheduler_type",
        "constant",
        "--save_strategy",
        "steps",
        "--save_steps",
        "100",
        "--generate_samples",
        "0",
        "--generate_eval_samples",
        "2",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "50",
        "--export_merged",
        "true",
        "--export_dtype",
        "fp32",
    )
    return output_dir


def test_each_evaluation_shows_held_out_completions(trained):
    rows = [json.loads(line) for line in (trained / "eval_samples.jsonl").read_text().splitlines()]
    assert sorted({row["step"] for row in rows}) == [50, 100]
    assert all(row["prompt"].startswith("reverse: ") and row["expected"] for row in rows)
    assert len([row for row in rows if row["step"] == 50]) == 2
    last = [row for row in rows if row["step"] == 100]
    assert sum(row["generated"] == row["expected"] for row in last) >= 1


@pytest.fixture(scope="module")
def reference(trained, tiny_model_dir) -> list[str]:
    """Greedy completions by plain transformers + peft: the adapter on the fp32 base, one prompt at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), trained / "adapter")
    completions = []
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        completions.append(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    reversed_words = [prompt.split()[-1][::-1] for prompt in PROMPTS]
    assert sum(c == r for c, r in zip(completions, reversed_words)) >= 2  # learned: outputs worth comparing
    return completions


def _json_completions(result) -> list[str]:
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    rows = [row for row in rows if "timing" not in row]
    assert [row["prompt"] for row in rows] == PROMPTS
    return [row["completion"] for row in rows]


def test_adapter_directory_with_prompts_as_arguments(trained, reference):
    result = run_command([*CLI, str(trained / "adapter"), "--prompt", *PROMPTS, *NEW_TOKENS, "--json"])
    assert _json_completions(result) == reference
    assert f"generating from adapter {trained / 'adapter'} on " in result.stderr
    assert "Loading weights" not in result.stderr  # transformers' bar, drawn over the command's own lines


def test_merged_model_directory_with_a_prompts_file(trained, reference, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n\n")
    timed = ["--json", "--timed-calls", "2"]
    result = run_command([*CLI, str(trained / "merged"), "--prompts-file", str(prompts), *NEW_TOKENS, *timed])
    assert _json_completions(result) == reference
    assert f"generating from merged model {trained / 'merged'}" in result.stderr
    # --timed-calls: two more calls of the 3 prompts, 12 tokens each, timed after the first (eager on CPU: no graph)
    timing = json.loads(result.stdout.splitlines()[-1])["timing"]
    assert {k: timing[k] for k in ("prompts", "new_tokens", "calls", "graphs_compiled")} == {
        "prompts": 3,
        "new_tokens": 12,
        "calls": 2,
        "graphs_compiled": 0,
    }
    assert timing["tokens_per_second"] * timing["seconds_per_call"] == pytest.approx(36)
    assert timing["first_call_seconds"] > 0


def test_training_output_dir_with_prompts_on_stdin(trained, reference):
    result = subprocess.run(
        [*CLI, str(trained), *NEW_TOKENS, "--greedy"],
        input="\n".join(PROMPTS),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected = "".join(f">>> {prompt}\n{completion}\n\n" for prompt, completion in zip(PROMPTS, reference))
    assert result.stdout == expected


def test_sharded_checkpoint_under_accelerate_launch(trained, reference, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ACCELERATE_CPU_FSDP2),
        "--main_process_port",
        str(free_port()),
        "-m",
        "fsdp_peft.cli",
        "generate",
        str(trained / "checkpoint-100"),
        "--prompts-file",
        str(prompts),
        *NEW_TOKENS,
        "--json",
    ]
    result = run_command(command)
    assert _json_completions(result) == reference
    assert "sharded over 2 ranks" in result.stderr


def test_single_prompt_is_streamed_and_sampling_is_seeded(trained, reference):
    streamed = run_launch([*CLI, str(trained / "adapter"), "--prompt", PROMPTS[0], *NEW_TOKENS])
    assert streamed.returncode == 0 and streamed.stdout == reference[0] + "\n"
    sampled = [
        run_command(
            [
                *CLI,
                str(trained / "adapter"),
                "--prompt",
                *PROMPTS,
                *NEW_TOKENS,
                "--json",
                "--temperature",
                "1.5",
                "--top-p",
                "0.95",
                "--seed",
                "3",
            ]
        )
        for _ in range(2)
    ]
    assert _json_completions(sampled[0]) == _json_completions(sampled[1])


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["{tmp}"], "SOURCE: {tmp} is none of: a merged model directory (config.json + *.safetensors), an adapter"),
        (["{tmp}/missing"], "SOURCE: {tmp}/missing does not exist"),
        (["{tmp}", "--prompts-file", "{tmp}/none.txt"], "--prompts-file: file not found: {tmp}/none.txt"),
        (["{tmp}", "--greedy", "--temperature", "0.7"], "--greedy and --temperature/--top-p exclude each other"),
        (["{tmp}", "--timed-calls", "-1"], "--timed-calls: -1 is negative; give 0 (no timing) or more calls"),
    ],
)
def test_bad_sources_and_options_are_clear_errors(tmp_path, arguments, message):
    (tmp_path / "notes.txt").write_text("not a model")
    arguments = [a.format(tmp=tmp_path) for a in arguments]
    result = run_command(
        [*CLI, *arguments, "--prompt", "x"] if "--prompts-file" not in arguments else [*CLI, *arguments]
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {message.format(tmp=tmp_path)}"), result.stderr[-2000:]
