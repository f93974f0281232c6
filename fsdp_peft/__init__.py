"""fsdp-peft: LoRA and QLoRA fine-tuning recipes sharded with FSDP through the Hugging Face Trainer."""

from fsdp_peft.core._compat.import_hook import install

install()  # before anything imports bitsandbytes (fsdp_peft.core._compat.import_hook)

__version__ = "0.1.0"
