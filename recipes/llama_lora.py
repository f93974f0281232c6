"""LoRA fine-tuning of a Llama model, sharded with FSDP, through the Hugging Face Trainer.

What it does: loads the base in 16 bits (fp32 for the embedded tiny model), puts LoRA on all linear
layers, trains on prompt/completion data with the prompt masked out of the loss, saves the adapter in
PEFT format (gathered from the shards) under ``output_dir/adapter``, then generates greedily from the
still-sharded model on the held-out prompts and reports exact-match accuracy before and after training
(``output_dir/samples.jsonl``).

With no ``--config`` it runs the embedded tiny Llama on the embedded string-reversal data
(``configs/llama_lora/tiny.yaml``), which needs no GPU and no network.

    # 2 CPU processes, real FSDP2 over gloo
    accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml recipes/llama_lora.py
    # GPUs of one machine, a real model; any key can be overridden with --key value
    accelerate launch --config_file configs/accelerate/fsdp2.yaml recipes/llama_lora.py \
        --config configs/llama_lora/llama3_1_8b.yaml --learning_rate 1e-4
    # one process, no FSDP
    python recipes/llama_lora.py --max_steps 50
"""

from pathlib import Path

from fsdp_peft.recipe import run_recipe

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "llama_lora" / "tiny.yaml"

if __name__ == "__main__":
    run_recipe("llama_lora", DEFAULT_CONFIG)
