"""Vision-language runs (``vlm``): ``recipes/qwen_vl_qlora.py`` then ``qwen_vl_lora.py``, each launched as users
launch it (FSDP2, one rank), on Qwen2.5-VL 7B's shape with random weights (`models.vision_checkpoint_path`: its
published config, the vision tower's 32 blocks included, 8.29B parameters) over the embedded colour task's rows with
their images resized to 448x448 (256 image tokens; a quarter of the rows text only, so the blank-image path of
`fsdp_peft.model.vision` runs too), 8 rows of up to 320 tokens a step, 6 steps, LoRA r=16 on the language model's
projections, activation checkpointing: tokens/s over the whole training (first step included), peak GPU memory next
to the plan, the parameter, gradient and optimizer bytes next to the plan's, losses finite. The dry run: the QLoRA
run on the embedded tiny-qwen2.5-vl, 3 steps.
"""

from __future__ import annotations

from pathlib import Path

from gpu_checks.common import (
    LORA,
    RUN_MINIMUM_SECONDS,
    VISION_SIZES,
    budget_left,
    checkpoint,
    planned,
    recipe_run,
    recipe_training,
    scratch_directory,
    write_yaml,
)

VISION_RUNS = ("qlora", "lora")  # most important first


VISION_DRY_RUNS = ("qlora",)  # CI's time: the LoRA run differs in load_in_4bit only


def vision_check(
    shape: str, methods, device: str, gpu_memory: int, args, report: dict, started: float, measured
) -> None:
    """The vision-language runs: each recipe launched (FSDP2, one rank) on ``shape``, its plan beside it; ``measured``
    (the driver's) runs one, records it in ``report`` and prints it."""
    path = checkpoint(shape, device) if budget_left(args, started) >= RUN_MINIMUM_SECONDS else ""  # else skipped
    for method in methods:
        entry: dict = {"model": shape, "method": method, "impl": "fsdp-peft vlm"}
        if budget_left(args, started) >= RUN_MINIMUM_SECONDS:
            directory = scratch_directory(f"gpu_check_vlm_{method}_")
            config = vision_yaml(directory, path, method, VISION_SIZES[shape])
            entry["planned"] = planned(config, gpu_memory)
        measured(entry, lambda left: recipe_run(f"qwen_vl_{method}", config, left), args, report, started)


def vision_yaml(directory: Path, model: str, method: str, size: dict) -> Path:
    """The config of a vision-language run (also what the planner reads)."""
    values = {
        "model_name_or_path": model,
        "torch_dtype": "bfloat16",
        "load_in_4bit": method == "qlora",
        "bnb_4bit_quant_storage": "bfloat16",
        **LORA,
        "lora_target_modules": ["auto"],  # the language model's projections (peft's all-linear would reach the tower)
        "dataset": "tiny-colors",
        "max_seq_length": size["seq"],
        "generate_samples": 0,
        "per_device_train_batch_size": size["batch"],
        **recipe_training(directory, size["steps"], learning_rate=1e-4),
    }
    return write_yaml(directory / "vlm.yaml", values)
