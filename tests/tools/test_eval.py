"""``fsdp-peft eval``: lm-evaluation-harness tasks on a trained adapter, its base, its sharded checkpoint and its
merged export, against the recipe's own held-out figures; the recipe's ``eval_tasks``; bad input refused in one
line before any weights load.

One short LoRA run (90 steps at a constant rate: exact match about 0.4 on the 200 held-out prompts, so neither 0
nor 1), whose YAML names ``eval_tasks`` (the harness at the end of training), leaves every kind of source: the
``output_dir``, ``adapter/``, the sharded ``checkpoint-90/`` and the fp32 ``merged/`` export. Each evaluation below
is one real harness run, shared by the tests that read it: the base's and the refusals run in this process
(`fsdp_peft.cli.main`, as the console script calls it) to spare a start-up each, the others as users start them
(a process of their own, torchrun).
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from conftest import launch_recipe, read_json, run_command, run_launch, torchrun_command
from fsdp_peft.cli import main
from fsdp_peft.data.templates import render_prompt
from fsdp_peft.tools.evaluation import EVAL_FILE, default_output_dir
from fsdp_peft.tools.runs import RUN_FILE

STEPS = 90
CLI = [sys.executable, "-m", "fsdp_peft.cli", "eval"]


EVAL_TASKS_YAML = """include: llama_lora/tiny.yaml
eval_tasks: [tiny_reverse]           # the harness at the end of training
generate_gather_budget: none         # ranks in step: every forward and generate call gathers (the synced path)
"""


@pytest.fixture(scope="module")
def training(tmp_path_factory, tiny_model_dir) -> tuple[Path, str]:
    """The run's ``output_dir`` and what its launch printed."""
    base = tmp_path_factory.mktemp("eval_source")
    (base / "eval_tasks.yaml").write_text(EVAL_TASKS_YAML)
    result = launch_recipe(
        "llama_lora",
        *("--config", str(base / "eval_tasks.yaml"), "--output_dir", str(base / "run"), "--max_steps", str(STEPS)),
        *("--warmup_steps", "0", "--lr_scheduler_type", "constant"),
        *("--save_strategy", "steps", "--save_steps", str(STEPS), "--generate_eval_samples", "0"),
        *("--export_merged", "true", "--export_dtype", "fp32"),
    )
    return base / "run", result.stdout + result.stderr


@pytest.fixture(scope="module")
def trained(training) -> Path:
    return training[0]


def evaluate(source: Path, out: Path, *options: str) -> tuple[dict, object]:
    """``fsdp-peft eval SOURCE --out OUT ...`` in a process of its own: ``eval.json`` and the finished process."""
    result = run_launch([*CLI, str(source), "--out", str(out), *options])
    assert result.returncode == 0, result.stderr[-4000:]
    return read_json(out / EVAL_FILE), result


def evaluate_here(*arguments: str) -> tuple[int, str, str]:
    """``fsdp-peft eval ARGUMENTS`` run by the console script's `main` in this process: exit code, stdout, stderr."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        try:
            main(["eval", *arguments])
            code = 0
        except SystemExit as exit:
            code = exit.code
    return code, stdout.getvalue(), stderr.getvalue()


def harness_samples(summary: dict, task: str) -> dict[int, dict]:
    """The harness's own per-sample file of ``task``, by document id."""
    rows = [json.loads(line) for line in Path(summary["samples_files"][task]).read_text().splitlines()]
    return {row["doc_id"]: row for row in rows}


@pytest.fixture(scope="module")
def adapter_eval(trained, tmp_path_factory):
    return evaluate(trained, tmp_path_factory.mktemp("adapter_eval"), "--tasks", "tiny_reverse")


