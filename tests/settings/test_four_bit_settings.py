"""QLoRA's 4-bit settings as one record (`fsdp_peft.settings.four_bit`): the recipe's keys default to it, a saved
recipe reads back into it, and bitsandbytes' config is built from it alone."""

from __future__ import annotations

import dataclasses

import torch

from fsdp_peft.settings.config import RecipeArguments
from fsdp_peft.settings.four_bit import DEFAULTS, KEYS, FourBit


def test_the_recipes_keys_take_their_defaults_from_the_record():
    recipe = RecipeArguments(load_in_4bit=True)
    assert FourBit.of(recipe) == DEFAULTS
    assert FourBit.of(RecipeArguments()) is None  # a 16-bit base has no 4-bit settings
    assert set(KEYS) == {field.name for field in dataclasses.fields(FourBit)}
    declared = {field.name: field.default for field in dataclasses.fields(RecipeArguments)}
    assert {key: declared[key] for key in KEYS.values()} == {
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "bfloat16",
        "bnb_4bit_quant_storage": "bfloat16",
    }


def test_a_saved_recipe_reads_back_its_settings_and_the_defaults_for_keys_it_lacks():
    recipe = RecipeArguments(
        load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False, bnb_4bit_compute_dtype="fp32"
    )
    saved = dataclasses.asdict(recipe)
    assert FourBit.saved(saved) == FourBit.of(recipe) == FourBit("fp4", False, "float32", "bfloat16")
    assert FourBit.saved({"bnb_4bit_quant_type": "fp4"}) == dataclasses.replace(DEFAULTS, quant_type="fp4")
    assert FourBit.saved({}) == DEFAULTS


def test_bitsandbytes_config_holds_the_record():
    four_bit = FourBit("fp4", False, "float16", "float32")
    config = four_bit.bitsandbytes_config(["visual"])
    assert config.load_in_4bit and config.llm_int8_skip_modules == ["visual"]
    assert (config.bnb_4bit_quant_type, config.bnb_4bit_use_double_quant) == ("fp4", False)
    assert (config.bnb_4bit_compute_dtype, config.bnb_4bit_quant_storage) == (torch.float16, torch.float32)
    assert (four_bit.compute, four_bit.storage) == (torch.float16, torch.float32)
