"""Vision-language recipes: 2 ranks equal one process, also at steps where one rank's rows are all text and the
other's all have images; labels on the answers only; QLoRA keeps the vision tower 16-bit; bad rows in one line.

Each equivalence case trains 5 steps twice on the same rows in the same order (``train_sampling_strategy:
sequential``): on 2 gloo ranks under FSDP2 (4 rows each a step) and in one process (the 8 rows at once). The rows
are laid out so that at step 1 rank 0 holds only image rows and rank 1 only text rows, at step 2 the reverse, then
mixed. The one process always has images in its batch: it never takes the blank-image path (`fsdp_peft.model.vision`)
that the text-only rank takes, so equal losses show that path adds nothing. LoRA cases train with plain SGD, so
each lora_B (zero at the start) is minus the learning rate times the sum of its gradients.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO, launch_recipe, logged_losses, read_json, run_command, run_launch
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.data.vision_rows import IGNORE_INDEX, VisionCollator, check_rows, read_rows
from fsdp_peft.model import paths
from fsdp_peft.model.tiny_vision import QUESTION, load_processor
from fsdp_peft.model.vision import quantization_skip_modules
from fsdp_peft.settings.families import FAMILIES, family_for

STEPS = 5
COMMON = [
    "--max_steps", str(STEPS), "--logging_steps", "1", "--lr_scheduler_type", "constant", "--warmup_steps", "0",
    "--train_sampling_strategy", "sequential", "--eval_strategy", "no",
    "--generate_samples", "6", "--generate_batch_size", "1",  # one held-out row a call: images on one rank only
]  # fmt: skip
SGD = ["--optim", "sgd", "--learning_rate", "0.1"]
# QLoRA: 16 rows a rank, as tests/settings/test_families.py says: with 4, bf16 rounding of the other matmul shapes
# alone puts runs 1.4e-4 apart after 3 steps (measured here too: 1.1e-4); with 16, 3e-5
QLORA_PER_RANK = 16
# and a smaller step: each rank's bf16 gradient is rounded before the fp32 reduction, the one process's once over all
# rows; lr 0.1 makes that rounding 1.3e-4 of the loss by step 3 on Gemma 3 (its inputs are scaled by sqrt(width))
QLORA_SGD = ["--optim", "sgd", "--learning_rate", "0.05"]
QLORA_EVAL_TOLERANCE = 5e-4  # the eval loss after those 5 steps (measured 2.0e-4 on Gemma 3)
COMPILED = ["--compile", "true"]
GENERATE_COMPILED = ["--generate_compiled", "true"]  # generation's decode step compiled (the 2 ranks only)
RECIPES = {"qwen": "tiny-qwen2.5-vl", "qwen3": "tiny-qwen3-vl", "gemma3": "tiny-gemma3-vl"}
# Each family with and without a trained projector; Qwen2.5-VL's "without" is its QLoRA case (its fp32 LoRA without a
# projector, 1.8e-7: measured once, docs/vision.md), Gemma 3's LoRA case keeps the export's frozen-projector check.
CASES = {  # name: (recipe, overrides, largest relative loss difference allowed)
    # its language model's layers compiled on the 2 ranks (compile: true), the one process eager
    "qwen-lora-projector": ("qwen_vl_lora", [*SGD, "--train_projector", "true", *COMPILED], 1e-5),
    "qwen-qlora": ("qwen_vl_qlora", QLORA_SGD, 1e-4),
    # Qwen3-VL through the Qwen recipes (its deepstack mergers frozen; the merger trained as the projector)
    "qwen3-lora-projector": (
        "qwen_vl_lora",
        [*SGD, "--train_projector", "true", "--model_name_or_path", "tiny-qwen3-vl", *GENERATE_COMPILED],
        1e-5,
    ),  # fmt: skip
    "gemma3-lora": ("gemma3_vl_lora", [*SGD, *GENERATE_COMPILED], 1e-5),
    "gemma3-lora-projector": ("gemma3_vl_lora", [*SGD, "--train_projector", "true"], 1e-5),
    # Gemma 3's QLoRA pair follows the CPU's bf16 kernels: 8.3e-5 on one AMD EPYC with AVX512-BF16 (2026-12-04),
    # 2.1e-4 on another (2026-12-05), the same code: its eval loss's bound, for the same rounding
    "gemma3-qlora": ("gemma3_vl_qlora", QLORA_SGD, QLORA_EVAL_TOLERANCE),
}


def _image_row(color: str, image: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": [{"type": "text", "text": color}]},
        ],
        "images": [image],
    }


def _text_row(color: str, filler: int = 0) -> dict:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": f"Say {color}." + " " * filler}]},
            {"role": "assistant", "content": [{"type": "text", "text": color}]},
        ],
        "images": [],
    }


def write_mixed_rows(directory: Path, per_rank: int, one_length_for: str | None = None) -> Path:
    """Rows for 5 steps of 2 x ``per_rank``: at step 1 rank 0's rows all have images and rank 1's are all text, at
    step 2 the reverse, at steps 3-5 image and text rows alternate. Images from the embedded task (absolute paths);
    the text rows answer with the same colours, so each rank's labelled tokens differ only from step 3 on.

    ``one_length_for`` (a model): every row as many tokens long as every other for that model's processor (answers
    of 5 letters, text prompts filled with spaces), so that both sides multiply matrices of the same widths: in
    bf16 a kernel's blocking follows the padded length, and its rounding with it."""
    source = paths.tiny_colors_path()
    pictured = [r for r in read_rows(source / "train.jsonl") if r["images"]]
    images = [(r["messages"][1]["content"][0]["text"], str(source / r["images"][0])) for r in pictured]
    filler = 0
    if one_length_for:
        images = [(color, image) for color, image in images if len(color) == 5]
        processor = load_processor(paths.resolve_model_path(one_length_for))
        color, image = images[0]
        lengths = [check_rows([row], Path(image), processor, 256, True)[0].tokens
                   for row in (_image_row(color, image), _text_row(color))]  # fmt: skip
        filler = lengths[0] - lengths[1]
    image_rows = [_image_row(color, image) for color, image in images]
    text_rows = [_text_row(color, filler) for color, _ in images]
    b = per_rank
    rows = image_rows[:b] + text_rows[:b] + text_rows[b : 2 * b] + image_rows[b : 2 * b]
    rows += [row for pair in zip(image_rows[2 * b : 5 * b], text_rows[2 * b : 5 * b]) for row in pair]  # steps 3-5
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out = [row for pair in zip(image_rows[-3:], text_rows[-3:]) for row in pair]  # rank 0 images, rank 1 text
    (directory / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    return directory


@pytest.fixture(scope="module")
def mixed_rows(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("mixed")
    rows = {4: write_mixed_rows(root / "4", 4)}
    for family, model in RECIPES.items():
        rows[family] = write_mixed_rows(root / family, QLORA_PER_RANK, model)
    return rows


def _losses(output_dir: Path) -> list[float]:
    return [e["loss"] for e in read_json(output_dir / "trainer_state.json")["log_history"] if "loss" in e]


RUNS: dict[str, dict] = {}  # case: its two runs, shared by the tests that read them


def run_case(case: str, tmp_path_factory, mixed_rows) -> dict:
    """Case ``case`` trained on 2 ranks and in one process (once per module)."""
    if case not in RUNS:
        RUNS[case] = _train_both(case, tmp_path_factory, mixed_rows)
    return RUNS[case]


@pytest.fixture(scope="module", params=list(CASES))
def runs(request, tmp_path_factory, mixed_rows):
    return run_case(request.param, tmp_path_factory, mixed_rows)


@pytest.fixture(scope="module")
def runs_of(tmp_path_factory, mixed_rows):
    """``runs_of(case)``: that case's runs; ``runs_of.rows``: the rows of the LoRA cases."""

    def get(case: str) -> dict:
        return run_case(case, tmp_path_factory, mixed_rows)

    get.rows = mixed_rows[4]
    return get


def _compiled(overrides: list[str], pair: list[str] = COMPILED) -> int | None:
    """Where ``pair`` (``compile: true``) is among a case's overrides, if it is."""
    return next((i for i in range(len(overrides)) if overrides[i : i + 2] == pair), None)


def _without(overrides: list[str], pair: list[str]) -> list[str]:
    at = _compiled(overrides, pair)
    return overrides if at is None else overrides[:at] + overrides[at + 2 :]


def _train_both(case: str, tmp_path_factory, mixed_rows) -> dict:
    recipe, overrides, tolerance = CASES[case]
    b = QLORA_PER_RANK if "qlora" in recipe else 4
    data = ["--dataset", str(mixed_rows[case.split("-")[0] if "qlora" in recipe else 4])]
    sharded, single = (tmp_path_factory.mktemp(f"{case}-{kind}") for kind in ("sharded", "single"))
    launched = launch_recipe(recipe, *COMMON, *data, *overrides, "--per_device_train_batch_size", str(b),
                             "--output_dir", str(sharded))  # fmt: skip
    eager = _without(_without(overrides, COMPILED), GENERATE_COMPILED)  # the one process never compiles
    one = run_launch([sys.executable, str(REPO / "recipes" / f"{recipe}.py"), *COMMON, *data, *eager,
                       "--per_device_train_batch_size", str(2 * b), "--output_dir", str(single)])  # fmt: skip
    assert one.returncode == 0, one.stderr[-4000:]
    return {"case": case, "sharded": sharded, "single": single, "tolerance": tolerance, "stdout": launched.stdout}


@pytest.mark.slow
def test_two_ranks_equal_one_process_also_when_one_ranks_rows_have_no_images(runs):
    sharded, single = _losses(runs["sharded"]), _losses(runs["single"])
    assert len(sharded) == len(single) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(sharded, single))
    adapter = load_file(runs["sharded"] / "adapter" / "adapter_model.safetensors")
    reference = load_file(runs["single"] / "adapter" / "adapter_model.safetensors")
    assert adapter.keys() == reference.keys()
    gradients = max(((adapter[k] - v).norm() / v.norm()).item() for k, v in reference.items() if "lora_B" in k)
    copies = {k: v for k, v in reference.items() if "lora_" not in k}  # the projector's trained copy
    if copies:  # each against how far it moved from the base model's tensor
        base = load_file(Path(paths.resolve_model_path(RECIPES[runs["case"].split("-")[0]])) / "model.safetensors")
        moved = {k: v - base[k.removeprefix("base_model.model.")] for k, v in copies.items()}
        gradients = max(gradients, *(((adapter[k] - v).norm() / moved[k].norm()).item() for k, v in copies.items()))
    print(f"{runs['case']}: largest relative loss difference {worst:.2e}, trained tensors {gradients:.2e}")
    assert worst <= runs["tolerance"], (sharded, single)
    if "qlora" not in runs["case"]:
        assert gradients <= 1e-5
    if "projector" in runs["case"]:  # the projector trained, as a whole copy, on both sides
        assert copies and all(moved[k].norm() > 0 for k in copies)
    else:
        assert not copies
    results = [json.loads((d / "results.json").read_text()) for d in (runs["sharded"], runs["single"])]
    if "qlora" not in runs["case"]:  # generation, one rank's prompts with images and the other's without: the same
        # (the 2 ranks' decode step compiled where the case says generate_compiled: true, the one process's eager)
        samples = [read_rows(d / "samples.jsonl") for d in (runs["sharded"], runs["single"])]
        assert [s["generated"] for s in samples[0]] == [s["generated"] for s in samples[1]]
        assert len(samples[0]) == 6
        if _compiled(CASES[runs["case"]][1], GENERATE_COMPILED) is not None:
            assert "compiled decode step:" in runs["stdout"] and "decodes eagerly" not in runs["stdout"]
    assert results[0]["tokens"] == results[1]["tokens"] > 0
    if _compiled(CASES[runs["case"]][1]):  # one graph per layer shape, short of dynamo's recompile limit (8)
        assert results[0]["compiled"]["layers"] == 4 and 1 <= results[0]["compiled"]["graphs"] <= 8, results[0]
        assert results[1]["compiled"] is None
    # after training: the adapters themselves differ by bf16 rounding under QLoRA (above), and the eval loss with them
    evaluated = runs["tolerance"] if "qlora" not in runs["case"] else QLORA_EVAL_TOLERANCE
    assert abs(results[0]["eval_loss"] - results[1]["eval_loss"]) <= evaluated * results[1]["eval_loss"]


# Quick: what the collator and the row checks do, against what the rows say.


@pytest.mark.parametrize("model", RECIPES.values())
def test_labels_are_the_answer_and_its_end_token_only(model, mixed_rows):
    path = paths.resolve_model_path(model)
    processor = load_processor(path)
    file = mixed_rows[4] / "train.jsonl"
    rows = check_rows(read_rows(file)[:8], file, processor, 64, True)
    batch = VisionCollator(processor)(rows)
    tokenizer = processor.tokenizer
    for index, row in enumerate(rows):
        labelled = batch["labels"][index][batch["labels"][index] != IGNORE_INDEX]
        assert tokenizer.decode(labelled) == row.answer + tokenizer.eos_token
    image_token = tokenizer.convert_tokens_to_ids(tokenizer.image_token)
    assert int((batch["input_ids"] == image_token).sum()) == 4 * 4  # 4 image rows, 4 tokens each, never labelled
    assert not bool((batch["labels"] == image_token).any())
    assert batch["pixel_values"].shape[0] > 0


def _bad(tmp_path: Path, row: dict) -> Path:
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    return tmp_path / "train.jsonl"


BAD_ROWS = {  # name: (row, vision model, the message's start after "<file> row 1: ")
    "missing": (_image_row("red", "nowhere.png"), True, "image {dir}/nowhere.png does not exist"),
    "unreadable": (_image_row("red", "broken.png"), True, "an image cannot be read"),
    "count": ({**_image_row("red", "a.png"), "images": []}, True, "1 image part(s) in messages but 0 image(s)"),
    "text-only model": (_image_row("red", "a.png"), False, "has images but the model takes text only"),
    "remote": (_image_row("red", "https://example.com/a.png"), True, "image https://example.com/a.png is remote"),
    "not an object": (["red"], True, "a row must be a JSON object, got list"),
    "a message not an object": ({"messages": ["red"], "images": []}, True, "needs messages ending with the assistant"),
}


@pytest.mark.parametrize("name", list(BAD_ROWS))
def test_a_bad_row_stops_the_run_in_one_line_naming_its_file_and_row(name, tmp_path):
    row, vision, message = BAD_ROWS[name]
    (tmp_path / "broken.png").write_bytes(b"not a png")
    source = paths.tiny_colors_path()
    (tmp_path / "a.png").write_bytes((source / read_rows(source / "eval.jsonl")[0]["images"][0]).read_bytes())
    processor = load_processor(paths.resolve_model_path("tiny-qwen2.5-vl"))
    file = _bad(tmp_path, row)
    with pytest.raises(ConfigError) as raised:
        check_rows(read_rows(file), file, processor, 64, vision)
    assert str(raised.value).startswith(f"{file} row 1: {message.format(dir=tmp_path)}")
    assert "\n" not in str(raised.value)


def test_image_tokens_past_max_seq_length_stop_the_recipe_before_any_weights_load(tmp_path):
    result = run_command([sys.executable, str(REPO / "recipes" / "qwen_vl_lora.py"), "--max_seq_length", "12",
                          "--output_dir", str(tmp_path / "out")])  # fmt: skip
    assert result.returncode != 0
    assert "tokens with its image tokens, over max_seq_length 12" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out" / "adapter").exists()


def test_skip_invalid_rows_leaves_out_and_counts_the_rows_that_would_stop_the_run(tmp_path, capsys):
    from fsdp_peft.data.sources import Source
    from fsdp_peft.procedures.vision_sft import _rows
    from fsdp_peft.settings.config import RecipeArguments

    source = paths.tiny_colors_path()
    rows = read_rows(source / "eval.jsonl")[:3]
    for row in rows:
        row["images"] = [str(source / image) for image in row["images"]]
    too_long = _text_row("red", filler=80)  # its text alone is past max_seq_length 64
    missing = _image_row("red", str(tmp_path / "nowhere.png"))
    file = tmp_path / "train.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in [rows[0], too_long, rows[1], missing, rows[2]]))
    processor = load_processor(paths.resolve_model_path("tiny-qwen2.5-vl"))
    strict = RecipeArguments(model_name_or_path="tiny-qwen2.5-vl", dataset=str(file), max_seq_length=64)
    with pytest.raises(ConfigError, match=f"{file} row 2: .* over max_seq_length 64; .* skip_invalid_rows: true"):
        _rows(Source((file,)), processor, strict, True)
    lenient = RecipeArguments(model_name_or_path="tiny-qwen2.5-vl", dataset=str(file), max_seq_length=64,
                              skip_invalid_rows=True)  # fmt: skip
    kept = _rows(Source((file,)), processor, lenient, True)
    assert [row.where for row in kept] == [f"{file} row {n}" for n in (1, 3, 5)]
    assert f"skipped 2 rows (skip_invalid_rows: true); the first: {file} row 2: " in capsys.readouterr().err


@pytest.mark.parametrize("four_bit", [False, True], ids=["lora", "qlora"])
@pytest.mark.parametrize("model_name", RECIPES.values())
@pytest.mark.parametrize("targets", [["auto"], ["all-linear"], ["q_proj", "v_proj"]], ids=lambda t: t[0])
def test_lora_adapts_the_language_models_layers_only_and_qlora_quantizes_only_them(model_name, four_bit, targets):
    """The recipe's build (`modeling.load_base_model`, `modeling.attach_lora`) against the module tree itself:
    every adapted module is a linear layer of the language model, every one named (all of them for auto and
    all-linear), on the plain base and the 4-bit one; the tower and projector stay unquantized."""
    from fsdp_peft.model.modeling import attach_lora, load_base_model
    from fsdp_peft.settings.config import RecipeArguments

    recipe = RecipeArguments(model_name_or_path=model_name, load_in_4bit=four_bit, lora_target_modules=targets,
                             torch_dtype="bfloat16" if four_bit else "float32", lora_dropout=0.0)  # fmt: skip
    training = type("Flags", (), {"bf16": four_bit, "fp16": False})()
    base = load_base_model(recipe)
    layout = family_for(base.config.model_type).vision
    language = f"{layout.language_model}."
    linear = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(language)}
    quantized = {n for n, m in base.named_modules() if type(m).__name__ == "Linear4bit"}
    base = attach_lora(base, recipe, training).get_base_model()
    adapted = {n for n, m in base.named_modules() if hasattr(m, "lora_A")}
    wanted = {n for n in linear if targets[0] in ("auto", "all-linear") or n.rsplit(".", 1)[-1] in targets}
    assert adapted == wanted and len(adapted) == 4 * (7 if len(targets) == 1 else 2)
    assert quantized == (linear if four_bit else set())  # every linear layer of the language model, no other