@pytest.fixture(scope="module")
def base_eval(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("base_eval")
    code, _, stderr = evaluate_here(
        str(trained / "adapter"), "--tasks", "tiny_reverse_em", "--base-only", "--out", str(out)
    )
    assert code == 0, stderr[-4000:]
    return read_json(out / EVAL_FILE)


@pytest.mark.slow
def test_eval_of_the_adapter_reports_the_recipes_held_out_exact_match(trained, adapter_eval):
    summary, result = adapter_eval
    recipe = read_json(trained / "results.json")
    task = summary["tasks"]["tiny_reverse_em"]
    assert task["samples"] == recipe["generated_samples"] == 200
    hits = round(task["exact_match,strip"] * task["samples"])
    assert hits == round(recipe["exact_match_after"] * recipe["generated_samples"])
    assert 0 < hits < 200
    print(f"exact match: harness {hits}/200, recipe {recipe['exact_match_after']:.3f}")
    assert "|tiny_reverse_em|" in result.stdout and "exact_match" in result.stdout  # the harness's table
    assert summary["model"].startswith(f"adapter {trained / 'adapter'} on ")


@pytest.mark.slow
def test_the_harness_sees_the_recipes_prompts_and_completes_them_the_same(trained, adapter_eval, tiny_model_dir):
    from transformers import AutoTokenizer

    summary, _ = adapter_eval
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    recipe_rows = [json.loads(line) for line in (trained / "samples.jsonl").read_text().splitlines()]
    harness = harness_samples(summary, "tiny_reverse_em")
    assert sorted(harness) == list(range(200))
    for doc_id, row in enumerate(recipe_rows):
        sample = harness[doc_id]
        assert sample["arguments"]["gen_args_0"]["arg_0"] == render_prompt(tokenizer, row["prompt"], True)
        assert sample["resps"] == [[row["generated"]]]
        assert sample["exact_match"] == float(row["exact"])


@pytest.mark.slow
def test_the_loglikelihood_task_scores_the_answer_after_the_same_prompt(adapter_eval):
    summary, _ = adapter_eval
    scored = harness_samples(summary, "tiny_reverse_ll")
    generated = harness_samples(summary, "tiny_reverse_em")
    for doc_id, sample in scored.items():
        context, continuation = sample["arguments"]["gen_args_0"].values()
        assert context == generated[doc_id]["arguments"]["gen_args_0"]["arg_0"]
        assert continuation == sample["doc"]["completion"]
        logprob, greedy = sample["resps"][0][0]
        assert float(logprob) < 0
        if generated[doc_id]["resps"][0][0] == sample["doc"]["completion"]:
            assert greedy == "True"  # greedy decoding gave every answer token
    figures = summary["tasks"]["tiny_reverse_ll"]
    assert figures["acc,none"] >= summary["tasks"]["tiny_reverse_em"]["exact_match,strip"] > 0
    assert figures["perplexity,none"] > 1


@pytest.mark.slow
def test_base_only_evaluates_the_base_without_the_adapter(trained, base_eval):
    summary = base_eval
    assert summary["base_only"] is True and summary["model"].startswith("base ")
    assert summary["tasks"]["tiny_reverse_em"]["exact_match,strip"] <= 0.01  # the random base reverses nothing
    assert Path(summary["results_file"]).is_file()


@pytest.fixture(scope="module")
def merged_eval(trained, tmp_path_factory):
    """In a process of its own, one thread as each rank has: its time per sample is compared with the ranks'."""
    return evaluate(trained / "merged", tmp_path_factory.mktemp("merged_eval"), "--tasks", "tiny_reverse")[0]


@pytest.fixture(scope="module")
def sharded_eval(trained, tmp_path_factory):
    """The sharded checkpoint evaluated on 2 gloo ranks under torchrun, the model FSDP2-sharded over them."""
    out = tmp_path_factory.mktemp("sharded_eval")
    result = run_launch(
        torchrun_command(*CLI[1:], str(trained / f"checkpoint-{STEPS}"), "--tasks", "tiny_reverse", "--out", str(out))
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return read_json(out / EVAL_FILE), result


@pytest.mark.slow
def test_the_sharded_checkpoint_on_two_ranks_scores_as_the_merged_export_in_one_process(
    merged_eval, sharded_eval, adapter_eval
):
    merged, (sharded, result), (adapter, _) = merged_eval, sharded_eval, adapter_eval
    assert (merged["world_size"], sharded["world_size"]) == (1, 2)
    assert "sharded over 2 ranks" in result.stderr and result.stdout.count("|tiny_reverse_em|") == 1
    one, two = harness_samples(merged, "tiny_reverse_ll"), harness_samples(sharded, "tiny_reverse_ll")
    assert sorted(one) == sorted(two) == list(range(200))
    differences = [abs(float(one[i]["resps"][0][0][0]) - float(two[i]["resps"][0][0][0])) for i in one]
    assert max(differences) < 1e-5  # fp32: the merged weights against base + adapter, sharded
    assert all(one[i]["resps"][0][0][1] == two[i]["resps"][0][0][1] for i in one)  # greedy or not, alike
    generated_one, generated_two = (
        harness_samples(merged, "tiny_reverse_em"),
        harness_samples(sharded, "tiny_reverse_em"),
    )
    assert all(generated_one[i]["resps"] == generated_two[i]["resps"] for i in generated_one)
    assert (
        merged["tasks"]["tiny_reverse_em"] == sharded["tasks"]["tiny_reverse_em"] == adapter["tasks"]["tiny_reverse_em"]
    )
    print(
        f"log-likelihood max difference {max(differences):.2e}; seconds per sample: sharded on 2 ranks "
        f"{sharded['seconds_per_sample']:.4f}, merged in one process {merged['seconds_per_sample']:.4f}, adapter in "
        f"one process {adapter['seconds_per_sample']:.4f} (sharded / one process: "
        f"{sharded['seconds_per_sample'] / merged['seconds_per_sample']:.2f}x, "
        f"{sharded['seconds_per_sample'] / adapter['seconds_per_sample']:.2f}x)"
    )


@pytest.mark.slow
def test_each_rank_scores_every_second_document(sharded_eval):
    """The harness deals the documents out to the ranks in turn and gathers them in rank order."""
    summary, _ = sharded_eval
    for task in ("tiny_reverse_em", "tiny_reverse_ll"):
        rows = Path(summary["samples_files"][task]).read_text().splitlines()
        assert [json.loads(row)["doc_id"] for row in rows] == [*range(0, 200, 2), *range(1, 200, 2)]


@pytest.mark.slow
def test_eval_tasks_in_the_recipe_yaml_run_the_harness_on_the_trained_sharded_model(training):
    output_dir, printed = training
    results = read_json(output_dir / "results.json")
    figures = results["eval_tasks"]
    assert set(figures) == {"tiny_reverse_em", "tiny_reverse_ll"}
    assert figures["tiny_reverse_em"] == {"samples": 200, "exact_match,strip": results["exact_match_after"]}
    summary = read_json(output_dir / "eval" / EVAL_FILE)
    assert summary["world_size"] == 2 and summary["tasks"] == figures
    assert results["eval_tasks_results"] == summary["results_file"] and Path(summary["results_file"]).is_file()
    recipe_rows = [json.loads(line) for line in (output_dir / "samples.jsonl").read_text().splitlines()]
    harness = harness_samples(summary, "tiny_reverse_em")
    assert [harness[i]["resps"] for i in range(200)] == [[[row["generated"]]] for row in recipe_rows]
    em = figures["tiny_reverse_em"]["exact_match,strip"]
    assert f"[fsdp-peft] harness tiny_reverse_em on 200 documents: exact_match,strip {em:.4g}" in printed
    assert f"[fsdp-peft] harness results: {summary['results_file']}" in printed
    assert printed.count("|tiny_reverse_em|") == 1  # the harness's table, from rank 0


@pytest.fixture(scope="module")
def random_lm(tiny_model_dir):
    """`HarnessLM` over the random embedded model in this process, batches of 3 (so requests share batches)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_peft.tools.evaluation import HarnessLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return HarnessLM(model, AutoTokenizer.from_pretrained(tiny_model_dir), torch.device("cpu"), batch_size=3)


def _requests(kind: str, *arguments: tuple):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, args, index) for index, args in enumerate(arguments)]


def _direct_logprob(lm, context: str, continuation: str) -> float:
    """The continuation's log-probability from one unpadded forward, log-softmax in fp32."""
    import torch

    encode = lambda text: lm.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    context_ids = encode(context) if context else [lm.tokenizer.bos_token_id]
    ids = context_ids + encode(continuation)
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([ids[:-1]])).logits[0].float().log_softmax(-1)
    return sum(logits[i - 1, ids[i]].item() for i in range(len(context_ids), len(ids)))


def test_loglikelihoods_are_one_forward_each_whatever_the_batch_and_trailing_spaces_go_to_the_answer(random_lm):
    pairs = [("reverse: abc", "cba"), ("", "hello world"), ("a much longer prompt than the others: ", "x"), ("q", "")]
    scored = random_lm.loglikelihood(_requests("loglikelihood", *pairs))
    for (context, continuation), (logprob, _) in zip(pairs[:3], scored):
        expected = _direct_logprob(random_lm, context.rstrip(), context[len(context.rstrip()) :] + continuation)
        assert logprob == pytest.approx(expected, abs=1e-5), (context, continuation)
    assert scored[3] == (0.0, True)  # nothing to score
    (moved, _), (written, _) = random_lm.loglikelihood(_requests("loglikelihood", ("ab ", "cd"), ("ab", " cd")))
    assert moved == written


def test_a_rolling_loglikelihood_scores_the_whole_text_after_bos(random_lm):
    text = "the quick brown fox"
    (rolled,) = random_lm.loglikelihood_rolling(_requests("loglikelihood_rolling", (text,)))
    assert rolled == pytest.approx(_direct_logprob(random_lm, "", text), abs=1e-5)


def test_generation_stops_at_the_tasks_strings_and_temperature_zero_is_greedy(random_lm):
    import torch

    from fsdp_peft.tools.generation import GenerationSettings, generate_completions

    prompts = ["reverse: hello", "reverse: abcde", "reverse: xyz", "reverse: q"]
    greedy = generate_completions(
        random_lm.model, random_lm.tokenizer, prompts, GenerationSettings(12, 3), torch.device("cpu")
    )
    stop = next(char for text in greedy for char in text if char.strip())  # a character some completion contains
    settings = [
        {"until": [], "max_gen_toks": 12, "do_sample": False},
        {"until": stop, "max_new_tokens": 12, "do_sample": True, "temperature": 0.0},  # the harness's alias; greedy
    ]
    requests = _requests("generate_until", *[(prompt, kwargs) for kwargs in settings for prompt in prompts])
    completions = random_lm.generate_until(requests)
    assert completions[:4] == greedy
    assert completions[4:] == [text.split(stop)[0] for text in greedy] != greedy


HUB_TASK = """task: hub_task
dataset_path: EleutherAI/lambada_openai
output_type: loglikelihood
test_split: test
doc_to_text: "{{text}}"
doc_to_target: " x"
"""
MISSING_FILE_TASK = """task: local_task
dataset_path: json
dataset_kwargs: {data_files: {test: /nonexistent/fsdp-peft/rows.jsonl}}
output_type: loglikelihood
test_split: test
doc_to_text: "{{prompt}}"
doc_to_target: "{{completion}}"
"""
IMAGE_TASK = """task: image_task
dataset_path: json
dataset_kwargs: {data_files: {test: IMAGES}}
output_type: generate_until
test_split: test
doc_to_text: "What color is this?"
doc_to_image: [image]
doc_to_target: "{{color}}"
"""
REFUSALS = {  # arguments after SOURCE, the error line's start
    "unknown task": (
        ["--tasks", "tiny_revers_em"],
        "--tasks: tiny_revers_em: no harness task, group or tag of that name (did you mean tiny_reverse_em?); "
        "fsdp-peft ships tiny_reverse_em, tiny_reverse_ll, iso_dates_em (tag tiny_reverse)",
    ),
    "hub data offline": (
        ["--tasks", "hub_task", "--include-path", "{tasks}"],
        "--tasks: hub_task: its dataset EleutherAI/lambada_openai could not be loaded (ConnectionError: Couldn't "
        "reach 'EleutherAI/lambada_openai' on the Hub (OfflineModeIsEnabled)); without network, give the task local",
    ),
    "local data missing": (
        ["--tasks", "local_task", "--include-path", "{tasks}"],
        "--tasks: local_task: its dataset json could not be loaded (FileNotFoundError: Unable to find "
        "'/nonexistent/fsdp-peft/rows.jsonl')",
    ),
    "image task": (
        ["--tasks", "image_task", "--include-path", "{tasks}"],
        "--tasks: image_task is a multimodal task (its documents carry images or audio); fsdp-peft eval runs text "
        "tasks only, on vision-language models too",
    ),
    "broken task yaml": (
        ["--tasks", "tiny_reverse_em", "--include-path", "{broken}"],
        "--include-path: {broken}/bad.yaml:2: not valid YAML",
    ),
    "fewer documents than ranks": (
        ["--tasks", "tiny_reverse_em", "--limit", "1"],
        "--tasks: tiny_reverse_em: 1 document (--limit 1) for 2 ranks; the harness deals the documents out to the "
        "ranks in turn and fails on a rank that gets none: evaluate at least 2 documents, or launch fewer processes",
    ),
    "not a model": (
        ["--tasks", "tiny_reverse_em"],
        "SOURCE: {source} is none of: a merged model directory (config.json + *.safetensors), an adapter directory",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_input_is_refused_in_one_line_before_any_weights_load(case, tmp_path, monkeypatch):
    import datasets.config
    import huggingface_hub.constants
    import transformers

    from fsdp_peft.tools import evaluation, inference

    def no_weights(*_, **__):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(inference, "load_base_model", no_weights)
    for auto_class in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        monkeypatch.setattr(auto_class, "from_pretrained", no_weights)  # what inference loads merged models with
    if case != "not a model":  # the task checks come before SOURCE is even looked at
        monkeypatch.setattr(evaluation, "load_for_generation", no_weights)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1, read at import
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("WORLD_SIZE", "2" if case == "fewer documents than ranks" else "1")  # checked before any group
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hub.yaml").write_text(HUB_TASK)
    (tmp_path / "tasks" / "local.yaml").write_text(MISSING_FILE_TASK)
    if case == "image task":  # its documents load (a progress bar on stderr), then the check refuses the task
        monkeypatch.setattr(sys.modules["datasets.utils.tqdm"], "_hf_datasets_progress_bars_disabled", True)
    images = tmp_path / "tasks" / "images.jsonl"
    images.write_text('{"image": "a.png", "color": "red"}\n{"image": "b.png", "color": "blue"}\n')
    (tmp_path / "tasks" / "image.yaml").write_text(IMAGE_TASK.replace("IMAGES", str(images)))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "bad.yaml").write_text("task: bad\n  output_type: [loglikelihood\n")
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "notes.txt").write_text("not a model")
    places = {"{tasks}": tmp_path / "tasks", "{broken}": tmp_path / "broken", "{source}": tmp_path / "source"}
    arguments, message = REFUSALS[case]
    for placeholder, path in places.items():
        arguments = [a.replace(placeholder, str(path)) for a in arguments]
        message = message.replace(placeholder, str(path))
    code, stdout, stderr = evaluate_here(str(tmp_path / "source"), *arguments, "--out", str(tmp_path / "out"))
    assert code == 2 and stdout == "", stderr[-3000:]
    assert stderr.startswith(f"error: {message}") and stderr.count("\n") == 1, stderr[-3000:]


@pytest.mark.slow
def test_bad_input_under_torchrun_is_refused_in_one_line_before_any_process_group(tmp_path):
    """As users launch a sharded evaluation: the first rank to find the problem prints one line and exits 2;
    the launcher then stops the other rank and prints its own report of the failed ranks."""
    command = torchrun_command(*CLI[1:], str(tmp_path), "--tasks", "tiny_revers_em", "--out", str(tmp_path / "out"))
    result = run_command(command, timeout=180)
    assert result.returncode != 0
    ours, _, launcher_report = result.stderr.partition("Traceback (most recent call last)")
    errors = [line for line in ours.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {REFUSALS['unknown task'][1]}; --include-path directories: none"], result.stderr[-3000:]
    assert "exitcode  : 2" in launcher_report and "fsdp_peft/" not in launcher_report
    assert "Loading weights" not in result.stdout + result.stderr and not (tmp_path / "out").exists()


QLORA_STEPS, QLORA_EVERY = 150, 75


@pytest.fixture(scope="module")
def qlora_during_training(tmp_path_factory) -> tuple[Path, str]:
    """QLoRA on 2 ranks with the harness every 75 steps: the 4-bit model, sharded, evaluated mid-run and at the end
    (150 steps at a constant rate: exact match about 0.6, neither 0 nor 1)."""
    out = tmp_path_factory.mktemp("qlora_during") / "run"
    result = launch_recipe(
        "llama_qlora",
        *("--output_dir", str(out), "--max_steps", str(QLORA_STEPS), "--warmup_steps", "0"),
        *("--lr_scheduler_type", "constant", "--save_strategy", "no"),
        *("--eval_tasks", "tiny_reverse_em", "--eval_tasks_steps", str(QLORA_EVERY)),
    )
    return out, result.stdout + result.stderr


@pytest.mark.slow
def test_eval_tasks_steps_evaluate_the_sharded_qlora_model_during_training(qlora_during_training):
    out, printed = qlora_during_training
    results = read_json(out / "results.json")
    during = results["eval_tasks_during"]
    assert [entry["step"] for entry in during] == [QLORA_EVERY, QLORA_STEPS]
    key = "harness/tiny_reverse_em/exact_match,strip"  # as the trainer logged it (console, report_to, trainer state)
    logged = {e["step"]: e[key] for e in read_json(out / "trainer_state.json")["log_history"] if key in e}
    assert logged == {entry["step"]: entry["tiny_reverse_em"]["exact_match,strip"] for entry in during}
    mid = read_json(out / "eval" / f"step-{QLORA_EVERY}" / EVAL_FILE)
    assert (mid["step"], mid["world_size"], mid["tasks"]["tiny_reverse_em"]["samples"]) == (QLORA_EVERY, 2, 200)
    # the end reports the last step's evaluation (the same weights), which the recipe's own figure confirms
    final = results["eval_tasks"]["tiny_reverse_em"]
    assert final == {"samples": 200, **during[-1]["tiny_reverse_em"]}
    hits = round(final["exact_match,strip"] * 200)
    assert hits == round(results["exact_match_after"] * results["generated_samples"]) > 0
    print(f"QLoRA exact match: step {QLORA_EVERY} {during[0]['tiny_reverse_em']}, end {hits}/200 (recipe's too)")
    assert f"harness tasks on the trained model: as evaluated at step {QLORA_STEPS} (the same weights)" in printed
    assert f"[fsdp-peft] harness at step {QLORA_EVERY}: tiny_reverse_em exact_match,strip " in printed


def test_eval_tasks_steps_without_tasks_is_refused(tmp_path):
    from fsdp_peft.core.errors import ConfigError
    from fsdp_peft.recipe import parse_recipe_config
    from fsdp_peft.settings.catalog import CONFIGS

    config = CONFIGS / "llama_lora" / "tiny.yaml"
    with pytest.raises(ConfigError) as refused:
        parse_recipe_config(["--config", str(config), "--eval_tasks_steps", "10"], config, str(tmp_path))
    assert str(refused.value) == (
        "eval_tasks_steps: 10 but eval_tasks names no task; name the harness tasks to run (eval_tasks: "
        "[tiny_reverse]) or set eval_tasks_steps: 0"
    )


def test_eval_tasks_on_the_tpu_route_are_refused_in_one_line(tmp_path, monkeypatch):
    from fsdp_peft.core.errors import ConfigError
    from fsdp_peft.recipe import parse_recipe_config
    from fsdp_peft.settings.catalog import CONFIGS

    config = CONFIGS / "llama_lora" / "tiny.yaml"
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    with pytest.raises(ConfigError) as refused:
        parse_recipe_config(["--config", str(config), "--eval_tasks", "tiny_reverse_em"], config, str(tmp_path))
    assert str(refused.value) == (
        'eval_tasks: the harness does not run on XLA (PJRT_DEVICE=CPU) yet; train without it (--eval_tasks "" '
        "--eval_tasks_steps 0) and evaluate the exported model with fsdp-peft eval on GPUs or CPUs (docs/eval.md)"
    )


def test_without_out_the_results_go_into_the_evaluated_run_not_the_current_directory(
    tmp_path, tiny_model_dir, monkeypatch
):
    """The default once was ``./eval_results``: run from a checkout, it overwrote the files tracked there."""
    source = tmp_path / "run"
    shutil.copytree(tiny_model_dir, source)  # a merged model directory of its own: the cache's stays as it is
    monkeypatch.chdir(tmp_path)
    code, _, stderr = evaluate_here(str(source), "--tasks", "tiny_reverse_em", "--limit", "2")
    assert code == 0, stderr[-4000:]
    assert read_json(source / "eval" / EVAL_FILE)["tasks"]["tiny_reverse_em"]["samples"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    (source / RUN_FILE).write_text("{}")  # a training output_dir: its adapter's and checkpoints' results go beside
    for name in ("adapter", "checkpoint-4"):
        (source / name).mkdir()
        assert default_output_dir(source / name) == source / "eval" / name
    assert default_output_dir(source / "adapter", base_only=True) == source / "eval" / "adapter" / "base-only"
