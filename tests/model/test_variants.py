"""LoRA variants (`fsdp_peft.model.variants`) end to end on 2 real gloo ranks, against one unsharded process.

Variants are combined so that nine 2-rank runs cover them: DoRA + rsLoRA + rank/alpha patterns + a trained
``lm_head`` copy + EVA init (FSDP2 and FSDP1), trainable tokens + new tokens + OLoRA init (FSDP2 with low-memory
loading, a checkpoint resumed on one rank; and FSDP1), LoRA on the embedding + PiSSA init (FSDP2 and FSDP1), QDoRA
with a trained head copy and trainable tokens (FSDP2 and FSDP1), and PiSSA on the 4-bit base (its residual read by
low-memory loading). Each run is compared with one process with the same global batch and seed; its saved
adapter is reloaded by plain peft, its export compared with peft's ``merge_and_unload()`` and its measured
per-rank bytes with the planner's.
"""

from __future__ import annotations

import json
import math
import re
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO, launch_recipe, logged_losses, read_json, run_command, run_launch, tiny_llama_in_4bit
from fsdp_peft.cli import _environment, launcher_environment
from fsdp_peft.data.formats import read_examples
from fsdp_peft.data.sources import data_files
from fsdp_peft.data.tokenize import IGNORE_INDEX, tokenized_dataset
from fsdp_peft.model.new_tokens import read_new_tokens, tokenizer_directory
from fsdp_peft.procedures.registry import plan_config
from fsdp_peft.recipe import parse_recipe_config
from fsdp_peft.settings.config import RecipeArguments
from fsdp_peft.tools.export import export_merged
from fsdp_peft.tools.runs import EVA_INIT_FILE

STEPS = 5
NEW_TOKENS = ["<|tool_call|>", "<|tool_result|>"]  # new tokens in every completion of the "tokens" variant's data
PER_RANK_BATCH = 16
VARIANTS = {
    "dora": (
        "llama_lora",
        {
            "use_dora": True,
            "use_rslora": True,
            "lora_rank_pattern": {"o_proj": 8},
            "lora_alpha_pattern": {"down_proj": 16},
            "lora_modules_to_save": ["lm_head"],
            "init_lora_weights": "eva",  # its SVD pass on each rank's shard of the data, before wrapping
        },
    ),
    "tokens": (
        "llama_lora",
        {
            "trainable_token_indices": [3, 5, 7],
            "init_lora_weights": "olora",
            "new_special_tokens": NEW_TOKENS,
            "save_strategy": "steps",  # checkpoint-3, resumed on one rank
            "save_steps": 3,
        },
    ),
    "embedding": (
        "llama_lora",
        {"lora_target_modules": ["q_proj", "v_proj", "embed_tokens"], "init_lora_weights": "pissa_niter_4"},
    ),
    "qdora": (
        "llama_qlora",
        {"use_dora": True, "lora_modules_to_save": ["lm_head"], "trainable_token_indices": [3, 5]},
    ),
    "qpissa": ("llama_qlora", {"init_lora_weights": "pissa_niter_4"}),  # 4-bit residual, low-memory loading
}
# what each variant adds to the trainable tensors, as named in the FSDP layout report
VARIANT_TENSORS = {
    "dora": ("lora_magnitude_vector", "lm_head.modules_to_save"),
    "tokens": ("embed_tokens.token_adapter.trainable_tokens_delta", "lm_head.token_adapter.trainable_tokens_delta"),
    "embedding": ("lora_embedding_A", "lora_embedding_B"),
    "qdora": ("lora_magnitude_vector", "lm_head.modules_to_save", "trainable_tokens_delta"),
    "qpissa": ("lora_A", "lora_B"),
}
LOW_MEMORY_LOADING = {"fsdp_cpu_ram_efficient_loading": "true"}  # rank 0 reads, every rank receives its shards
LAUNCHER_SETTINGS = {"qpissa": LOW_MEMORY_LOADING, "tokens": LOW_MEMORY_LOADING}  # the residual; the grown rows
TOLERANCE = {"llama_lora": 1e-5, "llama_qlora": 1e-4}  # fp32 LoRA; bf16-storage QLoRA

pytestmark = pytest.mark.slow


