"""LoRA variants (`fsdp_peft.variants`) end to end on 2 real gloo ranks, against one unsharded process.

Variants are combined so that seven 2-rank runs cover them: DoRA + rsLoRA + rank/alpha patterns + a trained
``lm_head`` copy + EVA init (FSDP2 and FSDP1), trainable tokens + OLoRA init, LoRA on the embedding + PiSSA
init, QDoRA with a trained head copy (FSDP2 and FSDP1), and PiSSA on the 4-bit base (its residual read by
low-memory loading). Each run is compared with one process with the same global batch and seed;
its saved adapter is reloaded by plain peft, its export compared with peft's ``merge_and_unload()`` and its
measured per-rank bytes with the planner's.
"""

from __future__ import annotations

import json
import math
import re
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO, launch_recipe, read_json, run_command, tiny_llama_in_4bit
from fsdp_peft.cli import _environment, launcher_environment
from fsdp_peft.config import RecipeArguments
from fsdp_peft.data import IGNORE_INDEX, data_files, read_examples, tokenized_dataset
from fsdp_peft.export import export_merged
from fsdp_peft.plan import plan_memory
from fsdp_peft.recipe import parse_recipe_config
from fsdp_peft.runs import EVA_INIT_FILE

STEPS = 5
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
    "tokens": ("llama_lora", {"trainable_token_indices": [3, 5, 7], "init_lora_weights": "olora"}),
    "embedding": (
        "llama_lora",
        {"lora_target_modules": ["q_proj", "v_proj", "embed_tokens"], "init_lora_weights": "pissa_niter_4"},
    ),
    "qdora": ("llama_qlora", {"use_dora": True, "lora_modules_to_save": ["lm_head"]}),
    "qpissa": ("llama_qlora", {"init_lora_weights": "pissa_niter_4"}),  # 4-bit residual, low-memory loading
}
# what each variant adds to the trainable tensors, as named in the FSDP layout report
VARIANT_TENSORS = {
    "dora": ("lora_magnitude_vector", "lm_head.modules_to_save"),
    "tokens": ("trainable_tokens_delta",),
    "embedding": ("lora_embedding_A", "lora_embedding_B"),
    "qdora": ("lora_magnitude_vector", "lm_head.modules_to_save"),
    "qpissa": ("lora_A", "lora_B"),
}
LAUNCHER_SETTINGS = {"qpissa": {"fsdp_cpu_ram_efficient_loading": "true"}}  # rank 0 reads the residual, scatters
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
    path = directory / "config.yaml"
    path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in values.items()))
    return path


FSDP2_RUNS = [("dora", 2), ("tokens", 2), ("embedding", 2), ("qdora", 2), ("qpissa", 2)]
RUNS = [*FSDP2_RUNS, ("dora", 1), ("qdora", 1)]
_runs: dict = {}


def two_rank_run(variant: str, version: int, tmp_path_factory, model_dir) -> dict:
    """One 2-rank run of the variant under the FSDP version's CPU accelerate config (cached)."""
    if (variant, version) not in _runs:
        directory = tmp_path_factory.mktemp(f"{variant}_fsdp{version}")
        config = variant_config(directory, variant, PER_RANK_BATCH)
        accelerate_config = REPO / "configs" / "accelerate" / f"cpu_fsdp{version}.yaml"
        if variant in LAUNCHER_SETTINGS:
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


@pytest.fixture(params=FSDP2_RUNS, ids=lambda p: f"{p[0]}-fsdp{p[1]}")
def fsdp2_run(request, tmp_path_factory, tiny_model_dir):
    return two_rank_run(*request.param, tmp_path_factory, tiny_model_dir)


_single_runs: dict = {}


