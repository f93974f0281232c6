"""``fsdp-peft generate`` runs (``generate`` in ``--shapes``): the command as users run it on a merged-model directory
(the random-weight 8B-shaped Llama in bf16; the dry run: the embedded tiny Llama), greedy, `GENERATE_SIZES`' new
tokens for every prompt, at 1 and 32 prompts (one ``generate`` call each: ``--batch-size`` the prompts), one process,
with the decode step compiled (``--compiled true``: a CUDA graph on a GPU, `fsdp_peft.tools.decoding`) and eager
(``--compiled false``, the path before it) in that order.

Measured by the command itself (``--timed-calls``): tokens/s over the calls after the first, every completion
exactly the new tokens (EOS held off), the first call's seconds (compiling included) and the graphs compiled;
beside it the memory-bandwidth bound of the shape: each token step reads every weight once (the safetensors' bytes
less an untied input embedding, of which a step reads one row a prompt) and makes a token for each prompt, on a GPU
of `PEAK_MEMORY_BANDWIDTH` (none without a GPU). The KV cache a step also reads is left out (on the 8B shape at 32
prompts and a 192-position cache, ~5 % of the weights' bytes): the bound is a little above the true one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpu_checks.common import REPO, last_line, peak_memory_bandwidth, scratch_directory

GENERATE_SIZES = {  # model shape: prompts of each call, new tokens a prompt, timed calls after the first
    "8b": {"prompts": (1, 32), "new_tokens": 128, "timed_calls": 2},
    "tiny": {"prompts": (4,), "new_tokens": 8, "timed_calls": 1},  # the dry run (CI): two runs, ~15 s each
}
GENERATE_MODES = ("true", "false")  # --compiled: the compiled decode step, then the eager one
WORDS = ("apple", "river", "cloud", "stone", "light", "grass", "tiger", "piano", "ocean", "maple", "cedar", "amber")


def generate_run(entry: dict, model: str, mode: str, prompts: int, left: float) -> dict:
    """``fsdp-peft generate MODEL`` over ``prompts`` prompts in one call, ``--compiled MODE``: its timing line, and the
    memory-bandwidth bound of the shape at that many prompts."""
    size = GENERATE_SIZES[entry["model"]]
    directory = scratch_directory(f"gpu_check_generate_{mode}_{prompts}_")
    lines = [f"Write a short story about the {WORDS[i % len(WORDS)]} number {i}." for i in range(prompts)]
    prompts_file = directory / "prompts.txt"
    prompts_file.write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "fsdp_peft.cli", "generate", model, "--prompts-file", str(prompts_file)]
    command += ["--max-new-tokens", str(size["new_tokens"]), "--batch-size", str(prompts), "--no-chat", "--greedy"]
    command += ["--compiled", mode, "--timed-calls", str(size["timed_calls"]), "--json"]
    child = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=left)
    if child.returncode != 0:
        return {"failed": last_line(child.stderr)}
    rows = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    timing = next(row["timing"] for row in rows if "timing" in row)
    completions = [row["completion"] for row in rows if "completion" in row]
    return {**timing, "completions": len(completions), **generation_bound(Path(model), prompts, timing)}


def generation_bound(model: Path, prompts: int, timing: dict) -> dict:
    """The weight bytes a token step reads (`weight_bytes_per_token_step`) and the tokens/s that bounds at
    ``prompts`` prompts on this GPU's bandwidth, with the share ``timing`` reached (none without a GPU)."""
    weights = weight_bytes_per_token_step(model)
    bandwidth = peak_memory_bandwidth()
    bound = prompts * bandwidth / weights if bandwidth else None
    return {
        "weight_bytes_per_token_step": weights,
        "bound_tokens_per_second": bound,
        "share_of_bound": timing["tokens_per_second"] / bound if bound else None,
    }


def weight_bytes_per_token_step(model: Path) -> int:
    """The bytes of ``model``'s safetensors less an untied input embedding (a token step reads one row of it a
    prompt; a tied one is read whole as the output layer)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model).get_text_config()
    stored = sum(path.stat().st_size for path in model.glob("*.safetensors"))
    if config.tie_word_embeddings:
        return stored
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[str(dtype).removeprefix("torch.")]
    return stored - config.vocab_size * config.hidden_size * itemsize


def generate_check(shape: str, model: str, modes: tuple, args, report: dict, started: float, measured) -> None:
    """Each of ``modes`` at each prompt count of ``shape``, as runs of the report (``measured`` records them)."""
    size = GENERATE_SIZES[shape]
    report["settings"]["generate"] = {"model": shape, **size, "modes": [f"--compiled {mode}" for mode in modes]}
    for mode in modes:
        for prompts in size["prompts"]:
            entry = {"model": shape, "method": f"{prompts} prompt(s)", "impl": f"generate --compiled {mode}"}
            measured(entry, lambda left: generate_run(entry, model, mode, prompts, left), args, report, started)
    report["generate"] = generate_summary(report["runs"])
    for name, ratio in report["generate"].items():
        print(f"generate {shape}: {name.replace('_', ' ')}: {ratio:.2f}x", flush=True)


def generate_summary(runs: list[dict]) -> dict:
    """Compiled over eager tokens/s at each prompt count, where both ran."""
    speed = {
        (r["method"], r["impl"]): r["tokens_per_second"]
        for r in runs
        if r["impl"].startswith("generate ") and "tokens_per_second" in r
    }
    counts = sorted({method for method, _ in speed})
    return {
        f"compiled_over_eager_{method.split()[0]}_prompts": speed[(method, "generate --compiled true")]
        / speed[(method, "generate --compiled false")]
        for method in counts
        if (method, "generate --compiled true") in speed and (method, "generate --compiled false") in speed
    }