def test_a_skip_list_that_matches_nothing_is_caught_and_ours_keeps_the_tower_16_bit():
    """transformers matches ``llm_int8_skip_modules`` from the start of the full module name or as a suffix: the
    bare ``visual`` that many guides give matches nothing and the tower is quantized."""
    from transformers import AutoModelForImageTextToText, BitsAndBytesConfig

    from fsdp_peft.model.vision import vision_weights_kept

    path = paths.resolve_model_path("tiny-qwen2.5-vl")
    layout = family_for("qwen2_5_vl").vision

    def loaded(skip: list[str]):
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_storage=torch.bfloat16, llm_int8_skip_modules=skip
        )
        return AutoModelForImageTextToText.from_pretrained(path, quantization_config=quantization, dtype=torch.bfloat16)

    with pytest.raises(RuntimeError, match="the vision tower was quantized"):
        vision_weights_kept(loaded(["visual", "lm_head"]), layout)
    model = loaded(quantization_skip_modules(family_for("qwen2_5_vl")))
    tower = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("model.visual.",)))
    assert vision_weights_kept(model, layout) == tower > 0
    language = [n for n, m in model.named_modules() if type(m).__name__ == "Linear4bit"]
    assert len(language) == 4 * 7 and all(n.startswith("model.language_model.") for n in language)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.vision is not None], ids=lambda f: f.name)