def single_process_run(variant: str, tmp_path_factory):
    """The same variant, seed and global batch in one process without FSDP (cached per variant)."""
    if variant not in _single_runs:
        directory = tmp_path_factory.mktemp(f"{variant}_single")
        config = variant_config(directory, variant, 2 * PER_RANK_BATCH)
        recipe = REPO / "recipes" / f"{VARIANTS[variant][0]}.py"
        result = run_command([sys.executable, str(recipe), "--config", str(config)])
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
    if run["variant"] in LAUNCHER_SETTINGS:  # the residual checkpoint went through low-memory loading
        assert "[fsdp-peft] pissa_niter_4: initial adapter in " in run["stdout"]
        assert "[fsdp-peft] low-memory loading: rank 0 read 39 tensors of" in run["stdout"]
    layout = read_json(run["dir"] / "fsdp_layout.json")
    trainable = [p for p in layout["parameters"] if p["trainable"]]
    for marker in VARIANT_TENSORS[run["variant"]]:
        holders = [p for p in trainable if marker in p["name"]]
        assert holders, f"no trainable {marker} in the layout report"
        if run["version"] == 1:  # its own unit: one flat parameter, uniform fp32, apart from frozen tensors
            assert all(p["name"].endswith("._flat_param") and p["dtype"] == "float32" for p in holders)
            assert {p["name"].removesuffix("._flat_param") for p in holders} <= set(layout["units"])
    for parameter in trainable:  # every trainable tensor is split over both ranks
        full, local = math.prod(parameter["shape"]), math.prod(parameter["local_shape"])
        assert math.ceil(full / 2) <= local < full, parameter["name"]
        assert parameter["dtype"] == "float32", parameter["name"]  # fp32 master weights, QLoRA included


def _eval_loss(model, model_dir, autocast: bool) -> float:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    recipe = RecipeArguments(max_seq_length=64)
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


def _fp32_base(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _trained_adapter_on_the_residual(run, directory):
    """PiSSA-QLoRA trained against the 4-bit residual; its saved adapter is peft's conversion for the original
    base (``[A; A0]``, ``[B, -B0]``, rank 2r), whose first r ranks are the trained A and B: plain peft loads
    those on the residual checkpoint (the run's cached one)."""
    from peft import PeftConfig

    from fsdp_peft.modeling import initialisation_checkpoint

    recipe, training = parse_recipe_config(["--config", str(run["config"])], run["config"], str(run["dir"]))
    residual, _ = initialisation_checkpoint(recipe, str(run["model"]), training, torch.device("cpu"))
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
        base = tiny_llama_in_4bit(run["model"]) if qlora else _fp32_base(run["model"])
    for module in base.modules():  # the reference must not take bitsandbytes' CPU repacking path either
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    model = PeftModel.from_pretrained(base, adapter).eval()
    reloaded = _eval_loss(model, run["model"], autocast=qlora)
    trained = read_json(run["dir"] / "results.json")["eval_loss"]
    print(f"{run['variant']} FSDP{run['version']}: eval loss {trained:.6f}, reloaded with plain peft {reloaded:.6f}")
    assert abs(trained - reloaded) <= 1e-4, (trained, reloaded)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in fp32 units in the last place between two tensors of the same signs."""
    if torch.equal(a, b):
        return 0
    return int((a.contiguous().view(torch.int32).long() - b.contiguous().view(torch.int32).long()).abs().max())


def test_export_equals_peft_merge_and_unload_in_fp32(fsdp2_run, tmp_path):
    from peft import PeftModel

    run = fsdp2_run
    out = export_merged(run["dir"] / "adapter", tmp_path / "merged", dtype="fp32", progress=False)
    exported = {}
    for path in sorted(out.glob("*.safetensors")):
        exported.update(load_file(path))
    merged = PeftModel.from_pretrained(_fp32_base(run["model"]), run["dir"] / "adapter").merge_and_unload()
    expected, base = merged.state_dict(), _fp32_base(run["model"]).state_dict()
    assert set(exported) == set(expected)
    distances = {key: _ulps(exported[key], expected[key]) for key in exported}
    changed = sum(not torch.equal(exported[key], base[key]) for key in exported)
    print(
        f"{run['variant']}: export vs peft merge_and_unload, {len(distances)} tensors ({changed} changed by the "
        f"adapter): {sum(d == 0 for d in distances.values())} bit-identical, largest {max(distances.values())} ulp"
    )
    assert max(distances.values()) <= 1, {k: d for k, d in distances.items() if d > 1}
    assert changed >= len(VARIANT_TENSORS[run["variant"]])


def test_planned_bytes_per_rank_equal_the_measured_ones(fsdp2_run):
    run = fsdp2_run
    with _environment(launcher_environment(REPO / "configs" / "accelerate" / "cpu_fsdp2.yaml")):
        plan = plan_memory(run["config"], 2, 80 * 2**30)
    rank0 = read_json(run["dir"] / "memory.json")["ranks"][0]
    planned = {
        "parameter_bytes": plan.gpu["base weights (shard)"] + plan.gpu["adapter weights (shard)"],
        "gradient_bytes": plan.gpu["gradients (shard)"],
        "optimizer_state_bytes": plan.gpu["optimizer states (shard)"],
    }
    measured = {key: rank0[key] for key in planned}
    print(f"{run['variant']}: planned {planned}, measured {measured}")
    assert measured == planned
