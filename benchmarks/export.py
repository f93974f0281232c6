"""Export benchmark: fsdp-peft's streaming merge against transformers + peft, each in its own process.

Builds once (cached in $FSDP_PEFT_BENCH_DIR, default ~/.cache/fsdp_peft/bench_export) a random-weight
Llama-architecture checkpoint of about 1.1B parameters in bf16, written in 4+ safetensors shards, and a
rank-16 LoRA adapter on all linear layers. Then it measures wall time and peak RSS of

- ``ours``: ``fsdp_peft.tools.export.export_merged(adapter, out, dtype="bf16", max_shard_size=...)``
- ``transformers``: ``from_pretrained`` + ``PeftModel.from_pretrained`` + ``merge_and_unload`` +
  ``save_pretrained`` with the same shard size,

``variants``: ours on a variant adapter of the same base (DoRA magnitudes and rsLoRA on every linear
layer, plus a trained copy of ``lm_head`` as ``modules_to_save``), whose peak RSS should stay within the
plain adapter's; and ``disk``: the same bytes moved with plain file reads and writes (every base shard read in 64 MiB
blocks, as many bytes written to output files), the disk-bound time of this machine in the same run.
The three run alternately ``--reps`` times, each in a fresh process; it prints the medians and their
ratios, and writes ``benchmarks/results/export.json``.

    python benchmarks/export.py                 # build if needed, then 5 alternating repetitions
    python benchmarks/export.py --reps 7 --shard 500MB
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
RANK = 16
INPUT_SHARD_BYTES = 600 * 10**6


def bench_dir() -> Path:
    return Path(os.environ.get("FSDP_PEFT_BENCH_DIR", Path.home() / ".cache" / "fsdp_peft" / "bench_export"))


def tensor_shapes() -> dict[str, tuple[int, ...]]:
    """Every weight of the Llama configuration above, in checkpoint order."""
    h, i, layers = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["num_hidden_layers"]
    kv = h // CONFIG["num_attention_heads"] * CONFIG["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (CONFIG["vocab_size"], h)}
    for n in range(layers):
        p = f"model.layers.{n}"
        shapes.update(
            {
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.self_attn.q_proj.weight": (h, h),
                f"{p}.self_attn.k_proj.weight": (kv, h),
                f"{p}.self_attn.v_proj.weight": (kv, h),
                f"{p}.self_attn.o_proj.weight": (h, h),
                f"{p}.post_attention_layernorm.weight": (h,),
                f"{p}.mlp.gate_proj.weight": (i, h),
                f"{p}.mlp.up_proj.weight": (i, h),
                f"{p}.mlp.down_proj.weight": (h, i),
            }
        )
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (CONFIG["vocab_size"], h)})
    return shapes


def build(directory: Path) -> None:
    """Random bf16 base in shards of ~600 MB with an index, tokenizer files, and the LoRA adapter."""
    from safetensors.torch import save_file

    from fsdp_peft.model.tiny import TINY_MODEL_ASSETS

    base, adapter = directory / "base", directory / "adapter"
    if (base / "model.safetensors.index.json").is_file() and (adapter / "adapter_model.safetensors").is_file():
        if not (directory / "adapter_variants" / "adapter_config.json").is_file():  # a cache from before it existed
            build_variant_adapter(directory)
        return
    shutil.rmtree(directory, ignore_errors=True)
    base.mkdir(parents=True)
    adapter.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    shapes = tensor_shapes()
    weight_map, shard, shard_bytes, files = {}, {}, 0, []

    def flush():
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, base / name, metadata={"format": "pt"})
        files.append(name)
        weight_map.update({key: name for key in shard})
        shard, shard_bytes = {}, 0

    for key, shape in shapes.items():
        tensor = (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=generator) * 0.02).bfloat16()
        shard[key] = tensor
        shard_bytes += tensor.numel() * 2
        if shard_bytes >= INPUT_SHARD_BYTES:
            flush()
    if shard:
        flush()
    total = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (base / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (base / "config.json").write_text(json.dumps(CONFIG, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY_MODEL_ASSETS / name, base / name)

    lora = {}
    for key, shape in shapes.items():
        if len(shape) == 2 and ".layers." in key:
            prefix = "base_model.model." + key.removesuffix(".weight")
            lora[f"{prefix}.lora_A.weight"] = torch.randn(RANK, shape[1], generator=generator) * 0.01
            lora[f"{prefix}.lora_B.weight"] = torch.randn(shape[0], RANK, generator=generator) * 0.01
    save_file(lora, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "base_model_name_or_path": str(base),
        "bias": "none",
        "fan_in_fan_out": False,
    }
    (adapter / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
    build_variant_adapter(directory)
    print(f"built {sum(torch.Size(s).numel() for s in shapes.values()) / 1e9:.2f}B parameters in {len(files)} shards")


def build_variant_adapter(directory: Path) -> None:
    """The plain adapter plus DoRA magnitudes (near 1 per output row), rsLoRA and a trained copy of lm_head."""
    from safetensors.torch import load_file, save_file

    variant, shapes = directory / "adapter_variants", tensor_shapes()
    variant.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1)
    tensors = load_file(directory / "adapter" / "adapter_model.safetensors")
    adapter_config = json.loads((directory / "adapter" / "adapter_config.json").read_text())
    for key, shape in shapes.items():
        if len(shape) == 2 and ".layers." in key:
            prefix = "base_model.model." + key.removesuffix(".weight")
            tensors[f"{prefix}.lora_magnitude_vector"] = 1 + torch.rand(shape[0], generator=generator) * 0.01
    head = shapes["lm_head.weight"]
    tensors["base_model.model.lm_head.weight"] = (torch.randn(head, generator=generator) * 0.02).bfloat16()
    save_file(tensors, variant / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {**adapter_config, "use_dora": True, "use_rslora": True, "modules_to_save": ["lm_head"]}
    (variant / "adapter_config.json").write_text(json.dumps(config, indent=1))


def run_ours(directory: Path, out: Path, shard: str, adapter: str = "adapter") -> None:
    from fsdp_peft.tools.export import export_merged

    export_merged(
        directory / adapter,
        out,
        base=str(directory / "base"),
        dtype="bf16",
        max_shard_size=shard,
        overwrite=True,
        progress=False,
    )


def run_variants(directory: Path, out: Path, shard: str) -> None:
    run_ours(directory, out, shard, adapter="adapter_variants")


def run_transformers(directory: Path, out: Path, shard: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory / "base", dtype=torch.bfloat16)
    merged = PeftModel.from_pretrained(model, directory / "adapter").merge_and_unload()
    shutil.rmtree(out, ignore_errors=True)
    merged.save_pretrained(out, max_shard_size=shard)


def run_disk(directory: Path, out: Path, shard: str) -> None:
    """Read every base shard and write as many bytes: what the export costs at disk speed."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    block = 64 * 2**20
    for source in sorted((directory / "base").glob("*.safetensors")):
        with open(source, "rb") as reading, open(out / source.name, "wb") as writing:
            while data := reading.read(block):
                writing.write(data)