def variant_config(directory, variant: str, per_device_batch: int):
    """A recipe YAML: the recipe's tiny default, the variant's keys, a short run into ``directory/out``."""
    recipe, keys = VARIANTS[variant]
    values = {
        "include": str(REPO / "configs" / recipe / "tiny.yaml"),
        **keys,
        "max_steps": STEPS,
        "logging_steps": 1,
        "warmup_steps": 0,
        "generate_samples": 2,  # generation runs on the sharded variant model
        "generate_eval_samples": 0,
        "per_device_train_batch_size": per_device_batch,
        "output_dir": str(directory / "out"),
    }
    if "new_special_tokens" in keys:
        values["dataset"] = str(tool_call_data(directory / "data"))
    path = directory / "config.yaml"
    path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in values.items()))
    return path


def tool_call_data(directory):
    """The embedded reversal data, every completion wrapped in the new tokens: ``<|tool_call|>olleh<|tool_result|>``."""
    directory.mkdir()
    for split in ("train", "eval"):
        rows = [json.loads(line) for line in (REPO / "fsdp_peft" / "assets" / "tiny_reverse" / f"{split}.jsonl").open()]
        with (directory / f"{split}.jsonl").open("w") as handle:
            for row in rows:
                row["completion"] = f"{NEW_TOKENS[0]}{row['completion']}{NEW_TOKENS[1]}"
                handle.write(json.dumps(row) + "\n")
    return directory


FSDP2_RUNS = [("dora", 2), ("tokens", 2), ("embedding", 2), ("qdora", 2), ("qpissa", 2)]
FSDP1_EMBEDDING_RUNS = [("tokens", 1), ("embedding", 1)]  # the embedding adapter and its frozen base: two units
RUNS = [*FSDP2_RUNS, ("dora", 1), ("qdora", 1), *FSDP1_EMBEDDING_RUNS]
_runs: dict = {}


def two_rank_run(variant: str, version: int, tmp_path_factory, model_dir) -> dict:
    """One 2-rank run of the variant under the FSDP version's CPU accelerate config (cached)."""
    if (variant, version) not in _runs:
        directory = tmp_path_factory.mktemp(f"{variant}_fsdp{version}")
        config = variant_config(directory, variant, PER_RANK_BATCH)
        accelerate_config = REPO / "configs" / "accelerate" / f"cpu_fsdp{version}.yaml"
        if variant in LAUNCHER_SETTINGS and version == 2:  # FSDP1 refuses low-memory loading on CPU
            text = accelerate_config.read_text()
            for key, value in LAUNCHER_SETTINGS[variant].items():
                text = re.sub(rf"(?m)^(\s*{key}:).*$", rf"\g<1> {value}", text)
            accelerate_config = directory / "accelerate.yaml"
            accelerate_config.write_text(text)
        result = launch_recipe(VARIANTS[variant][0], "--config", str(config), accelerate_config=accelerate_config)
        _runs[variant, version] = {
            "stdout": result.stdout,
            "variant": variant,
            "recipe": VARIANTS[variant][0],
            "version": version,
            "config": config,
            "dir": directory / "out",
            "model": model_dir,
        }
    return _runs[variant, version]


@pytest.fixture(params=RUNS, ids=lambda p: f"{p[0]}-fsdp{p[1]}")
def run(request, tmp_path_factory, tiny_model_dir):
    return two_rank_run(*request.param, tmp_path_factory, tiny_model_dir)


@pytest.fixture(params=FSDP2_RUNS + FSDP1_EMBEDDING_RUNS, ids=lambda p: f"{p[0]}-fsdp{p[1]}")
def exported_run(request, tmp_path_factory, tiny_model_dir):
    return two_rank_run(*request.param, tmp_path_factory, tiny_model_dir)


_single_runs: dict = {}


def single_process_run(variant: str, tmp_path_factory):
    """The same variant, seed and global batch in one process without FSDP (cached per variant)."""
    if variant not in _single_runs:
        directory = tmp_path_factory.mktemp(f"{variant}_single")
        config = variant_config(directory, variant, 2 * PER_RANK_BATCH)
        recipe = REPO / "recipes" / f"{VARIANTS[variant][0]}.py"
        result = run_launch([sys.executable, str(recipe), "--config", str(config)])
        assert result.returncode == 0, result.stderr[-4000:]
        _single_runs[variant] = directory / "out"
    return _single_runs[variant]


def _losses(output_dir) -> list[float]:
    return [e["loss"] for e in read_json(output_dir / "trainer_state.json")["log_history"] if "loss" in e]


