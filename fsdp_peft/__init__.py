"""fsdp-peft: LoRA and QLoRA fine-tuning recipes sharded with FSDP through the Hugging Face Trainer."""

import logging

# bitsandbytes warns on import, on AVX512-BF16 CPUs, that it could not fetch a kernel from the hub for
# its packed CPU weight layout. fsdp-peft switches that layout off (it corrupts FSDP shards, see
# fsdp_peft.modeling.disable_cpu_weight_repacking), so the warning only misleads.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

__version__ = "0.1.0"
