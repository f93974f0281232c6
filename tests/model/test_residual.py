"""PiSSA, OLoRA and LoftQ on a 4-bit base (`fsdp_peft.model.residual`): computed once from the full-precision
checkpoint, the initial 4-bit model is closer to the full-precision model than plain QLoRA's, as the methods
promise; the residual checkpoint is written once, atomically, and reused."""

from __future__ import annotations

import dataclasses

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, set_seed

from conftest import REPO
from fsdp_peft.model.model_record import record_of
from fsdp_peft.model.modeling import attach_lora, load_base_model
from fsdp_peft.model.paths import cache_dir
from fsdp_peft.model.residual import INITIAL_ADAPTER
from fsdp_peft.model.variants import converted_adapter_config
from fsdp_peft.procedures.trainer import write_adapter, write_adapter_metadata
from fsdp_peft.recipe import parse_recipe_config
from fsdp_peft.tools.export import export_merged
from fsdp_peft.tools.inference import load_for_generation

QLORA_TINY = REPO / "configs" / "llama_qlora" / "tiny.yaml"


def initial_model(init: str, output_dir, with_recipe: bool = False):
    """The recipe's initial model (4-bit base + initial adapter), as ``start_training`` builds it."""
    argv = ["--config", str(QLORA_TINY), "--output_dir", str(output_dir), "--init_lora_weights", init]
    recipe, training = parse_recipe_config(argv, QLORA_TINY, str(output_dir))
    set_seed(training.seed)
    base = load_base_model(recipe, training)
    model = attach_lora(base, recipe, training).train()  # train(): no CPU repacking of 4-bit weights
    return (base, model, recipe) if with_recipe else (base, model)


def logits_error(model, reference: torch.Tensor, ids: torch.Tensor) -> float:
    """Relative Frobenius error of the logits against the full-precision model's (bf16 autocast, as trained)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits.float()
    return ((logits - reference).norm() / reference.norm()).item()


def test_pissa_and_loftq_start_closer_to_the_full_precision_model_than_plain_qlora(tmp_path, tiny_model_dir):
    ids = torch.randint(0, 256, (8, 48), generator=torch.Generator().manual_seed(0))
    full = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        reference = full(input_ids=ids).logits
    errors, bases = {}, {}
    for init in ("default", "pissa_niter_4", "loftq"):
        base, model = initial_model(init, tmp_path / init)
        errors[init], bases[init] = logits_error(model, reference, ids), base
    print("initial logits error vs the full-precision model: " + ", ".join(f"{k} {v:.4f}" for k, v in errors.items()))
    assert errors["pissa_niter_4"] < errors["default"]
    assert errors["loftq"] < errors["default"]

    # PiSSA's residual is W - scale * B0 @ A0, exactly (in fp32); LoftQ with loftq_iter 1 keeps the original base
    source = record_of(bases["pissa_niter_4"]).initial_adapter_file
    residual = load_file(source.parent / "model.safetensors")
    original, adapter = load_file(tiny_model_dir / "model.safetensors"), load_file(source)
    name, scale = "model.layers.0.self_attn.q_proj", 128 / 32
    rebuilt = residual[f"{name}.weight"] + scale * adapter[f"{name}.lora_B"] @ adapter[f"{name}.lora_A"]
    assert torch.allclose(rebuilt, original[f"{name}.weight"], rtol=0, atol=1e-6)
    assert not torch.equal(residual[f"{name}.weight"], original[f"{name}.weight"])
    assert bases["loftq"].name_or_path == str(tiny_model_dir)


def test_the_residual_checkpoint_is_written_once_atomically_and_reused(tmp_path, tiny_model_dir):
    first, _ = initial_model("olora", tmp_path / "first")
    source = record_of(first).initial_adapter_file
    written = source.stat().st_mtime_ns
    again, model = initial_model("olora", tmp_path / "again")  # a resume, or another run of the same settings
    assert record_of(again).initial_adapter_file == source and source.stat().st_mtime_ns == written
    assert again.name_or_path == str(source.parent)  # trained against the residual, saved for the original base
    assert model.peft_config["default"].base_model_name_or_path == str(tiny_model_dir)
    assert model.peft_config["default"].init_lora_weights == "olora"  # a checkpoint's adapter: export refuses it
    files = {p.name for p in source.parent.iterdir()}
    assert files == {p.name for p in tiny_model_dir.iterdir()} | {INITIAL_ADAPTER}  # same names, configs copied
    staging = list((cache_dir() / "initialisations").glob(f".{source.parent.name}.*"))
    assert not staging  # none left (by this initialisation: the cache is shared with the other test process)


def test_a_loftq_adapter_exports_onto_the_original_16bit_base(tmp_path, tiny_model_dir):
    """LoftQ's 4-bit base approximates ``W - scale * B0 @ A0``: the saved adapter is converted as PiSSA's is
    (``[A; A0]``, ``[B, -B0]``), so export on the original 16-bit base gives ``W + scale * (B @ A - B0 @ A0)``;
    ``fsdp-peft generate`` runs the same model (the original base, unquantized)."""
    _, model, recipe = initial_model("loftq", tmp_path / "run", with_recipe=True)
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    name = "model.layers.0.self_attn.q_proj"
    step = 1e-2 * torch.randn(trained[f"base_model.model.{name}.lora_B.default.weight"].shape)
    trained[f"base_model.model.{name}.lora_B.default.weight"] += step  # what training changed
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    write_adapter(model, trained, adapter)
    write_adapter_metadata(model, dataclasses.asdict(recipe), adapter)
    converted_adapter_config(model).save_pretrained(adapter)
    out = export_merged(adapter, tmp_path / "merged", base=str(tiny_model_dir), dtype="fp32", progress=False)
    merged, original = load_file(out / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    initial_a = trained[f"base_model.model.{name}.lora_A.default.weight"]
    expected = original[f"{name}.weight"] + (128 / 32) * step @ initial_a
    assert torch.allclose(merged[f"{name}.weight"], expected, rtol=0, atol=1e-6)
    untouched = "model.layers.1.mlp.up_proj.weight"  # LoftQ's correction cancels where nothing was trained
    assert torch.allclose(merged[untouched], original[untouched], rtol=0, atol=1e-6)

    loaded = load_for_generation(adapter, None, torch.device("cpu")).model.get_base_model()
    layer = loaded.model.layers[0].self_attn.q_proj
    assert type(layer.base_layer) is torch.nn.Linear  # not 4-bit: the converted adapter belongs on W itself
    generated = layer.base_layer.weight.float() + layer.get_delta_weight("default").float()
    assert torch.allclose(generated, merged[f"{name}.weight"], rtol=0, atol=1e-3)  # bf16 model vs fp32 export