def test_variant_trains_like_one_process_with_its_tensors_sharded(run, tmp_path_factory):
    reference_dir = single_process_run(run["variant"], tmp_path_factory)
    losses, reference = _losses(run["dir"]), _losses(reference_dir)
    assert len(losses) == len(reference) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    print(f"{run['variant']} FSDP{run['version']}: largest relative loss difference over {STEPS} steps: {worst:.2e}")
    assert worst <= TOLERANCE[run["recipe"]], (losses, reference)

    if VARIANTS[run["variant"]][1].get("init_lora_weights") == "eva":  # both ranks' SVD = one process's
        eva_pass = re.search(r"eva: lora_A of .*", run["stdout"])
        assert eva_pass and eva_pass[0].startswith(
            "eva: lora_A of 28 layers from the SVD of their inputs over 16 global"
        )
        sharded, single = load_file(run["dir"] / EVA_INIT_FILE), load_file(reference_dir / EVA_INIT_FILE)
        assert set(sharded) == set(single) and len(sharded) == 28
        gap = max(((sharded[k] - single[k]).norm() / single[k].norm()).item() for k in single)
        print(f"eva FSDP{run['version']}: {eva_pass[0]}; initial lora_A, 2 ranks vs one process: {gap:.2e} relative")
        assert gap <= 1e-5
    if run["variant"] in LAUNCHER_SETTINGS and run["version"] == 2:  # low-memory loading (tokens: grown rows too)
        assert "[fsdp-peft] low-memory loading: rank 0 read 39 tensors of" in run["stdout"]
    if run["variant"] == "qpissa":  # the residual checkpoint went through low-memory loading
        assert "[fsdp-peft] pissa_niter_4: initial adapter in " in run["stdout"]
    layout = read_json(run["dir"] / "fsdp_layout.json")
    trainable = [p for p in layout["parameters"] if p["trainable"]]
    for marker in VARIANT_TENSORS[run["variant"]]:
        holders = [p for p in trainable if marker in p["name"] or any(marker in n for n in p.get("holds", ()))]
        assert holders, f"no trainable {marker} in the layout report"
        if run["version"] == 1:  # its own unit: one flat parameter, uniform fp32, apart from frozen tensors
            assert all(p["name"].endswith("._flat_param") and p["dtype"] == "float32" for p in holders)
            assert {p["name"].removesuffix("._flat_param") for p in holders} <= set(layout["units"])
            assert all(".lora_" in n or marker in n for p in holders for n in p["holds"])
    markers = VARIANT_TENSORS[run["variant"]]
    if run["version"] == 1 and any("trainable_tokens_delta" in m or "lora_embedding_A" in m for m in markers):
        # the frozen embedding (and head, for new tokens' rows) the adapter calls: a unit of its own, sharded
        bases = [p for p in layout["parameters"] if re.search(r"\.(token_adapter\.)?base_layer\._flat", p["name"])]
        wrapped = {"embed_tokens"} | ({"lm_head"} if any(m.startswith("lm_head.token") for m in markers) else set())
        assert {re.search(r"(embed_tokens|lm_head)\.", p["name"])[1] for p in bases} == wrapped
        for base in bases:
            assert base["holds"] == [base["name"].replace("_flat_param", "weight")] and not base["trainable"]
            assert base["local_shape"][0] == base["shape"][0] // 2
            assert base["dtype"] == ("bfloat16" if run["recipe"] == "llama_qlora" else "float32")
    for parameter in trainable:  # every trainable tensor is split over both ranks
        full, local = math.prod(parameter["shape"]), math.prod(parameter["local_shape"])
        assert math.ceil(full / 2) <= local < full, parameter["name"]
        assert parameter["dtype"] == "float32", parameter["name"]  # fp32 master weights, QLoRA included


