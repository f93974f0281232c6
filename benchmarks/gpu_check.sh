#!/usr/bin/env bash
# GPU check: one unattended run of at most 8 minutes on a single GPU (written for one H200).
#
#   bash benchmarks/gpu_check.sh            # install what is missing, then measure 1B, GRPO, generate, MoE, VLM, SP, 8B
#   bash benchmarks/gpu_check.sh --dry-run    # CPU: the same Python code on the embedded tiny models
#
# Measures, in this order: the 4-bit kernels against a reference decoder (seconds), ~1B SFT, GRPO, fsdp-peft
# generate, MoE, VLM, sequence parallel (2 GPUs), 8B SFT (no run starts once the time is spent: the 8B runs, the
# costliest, are the ones a slow
# machine leaves out, then the sequence-parallel and VLM runs; the JSON lists what was skipped):
# - SFT, for a ~1B (TinyLlama shape) and an 8B-shaped (Llama 3.1 8B shape) random-weight Llama, LoRA
#   and QLoRA with fsdp-peft and with plain transformers Trainer + peft, same settings: tokens/s, peak
#   GPU memory, model FLOPs utilisation, exact parameter + gradient + optimizer bytes, and the planner's
#   estimate next to the measured peak;
# - GRPO (recipes/llama_grpo.py, ~1B shape, 64 completions x 128 tokens per step): rollout tokens/s of
#   the recipe's generation path (FSDP2, one rank, units gathered once per generate call) against the
#   unsharded model's generate and stock TRL's path (a gather per layer per decoded token), each next to its
#   memory-bandwidth bound (completions x bandwidth / weight bytes per token step), and a few
#   training steps of the recipe with LoRA and with QLoRA: tokens/s, peak GPU memory next to the plan,
#   loss and reward finite;
# - generate: `fsdp-peft generate` on the 8B shape (bf16, a merged-model directory), 1 and 32 prompts of 128 greedy
#   tokens in one call, the decode step compiled (a CUDA graph) and eager: tokens/s over the calls after the first
#   (--timed-calls), the first call's seconds and the graphs compiled, next to the memory-bandwidth bound;
# - MoE (random-weight Qwen3-MoE shape: Qwen3-30B-A3B's layer, 8 layers of 64 experts, 2.7B parameters),
#   fsdp-peft QLoRA (experts quantized by fsdp_peft.model.moe_quantization) and LoRA on a bf16 base, LoRA on
#   attention and every expert: tokens/s, peak GPU memory next to the plan, losses finite, the per-rank
#   4-bit expert bytes next to the plan's and to their bf16 bytes (at most 0.3 of them), and the time
#   of dequantizing one layer's experts against that layer's forward.
# - VLM: recipes/qwen_vl_qlora.py and qwen_vl_lora.py launched on Qwen2.5-VL 7B's shape (random weights), images
#   and text rows mixed: tokens/s, peak GPU memory next to the plan, losses finite.
# - Sequence parallel (needs 2 GPUs; one GPU skips it): recipes/llama_qlora.py on the 8B shape, 16,384-token packed
#   rows split over 2 ranks against one process on the whole rows: tokens/s, peaks next to the plans, loss difference.
# benchmarks/gpu_check.py and its checks (benchmarks/gpu_checks/, one module each) have the details. The dry run
# runs two of the four GRPO runs, generate at 4 prompts on tiny-llama, the MoE QLoRA run only, on the embedded
# tiny-qwen3-moe, the VLM QLoRA run on tiny-qwen2.5-vl, and the sequence-parallel pair on
# tiny-llama over 2 gloo ranks (CI's time).
# Writes benchmarks/results/gpu_check_<UTC date and time>.json (date, hardware, versions inside) and
# copies it to benchmarks/results/gpu_check.json. Needs no network when the packages of
# pyproject.toml are installed; else pip installs them (network needed for that step only).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
TOTAL_SECONDS=470          # hard stop for everything below (8 minutes, with margin)
PYTHON="${PYTHON:-python}"
DRY_RUN=""
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN="--dry-run"; fi
STARTED=$(date +%s)
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
OUT="benchmarks/results/gpu_check_${STAMP}${DRY_RUN:+_dry_run}.json"
export FSDP_PEFT_CACHE="${FSDP_PEFT_CACHE:-${TMPDIR:-/tmp}/fsdp_peft_gpu_check}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
mkdir -p benchmarks/results "$FSDP_PEFT_CACHE"

echo "[gpu_check] $(date -u +%FT%TZ) in $(pwd)"
if [[ -z "$DRY_RUN" ]]; then
    if ! command -v nvidia-smi >/dev/null || ! nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; then
        echo "[gpu_check] no GPU visible (nvidia-smi failed); use --dry-run on a CPU machine" >&2
        exit 3
    fi
fi

versions() {  # one Python start: the import check and the versions line (fsdp_peft first: its import hook)
    "$PYTHON" - <<'EOF'
import fsdp_peft
import torch, transformers, accelerate, peft, bitsandbytes, datasets, trl
print("[gpu_check] torch", torch.__version__, "cuda", torch.version.cuda, "| transformers", transformers.__version__,
      "| accelerate", accelerate.__version__, "| peft", peft.__version__, "| bitsandbytes", bitsandbytes.__version__,
      "| trl", trl.__version__)
print("[gpu_check] GPU:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU dry run)")
EOF
}
if ! versions 2>/dev/null; then
    echo "[gpu_check] installing fsdp-peft and its dependencies (pip install -e .)"
    timeout 180 "$PYTHON" -m pip install --quiet -e . || {
        echo "[gpu_check] pip install failed (no network?): install torch (CUDA build), transformers, accelerate," \
             "peft, bitsandbytes, datasets, trl and this repository, then rerun" >&2
        exit 4
    }
    versions
fi

LEFT=$(( TOTAL_SECONDS - ($(date +%s) - STARTED) ))
BUDGET=$(( LEFT - 20 ))    # seconds the runs may use; the driver stops starting runs when it is spent
echo "[gpu_check] ${BUDGET} s for the runs"
status=0
timeout --signal=TERM --kill-after=10 "$LEFT" \
    "$PYTHON" benchmarks/gpu_check.py $DRY_RUN --budget "$BUDGET" --out "$OUT" || status=$?
if [[ -f "$OUT" ]]; then
    cp "$OUT" "benchmarks/results/gpu_check${DRY_RUN:+_dry_run}.json"
    echo "[gpu_check] results: $OUT (exit status $status, $(( $(date +%s) - STARTED )) s in all)"
else
    echo "[gpu_check] no results written (exit status $status)" >&2
fi
exit "$status"