def peak_rss_kib() -> int:
    """This process's peak RSS since its exec (``VmHWM``). Not ``ru_maxrss``: Linux carries that over from
    the parent across fork + exec, so a child of a large parent (one that just built the checkpoint)
    would report the parent's size as its own."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(mode: str, directory: Path, shard: str) -> dict:
    """Run one path in a fresh process; its own high-water RSS (`peak_rss_kib`) is the peak RSS."""
    out = directory / f"out_{mode}"
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--shard", shard], capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{result.stderr[-3000:]}")
    peak_kib = int(result.stdout.strip().splitlines()[-1])
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": round(seconds, 2), "peak_rss_gib": round(peak_kib / 2**20, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", default="500MB", help="output shard size for both paths")
    parser.add_argument("--reps", type=int, default=5, help="alternating repetitions of the three paths")
    parser.add_argument("--child", choices=list(RUNNERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    directory = bench_dir()
    if args.child:
        RUNNERS[args.child](directory, directory / f"out_{args.child}", args.shard)
        print(peak_rss_kib())
        return
    build(directory)
    runs = {mode: [] for mode in RUNNERS}
    for _ in range(args.reps):
        for mode in RUNNERS:
            runs[mode].append(measure(mode, directory, args.shard))
    median = {
        mode: {key: statistics.median(run[key] for run in done) for key in ("seconds", "peak_rss_gib")}
        for mode, done in runs.items()
    }
    ours, theirs, disk = median["ours"], median["transformers"], median["disk"]
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "parameters": sum(torch.Size(s).numel() for s in tensor_shapes().values()),
        "output_shard": args.shard,
        "repetitions": args.reps,
        "runs": runs,
        "fsdp_peft_export": ours,
        "transformers_peft_merge": theirs,
        "disk_bound": disk,
        "peak_rss_ratio": round(ours["peak_rss_gib"] / theirs["peak_rss_gib"], 3),
        "wall_time_ratio": round(ours["seconds"] / theirs["seconds"], 3),
        "wall_time_over_disk_bound": round(ours["seconds"] / disk["seconds"], 3),
        "variant_adapter_export": median["variants"],
        "variant_peak_rss_over_plain": round(median["variants"]["peak_rss_gib"] / ours["peak_rss_gib"], 3),
    }
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "export.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


RUNNERS = {"ours": run_ours, "transformers": run_transformers, "disk": run_disk, "variants": run_variants}

if __name__ == "__main__":
    main()
