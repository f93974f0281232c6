"""QLoRA's 4-bit settings as one frozen record, their defaults written once.

`FourBit.of(recipe)` is the record of a recipe that loads its base in 4 bits (``None`` for a 16-bit base);
`FourBit.saved(recipe)` reads it from the recipe an adapter directory keeps, the keys an older run did not write
taking the defaults. The recipe's ``bnb_4bit_*`` keys default to `DEFAULTS`; the model build
(`fsdp_peft.model.modeling`: bitsandbytes' config), the 4-bit experts of a mixture of experts
(`fsdp_peft.model.moe_quantization`), the export's NF4 base variant (`fsdp_peft.tools.export`) and the plan
(`fsdp_peft.tools.plan`) take this record rather than the keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUANT_TYPES = ("nf4", "fp4")
STORAGE_DTYPES = ("bfloat16", "float16", "float32", "uint8", "int8")  # FSDP shards the floating ones
BLOCKSIZE = 64  # bitsandbytes' 4-bit block: one absmax per 64 weights
NESTED_BLOCKSIZE = 256  # double quantization: one fp32 scale per 256 absmaxes (bitsandbytes' own)


@dataclass(frozen=True)
class FourBit:
    """How a 4-bit base is quantized, computed with and stored (its field ``x`` is the recipe key ``KEYS[x]``)."""

    quant_type: str = "nf4"
    double_quant: bool = True  # the absmaxes quantized too, in groups of `NESTED_BLOCKSIZE`
    compute_dtype: str = "bfloat16"  # what a 4-bit weight is dequantized to for its matmul
    storage_dtype: str = "bfloat16"  # the dtype the packed bytes are viewed in: FSDP's gather dtype

    @classmethod
    def of(cls, recipe) -> FourBit | None:
        """The record of a `fsdp_peft.settings.config.RecipeArguments`, ``None`` unless it sets ``load_in_4bit``."""
        if not recipe.load_in_4bit:
            return None
        return cls(**{name: getattr(recipe, key) for name, key in KEYS.items()})

    @classmethod
    def saved(cls, recipe: dict) -> FourBit:
        """The record of a saved recipe (an adapter's ``fsdp_peft_recipe.json``); keys it lacks take the defaults."""
        return cls(**{name: recipe[key] for name, key in KEYS.items() if key in recipe})

    @property
    def compute(self) -> torch.dtype:
        return getattr(torch, self.compute_dtype)

    @property
    def storage(self) -> torch.dtype:
        return getattr(torch, self.storage_dtype)

    def bitsandbytes_config(self, skip_modules: list[str]):
        """transformers' ``BitsAndBytesConfig`` for loading a base in these 4 bits, ``skip_modules`` kept 16-bit (a
        VLM's tower)."""
        from transformers import BitsAndBytesConfig  # lazy: `fsdp-peft export` reads the record without transformers

        return BitsAndBytesConfig(
            load_in_4bit=True,
            llm_int8_skip_modules=skip_modules,
            bnb_4bit_quant_type=self.quant_type,
            bnb_4bit_use_double_quant=self.double_quant,
            bnb_4bit_compute_dtype=self.compute,
            bnb_4bit_quant_storage=self.storage,
        )


KEYS = {
    "quant_type": "bnb_4bit_quant_type",
    "double_quant": "bnb_4bit_use_double_quant",
    "compute_dtype": "bnb_4bit_compute_dtype",
    "storage_dtype": "bnb_4bit_quant_storage",
}
DEFAULTS = FourBit()
