"""Loading benchmark: host memory of 2 CPU ranks while they load and shard a model, with and without
low-memory loading (``--fsdp_cpu_ram_efficient_loading true``), for LoRA (fp32) and QLoRA (nf4, bf16).

Each configuration is one ``accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml`` of
``tests/distributed/loading_check.py --no-train``: every rank samples its own RSS every 2 ms from just
before the model is built until training would begin (read or build, attach LoRA, shard, fill).
Figures are RSS growth over each rank's RSS before loading:

- ``host_peak``: the largest sum of both ranks' RSS at the same moment (what the host must hold);
- ``sum_of_rank_peaks``: each rank's own peak, summed (an upper bound of the above);
- ``anonymous``: the same without file-backed pages: ``from_pretrained`` memory-maps the checkpoint, and
  those pages, shared by the ranks, count in the RSS of each (low-memory loading reads with plain reads);

each also as a multiple of one copy of the model in its load dtype (fp32 for LoRA, bf16 for QLoRA).
Models: the embedded tiny model and the ~134M-parameter Llama of ``benchmarks/models.py``.

    python benchmarks/loading.py                 # all 8 runs; writes benchmarks/results/loading.json
    python benchmarks/loading.py --models tiny   # only the tiny model
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

LOAD_DTYPE_BYTES = {"lora": 4, "qlora": 2}  # fp32 LoRA; QLoRA loads in bf16 before quantizing


def model_path(name: str) -> Path:
    if name == "tiny":
        from fsdp_peft.model.paths import tiny_model_path

        return Path(tiny_model_path())
    from models import llama_100m_path

    return llama_100m_path()


def parameter_count(path: Path) -> int:
    """Parameters in the checkpoint, from the safetensors headers alone."""
    import math

    from fsdp_peft.core.safetensors_io import base_tensor_files, read_header

    headers = {file: read_header(file) for file in set(base_tensor_files(path).values())}
    entries = [entry for header in headers.values() for key, entry in header.items() if key != "__metadata__"]
    return sum(math.prod(entry["shape"]) for entry in entries)


def launch(path: Path, kind: str, low_memory: bool, out: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs" / "accelerate" / "cpu_fsdp2.yaml"),
        "--num_processes",
        "2",
        "--main_process_port",
        str(29700 + (hash((str(path), kind, low_memory)) % 200)),
        "--fsdp_cpu_ram_efficient_loading",
        str(low_memory).lower(),
        str(REPO / "tests" / "distributed" / "loading_check.py"),
        "--out",
        str(out),
        "--model",
        str(path),
        "--no-train",
        *(["--qlora"] if kind == "qlora" else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    report = json.loads([line for line in result.stdout.splitlines() if line.startswith('{"low_memory')][-1])
    assert report["low_memory_loading"] == low_memory
    return report


def rss_figures(samples: list[list[tuple[float, int, int]]], field: int = 1) -> dict:
    """Growth over each rank's first sample of ``field`` (1: RSS, 2: anonymous RSS): host peak
    (largest simultaneous sum) and the sum of rank peaks, in MiB."""
    baselines = [ranks[0][field] for ranks in samples]
    peaks = [max(sample[field] for sample in ranks) - base for ranks, base in zip(samples, baselines)]
    events = sorted((s[0], rank, s[field] - baselines[rank]) for rank, ranks in enumerate(samples) for s in ranks)
    current, host_peak = [0] * len(samples), 0
    for _, rank, growth in events:
        current[rank] = growth
        host_peak = max(host_peak, sum(current))
    return {
        "host_peak_mib": host_peak / 2**20,
        "sum_of_rank_peaks_mib": sum(peaks) / 2**20,
        "rank_peaks_mib": [p / 2**20 for p in peaks],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "100m"], choices=["tiny", "100m"])
    parser.add_argument("--out", default="/tmp/fsdp_peft_loading_bench")
    args = parser.parse_args()
    import torch
    import transformers

    rows = []
    for name in args.models:
        path = model_path(name)
        parameters = parameter_count(path)
        for kind in ("lora", "qlora"):
            one_copy = parameters * LOAD_DTYPE_BYTES[kind] / 2**20
            for low_memory in (False, True):
                out = Path(args.out) / f"{name}-{kind}-{'low' if low_memory else 'ordinary'}"
                out.mkdir(parents=True, exist_ok=True)
                samples = launch(path, kind, low_memory, out)["rss_samples"]
                figures, anonymous = rss_figures(samples, field=1), rss_figures(samples, field=2)
                row = {
                    "model": name,
                    "parameters": parameters,
                    "kind": kind,
                    "low_memory_loading": low_memory,
                    "one_copy_mib": one_copy,
                    **figures,
                    "host_peak_x_one_copy": figures["host_peak_mib"] / one_copy,
                    "sum_of_rank_peaks_x_one_copy": figures["sum_of_rank_peaks_mib"] / one_copy,
                    "anonymous": {**anonymous, "host_peak_x_one_copy": anonymous["host_peak_mib"] / one_copy},
                }
                rows.append(row)
                print(
                    f"{name:5} {kind:6} {'low-memory' if low_memory else 'ordinary':10} one copy {one_copy:8.1f} MiB | "
                    f"host peak {figures['host_peak_mib']:8.1f} MiB ({row['host_peak_x_one_copy']:.2f}x) | "
                    f"sum of rank peaks {figures['sum_of_rank_peaks_mib']:8.1f} MiB "
                    f"({row['sum_of_rank_peaks_x_one_copy']:.2f}x) | anonymous host peak "
                    f"{anonymous['host_peak_mib']:8.1f} MiB ({row['anonymous']['host_peak_x_one_copy']:.2f}x)",
                    flush=True,
                )
    import accelerate
    import bitsandbytes
    import peft

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.system()}",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "accelerate": accelerate.__version__,
            "peft": peft.__version__,
            "bitsandbytes": bitsandbytes.__version__,
        },
        "command": "python benchmarks/loading.py " + " ".join(sys.argv[1:]),
        "method": "growth of each rank's RSS (and of its anonymous part, /proc/self/statm resident - shared) over "
        "its value before the model is built, sampled every 2 ms until training begins",
        "rows": rows,
    }
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "loading.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