def test_each_vision_family_has_a_tiny_model_that_its_entry_fits(family):
    """tests/settings/test_families.py's check for the text families: the entry's names are the model's."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from fsdp_peft.parallel.fsdp_policies import decoder_layer_classes

    path = paths.resolve_model_path(family.tiny_model)
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [family.tiny_architecture] and family_for(config.model_type) is family
    model = AutoModelForImageTextToText.from_pretrained(path)
    units = sorted(c.__name__ for c in decoder_layer_classes(model))
    assert units == sorted([family.decoder_layer, family.vision.block])
    assert set(units) <= set(model._no_split_modules)  # the entry agrees with transformers
    layout = family.vision
    for part in (layout.tower, layout.projector, layout.language_model):
        model.get_submodule(part)  # raises when the entry names a module the model does not have


@pytest.mark.slow
def test_resume_from_a_checkpoint_repeats_the_uninterrupted_losses(tmp_path):
    """6 steps through, against 4 with a checkpoint at step 3 (the one at 4 removed: the run "died") resumed to 6;
    with the projector trained too (a full copy in the checkpoint)."""
    import shutil

    common = [*SGD, "--train_projector", "true", "--logging_steps", "1", "--generate_samples", "0",
              "--save_strategy", "steps", "--save_steps", "3", "--lr_scheduler_type", "constant"]  # fmt: skip
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    launch_recipe("qwen_vl_lora", *common, "--max_steps", "6", "--output_dir", str(full))
    launch_recipe("qwen_vl_lora", *common, "--max_steps", "4", "--output_dir", str(interrupted))
    shutil.rmtree(interrupted / "checkpoint-4")
    launch_recipe("qwen_vl_lora", *common, "--max_steps", "6", "--output_dir", str(interrupted),
                  "--resume_from_checkpoint", str(interrupted / "checkpoint-3"))  # fmt: skip
    want, got = logged_losses(full), logged_losses(interrupted)
    assert sorted(got) == list(range(1, 7))
    assert [got[step] for step in range(4, 7)] == [want[step] for step in range(4, 7)]  # 0.0 apart
    reference = load_file(full / "adapter" / "adapter_model.safetensors")
    adapter = load_file(interrupted / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(adapter[k], v) for k, v in reference.items())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen-lora-projector", "gemma3-lora"])
def test_the_fp32_export_answers_images_as_the_trained_model_and_keeps_the_tower_bit_for_bit(case, runs_of, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    trained = runs_of(case)["sharded"]
    merged = tmp_path / "merged"
    result = run_launch(["fsdp-peft", "export", str(trained), "--out", str(merged), "--dtype", "fp32", "--verify"])
    assert result.returncode == 0, result.stderr[-3000:]
    base_dir = Path(paths.resolve_model_path(RECIPES[case.split("-")[0]]))
    exported = AutoModelForImageTextToText.from_pretrained(merged, dtype=torch.float32).eval()
    base = AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, trained / "adapter").eval()
    processor = load_processor(merged)  # the export carries the processor
    file = runs_of.rows / "eval.jsonl"
    rows = [r for r in check_rows(read_rows(file), file, processor, 64, True) if r.images]
    batch = VisionCollator(processor)(rows)
    with torch.no_grad():
        got, want = exported(**batch).logits, reference(**batch).logits
    worst = ((got - want).abs().max() / want.abs().max()).item()
    print(f"{case}: export logits on {len(rows)} image rows, largest difference / largest logit {worst:.2e}")
    assert worst <= 1e-5
    layout = family_for(exported.config.model_type).vision
    kept = {k: v for k, v in load_file(base_dir / "model.safetensors").items() if k.startswith(layout.tower + ".")}
    written = load_file(merged / "model.safetensors")
    projector = layout.projector + "."
    for key, tensor in kept.items():
        if "projector" in case and key.startswith(projector):
            continue  # trained
        assert torch.equal(written[key], tensor.float()), key  # fp32 export of fp32 base: bit for bit

    # The same base in the hub's older layout (what the hub's Qwen2.5-VL and Gemma 3 checkpoints store): the export
    # keeps that layout and merges the same numbers into it.
    hub, renamed = tmp_path / "hub-layout", _in_hubs_older_layout(base_dir, layout)
    shutil.copytree(base_dir, hub)
    save_file({renamed[k]: v for k, v in load_file(base_dir / "model.safetensors").items()}, hub / "model.safetensors")
    merged_from_hub = tmp_path / "merged-from-hub"
    result = run_launch(["fsdp-peft", "export", str(trained), "--base", str(hub), "--out", str(merged_from_hub),
                          "--dtype", "fp32"])  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    written_from_hub = load_file(merged_from_hub / "model.safetensors")
    assert written_from_hub.keys() == {renamed[k] for k in written}
    assert all(torch.equal(written_from_hub[renamed[k]], v) for k, v in written.items())
    loaded = AutoModelForImageTextToText.from_pretrained(merged_from_hub, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, got)


def _in_hubs_older_layout(base_dir: Path, layout) -> dict[str, str]:
    """``{our key: the hub checkpoint's}``, as the hub's Qwen2.5-VL (``model.layers.*``, ``visual.*``) and Gemma 3
    (``language_model.model.*``, ``vision_tower.*``, ``multi_modal_projector.*``) checkpoints name them."""
    keys = load_file(base_dir / "model.safetensors").keys()
    if layout.tower == "model.visual":  # Qwen2.5-VL
        prefixes = {"model.language_model.": "model.", "model.visual.": "visual."}
    else:  # Gemma 3
        prefixes = {
            "model.language_model.": "language_model.model.",
            "model.vision_tower.": "vision_tower.",
            "model.multi_modal_projector.": "multi_modal_projector.",
            "lm_head.": "language_model.lm_head.",
        }
    renamed = {}
    for key in keys:
        ours = next((p for p in prefixes if key.startswith(p)), None)
        renamed[key] = key if ours is None else prefixes[ours] + key.removeprefix(ours)
    assert renamed != dict(zip(keys, keys))
    return renamed


# One run of each family, LoRA for one and QLoRA for the other (the suite's time): the other two defaults differ from
# these in the method only, which the 2-ranks-against-one-process cases above check for each family.
DEFAULTS = ("qwen_vl_lora", "gemma3_vl_qlora")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", DEFAULTS)
def test_the_embedded_defaults_learn_the_colours_and_generate_answers_from_an_image(recipe, tmp_path):
    out = tmp_path / "out"
    launch_recipe(recipe, "--output_dir", str(out))
    results = read_json(out / "results.json")
    print(f"{recipe}: exact match {results['exact_match_after']:.3f} on {results['generated_samples']} held-out images")
    assert results["exact_match_after"] >= 0.9 and results["generated_samples"] == 48
    source = paths.tiny_colors_path()
    row = read_rows(source / "eval.jsonl")[1]
    answer = row["messages"][-1]["content"][0]["text"]
    command = ["accelerate", "launch", "--config_file", str(REPO / "configs" / "accelerate" / "cpu_fsdp2.yaml"),
               "-m", "fsdp_peft.cli", "generate", str(out), "--image", str(source / row["images"][0]),
               "--prompt", QUESTION, "--max-new-tokens", "8"]  # fmt: skip
    result = run_launch(command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == answer


def test_generate_refuses_an_image_it_cannot_use_in_one_line(tmp_path):
    def generate(image: Path):
        return run_command(["fsdp-peft", "generate", str(tmp_path), "--image", str(image), "--prompt", "x"])

    missing = generate(tmp_path / "no.png")
    assert missing.returncode == 2 and missing.stderr.strip() == f"error: --image: file not found: {tmp_path}/no.png"
    (tmp_path / "bad.png").write_bytes(b"not an image")
    unreadable = generate(tmp_path / "bad.png")
    assert unreadable.returncode == 2 and len(unreadable.stderr.strip().splitlines()) == 1
    assert unreadable.stderr.startswith(f"error: --image: {tmp_path}/bad.png cannot be read as an image")


def test_fsdp1_is_refused_for_a_vision_language_model_in_one_line():
    result = run_command(["fsdp-peft", "validate", str(REPO / "configs" / "qwen_vl_lora" / "tiny.yaml"),
                          "--accelerate-config", str(REPO / "configs" / "accelerate" / "cpu_fsdp1.yaml")])  # fmt: skip
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "fsdp: tiny-qwen2.5-vl is a vision-language model; under FSDP1" in result.stderr


def test_rows_with_a_datasets_image_column_in_parquet_or_a_hub_split_train_as_their_files_would(tmp_path, monkeypatch):
    """What ``datasets`` writes for an ``Image`` column (the hub's VLM datasets): ``{"bytes", "path"}`` values, in a
    parquet file beside the config or as a hub split (``datasets.load_dataset``, here of that file: no network)."""
    import datasets

    from fsdp_peft.data import sources
    from fsdp_peft.procedures.vision_sft import _rows
    from fsdp_peft.settings.config import RecipeArguments

    source = paths.tiny_colors_path()
    rows = [r for r in read_rows(source / "train.jsonl") if r["images"]][:4]
    features = datasets.Features(
        {
            "messages": [{"role": datasets.Value("string"), "content": [{"type": datasets.Value("string"),
                                                                          "text": datasets.Value("string")}]}],
            "images": datasets.Sequence(datasets.Image()),
        }
    )  # fmt: skip
    images = [[{"bytes": (source / r["images"][0]).read_bytes(), "path": None}] for r in rows[:2]]  # held in the file
    images += [[str(source / r["images"][0])] for r in rows[2:]]  # a path
    table = {"messages": [r["messages"] for r in rows], "images": images}
    datasets.Dataset.from_dict(table, features=features).to_parquet(tmp_path / "train.parquet")
    processor = load_processor(paths.resolve_model_path("tiny-qwen2.5-vl"))
    from_files = check_rows(rows, source / "train.jsonl", processor, 64, True)
    local = RecipeArguments(model_name_or_path="tiny-qwen2.5-vl", dataset=str(tmp_path), max_seq_length=64)
    train, held_out = sources.data_sources(local)
    assert (train.files, held_out) == ((tmp_path / "train.parquet",), None)
    from_parquet = _rows(train, processor, local, True)

    real_load_dataset = datasets.load_dataset

    def load_dataset(name, config, split):  # what the hub's loader returns: a split whose images decode on access
        assert (name, config, split) == ("someone/colors", None, "train")
        return real_load_dataset("parquet", data_files={"train": str(tmp_path / "train.parquet")}, split=split)

    monkeypatch.setattr(sources.datasets, "load_dataset", load_dataset)
    hub = RecipeArguments(model_name_or_path="tiny-qwen2.5-vl", dataset="someone/colors", max_seq_length=64)
    train, held_out = sources.data_sources(hub)
    from_hub = _rows(train, processor, hub, True)
    assert held_out is None and from_hub[0].where == "someone/colors[train] row 1"
    for checked in (from_parquet, from_hub):
        assert [type(r.images[0]) for r in checked] == [bytes, bytes, str, str]
        a, b = VisionCollator(processor)(checked), VisionCollator(processor)(from_files)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_low_memory_loading_of_a_vision_language_model_is_refused_in_one_line(tmp_path):
    launcher = (REPO / "configs" / "accelerate" / "cpu_fsdp2.yaml").read_text()
    (tmp_path / "lowmem.yaml").write_text(launcher.replace("cpu_ram_efficient_loading: false",
                                                           "cpu_ram_efficient_loading: true"))  # fmt: skip
    result = run_command(["fsdp-peft", "validate", str(REPO / "configs" / "qwen_vl_lora" / "tiny.yaml"),
                          "--accelerate-config", str(tmp_path / "lowmem.yaml")])  # fmt: skip
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "fsdp_cpu_ram_efficient_loading: low-memory loading of the vision-language model" in result.stderr