def _eval_loss(model, run, autocast: bool) -> float:
    """The run's eval loss recomputed: its data, and its tokenizer (the grown one saved next to the adapter)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_directory(run["dir"] / "adapter", run["model"]))
    recipe = RecipeArguments(max_seq_length=64, **_run_values(run, "dataset"))
    _, eval_path = data_files(recipe)
    rows = tokenized_dataset(read_examples(eval_path), tokenizer, recipe, eval_path)
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for start in range(0, len(rows), 50):  # right-padded batches: the padding is masked and never a label
            batch = [rows[i] for i in range(start, min(start + 50, len(rows)))]
            width = max(len(row["input_ids"]) for row in batch)
            ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in batch])
            mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in batch])
            labels = torch.tensor([r["labels"] + [IGNORE_INDEX] * (width - len(r["labels"])) for r in batch])
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            labels = labels[:, 1:]
            keep = labels != IGNORE_INDEX
            total += torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
            count += int(keep.sum())
    return total / count


def _run_values(run, *keys) -> dict:
    values = {
        line.split(": ", 1)[0]: json.loads(line.split(": ", 1)[1]) for line in run["config"].read_text().splitlines()
    }
    return {key: values[key] for key in keys if key in values}


def _fp32_base(model_dir, adapter=None):
    """The base in fp32; for an adapter with new tokens, resized to its tokenizer as a peft user would (plain
    ``resize_token_embeddings``: the new rows are random, and the trained token rows replace them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None and read_new_tokens(adapter) is not None:
        model.resize_token_embeddings(len(AutoTokenizer.from_pretrained(adapter)))
    return model


def _trained_adapter_on_the_residual(run, directory):
    """PiSSA-QLoRA trained against the 4-bit residual; its saved adapter is peft's conversion for the original
    base (``[A; A0]``, ``[B, -B0]``, rank 2r), whose first r ranks are the trained A and B: plain peft loads
    those on the residual checkpoint (the run's cached one)."""
    from peft import PeftConfig
    from transformers import AutoConfig

    from fsdp_peft.model.modeling import initialisation_checkpoint

    recipe, training = parse_recipe_config(["--config", str(run["config"])], run["config"], str(run["dir"]))
    model_config = AutoConfig.from_pretrained(run["model"])
    residual, _ = initialisation_checkpoint(recipe, str(run["model"]), model_config, training, torch.device("cpu"))
    config = PeftConfig.from_pretrained(run["dir"] / "adapter")
    config.r, config.lora_alpha = config.r // 2, config.lora_alpha / 2
    converted = load_file(run["dir"] / "adapter" / "adapter_model.safetensors")
    trained = {k: (v[: config.r] if ".lora_A." in k else v[:, : config.r]).contiguous() for k, v in converted.items()}
    config.save_pretrained(directory)
    save_file(trained, directory / "adapter_model.safetensors")
    return residual, directory


def test_saved_adapter_loads_with_plain_peft_and_reproduces_the_eval_loss(run, tmp_path):
    from peft import PeftModel

    qlora = run["recipe"] == "llama_qlora"
    adapter = run["dir"] / "adapter"
    if run["variant"] == "qpissa":
        residual, adapter = _trained_adapter_on_the_residual(run, tmp_path / "trained")
        assert residual != str(run["model"])
        base = tiny_llama_in_4bit(residual)
    else:
        base = tiny_llama_in_4bit(run["model"]) if qlora else _fp32_base(run["model"], adapter)
    for module in base.modules():  # the reference must not take bitsandbytes' CPU repacking path either
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    model = PeftModel.from_pretrained(base, adapter).eval()
    reloaded = _eval_loss(model, run, autocast=qlora)
    trained = read_json(run["dir"] / "results.json")["eval_loss"]
    print(f"{run['variant']} FSDP{run['version']}: eval loss {trained:.6f}, reloaded with plain peft {reloaded:.6f}")
    assert abs(trained - reloaded) <= 1e-4, (trained, reloaded)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in fp32 units in the last place between two tensors of the same signs."""
    if torch.equal(a, b):
        return 0
    return int((a.contiguous().view(torch.int32).long() - b.contiguous().view(torch.int32).long()).abs().max())


def test_export_equals_peft_merge_and_unload_in_fp32(exported_run, tmp_path):
    from peft import PeftModel

    run = exported_run
    out = export_merged(run["dir"] / "adapter", tmp_path / "merged", dtype="fp32", progress=False)
    exported = {}
    for path in sorted(out.glob("*.safetensors")):
        exported.update(load_file(path))
    merged = PeftModel.from_pretrained(_fp32_base(run["model"], run["dir"] / "adapter"), run["dir"] / "adapter")
    merged = merged.merge_and_unload()
    expected, base = merged.state_dict(), _fp32_base(run["model"]).state_dict()
    assert set(exported) == set(expected)
    distances = {key: _ulps(exported[key], expected[key]) for key in exported}
    changed = sum(not torch.equal(exported[key], base[key]) for key in exported)
    print(
        f"{run['variant']} FSDP{run['version']}: export vs peft merge_and_unload, {len(distances)} tensors "
        f"({changed} changed by the adapter): {sum(d == 0 for d in distances.values())} bit-identical, "
        f"largest {max(distances.values())} ulp"
    )
    assert max(distances.values()) <= 1, {k: d for k, d in distances.items() if d > 1}
    assert changed >= len(VARIANT_TENSORS[run["variant"]])


def test_planned_bytes_per_rank_equal_the_measured_ones(run):
    accelerate_config = REPO / "configs" / "accelerate" / f"cpu_fsdp{run['version']}.yaml"
    with _environment(launcher_environment(accelerate_config)):
        plan = plan_config(run["config"], 2, 80 * 2**30)
    rank0 = read_json(run["dir"] / "memory.json")["ranks"][0]
    planned = {
        "parameter_bytes": plan.gpu["base weights (shard)"] + plan.gpu["adapter weights (shard)"],
        "gradient_bytes": plan.gpu["gradients (shard)"],
        "optimizer_state_bytes": plan.gpu["optimizer states (shard)"],
    }
    measured = {key: rank0[key] for key in planned}
    print(f"{run['variant']} FSDP{run['version']}: planned {planned}, measured {measured}")
    assert measured == planned


def test_new_tokens_export_and_generate_use_the_grown_vocabulary(tmp_path, tmp_path_factory, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_peft.tools.inference import load_for_generation

    run = two_rank_run("tokens", 2, tmp_path_factory, tiny_model_dir)
    adapter, out = run["dir"] / "adapter", tmp_path / "merged"
    script = (
        "import sys; from fsdp_peft.tools.export import export_merged; "
        f"export_merged({str(adapter)!r}, {str(out)!r}, dtype='fp32', progress=False); "
        "print(sorted(m for m in ('transformers', 'peft') if m in sys.modules))"
    )
    exported = run_command([sys.executable, "-c", script])
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert exported.stdout.strip().splitlines()[-1] == "[]"  # the streaming export stays torch-only
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = f"reverse: hello{NEW_TOKENS[0]}olleh{NEW_TOKENS[1]}"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    new_ids = tokenizer.convert_tokens_to_ids(NEW_TOKENS)
    base_vocab = read_json(tiny_model_dir / "config.json")["vocab_size"]
    assert new_ids == [base_vocab, base_vocab + 1] and set(new_ids) <= set(ids[0].tolist())
    assert tokenizer.decode(ids[0], skip_special_tokens=True) == text  # the new tokens decode as themselves
    assert read_json(out / "config.json")["vocab_size"] == base_vocab + 2
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    trained = PeftModel.from_pretrained(_fp32_base(tiny_model_dir, adapter), adapter).eval()
    loaded = load_for_generation(adapter, None, torch.device("cpu"))  # what `fsdp-peft generate` runs
    assert loaded.tokenizer.convert_tokens_to_ids(NEW_TOKENS) == new_ids
    assert not any(p.requires_grad for p in loaded.model.parameters())  # frozen: it keeps its merged weights
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        worst = {
            "export": (merged(input_ids=ids).logits - want).abs().max().item(),
            "generate": (loaded.model(input_ids=ids).logits - want).abs().max().item(),
        }
    print(f"new tokens: largest logit difference to the trained model (fp32): {worst}")
    assert want.shape[-1] == base_vocab + 2 and max(worst.values()) <= 1e-5, worst


def test_new_tokens_checkpoint_resumes_on_one_rank_with_the_uninterrupted_losses(
    tmp_path, tmp_path_factory, tiny_model_dir
):
    from transformers import AutoTokenizer

    run = two_rank_run("tokens", 2, tmp_path_factory, tiny_model_dir)
    checkpoint = run["dir"] / "checkpoint-3"
    assert read_new_tokens(checkpoint).rows == read_json(tiny_model_dir / "config.json")["vocab_size"] + 2
    assert (
        AutoTokenizer.from_pretrained(checkpoint).convert_tokens_to_ids(NEW_TOKENS) == read_new_tokens(checkpoint).ids
    )
    config = variant_config(tmp_path, "tokens", 2 * PER_RANK_BATCH)  # the same global batch on one rank
    accelerate_config = REPO / "configs" / "accelerate" / "cpu_fsdp2.yaml"  # its sharded state, resharded
    launch_recipe(
        "llama_lora",
        "--config",
        str(config),
        "--resume_from_checkpoint",
        str(checkpoint),
        processes=1,
        accelerate_config=accelerate_config,
    )
    resumed, uninterrupted = logged_losses(tmp_path / "out"), logged_losses(run["dir"])
    worst = max(abs(resumed[step] - uninterrupted[step]) / uninterrupted[step] for step in (4, 5))
    print(f"new tokens: 2-rank checkpoint-3 resumed on one rank, steps 4-5 vs uninterrupted: {worst:.2e} relative")
    assert worst <= 1e-5, (resumed, uninterrupted)
