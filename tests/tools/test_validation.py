"""Every configuration rule: fed the bad combination, each answers with its one-line message."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from conftest import REPO, procedure_of, tiny_llama_in_4bit
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.procedures.preference import PREFERENCE_PROCEDURE
from fsdp_peft.procedures.registry import PROCEDURES
from fsdp_peft.procedures.rl import GRPO_PROCEDURE
from fsdp_peft.procedures.sft import SFT_PROCEDURE
from fsdp_peft.procedures.vision_sft import VISION_SFT_PROCEDURE
from fsdp_peft.recipe import parse_recipe_config
from fsdp_peft.settings.config import resolve_recipe_config
from fsdp_peft.settings.fsdp_settings import fsdp_settings, rule_context
from fsdp_peft.tools.validation import (
    RULES,
    _trl_recipes_run_without_eva,
    config_problems,
    every,
    through_the_recipes_trainer,
    through_trl,
)

QLORA_TINY = REPO / "configs" / "llama_qlora" / "tiny.yaml"
LORA_TINY = REPO / "configs" / "llama_lora" / "tiny.yaml"
DPO_TINY = REPO / "configs" / "llama_dpo" / "tiny.yaml"
GRPO_TINY = REPO / "configs" / "llama_grpo" / "tiny.yaml"
MOE_TINY = REPO / "configs" / "qwen_moe_lora" / "tiny.yaml"
ACCELERATE_FSDP2 = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
}
ACCELERATE_FSDP1 = {**ACCELERATE_FSDP2, "FSDP_VERSION": "1"}

OWN_RULES = {rule: procedure for procedure in PROCEDURES for rule in procedure.rules}  # each procedure's own
RULE_NAMED = {rule.__name__: rule for rule in [*RULES, *OWN_RULES]}
CASES = {
    "_keys_are_the_procedures": (
        LORA_TINY,
        {},
        ["--num_generations", "4"],
        "num_generations: 4: read by the GRPO recipes only, and this recipe trains SFT; launch a GRPO recipe with "
        "this config (`fsdp-peft ls`), or remove it",
    ),
    "_output_dir_can_hold_the_run": (
        LORA_TINY,
        {},
        ["--output_dir", str(REPO / "README.md")],
        f"output_dir: '{REPO / 'README.md'}' is a file, not a directory; point output_dir at a new or existing",
    ),
    "_model_name_is_known": (
        LORA_TINY,
        {"HF_HUB_OFFLINE": "1"},
        ["--model_name_or_path", "Qwen/Qwen2.5-7B-Instrct"],
        "model_name_or_path: 'Qwen/Qwen2.5-7B-Instrct' is not in the Hugging Face cache (",
    ),
    "_eval_tasks_are_harness_tasks": (
        LORA_TINY,
        {},
        ["--eval_tasks", "tiny_reverse_em", "/nonexistent/my_task.yaml"],
        "eval_tasks: /nonexistent/my_task.yaml: file not found (a task YAML file)",
    ),
    "sequence_split_runs_here": (
        LORA_TINY,
        {**ACCELERATE_FSDP1, "WORLD_SIZE": "2"},
        ["--sequence_parallel_size", "2"],
        "sequence_parallel_size: 2: FSDP1 cannot shard over the sequence mesh; use FSDP2 (fsdp_version: 2)",
    ),
    "sequence_split_fits_the_model": (
        LORA_TINY,
        {**ACCELERATE_FSDP2, "WORLD_SIZE": "3"},
        ["--sequence_parallel_size", "3"],
        "sequence_parallel_size: 3: tiny-llama has 4 query heads, which do not split over 3 ranks",
    ),
    "sequence_split_keeps_the_models_loss": (
        LORA_TINY,
        {**ACCELERATE_FSDP2, "WORLD_SIZE": "2"},
        ["--sequence_parallel_size", "2", "--label_smoothing_factor", "0.1"],
        "sequence_parallel_size: 2 with label_smoothing_factor: 0.1: Trainer's label smoother shifts the labels "
        "again, which a split row carries shifted already; set label_smoothing_factor: 0, or sequence_parallel_size: 1",
    ),
    "packed_rows_keep_their_order": (
        LORA_TINY,
        {},
        ["--packing", "true", "--train_sampling_strategy", "group_by_length"],
        "packing: true with train_sampling_strategy: group_by_length: packed rows are all about max_seq_length long, "
        "there is nothing to group, and the evaluation reads them in order; remove train_sampling_strategy",
    ),
    "expert_adapters_have_no_dropout": (
        MOE_TINY,
        {},
        ["--lora_dropout", "0.05"],
        "lora_dropout: 0.05: LoRA on expert parameters (lora_target_parameters, peft's target_parameters) has no "
        "dropout in peft 0.21; set lora_dropout: 0, or lora_target_parameters: [] to leave the experts frozen",
    ),
    "expert_adapters_are_plain_lora": (
        MOE_TINY,
        {},
        ["--init_lora_weights", "pissa"],
        "init_lora_weights: pissa: peft 0.21 has neither DoRA nor initialisations from the base weights for expert",
    ),
    "expert_adapters_run_under_fsdp2": (
        MOE_TINY,
        ACCELERATE_FSDP1,
        [],
        "fsdp: FSDP1 cannot run LoRA on expert parameters: peft reads their adapter weights without calling the",
    ),
    "moe_targets_reach_the_experts": (
        MOE_TINY,
        {},
        ["--lora_target_modules", "all-linear"],
        "lora_target_modules: all-linear on the mixture of experts tiny-qwen3-moe: peft would also put LoRA on the",
    ),
    "_vision_keys_fit_the_model": (
        REPO / "configs" / "qwen_vl_lora" / "tiny.yaml",
        {},
        ["--packing", "true"],
        "packing: True is not available for the vision-language model tiny-qwen2.5-vl; remove it",
    ),
    "moe_keys_need_a_mixture_of_experts": (
        LORA_TINY,
        {},
        ["--train_router", "true"],
        "train_router: tiny-llama is not a mixture of experts (its config names no experts); remove train_router",
    ),
    "_xla_route_can_run": (
        QLORA_TINY,
        {"PJRT_DEVICE": "CPU"},
        [],
        "load_in_4bit: true on XLA (PJRT_DEVICE=CPU): bitsandbytes has no XLA backend, so QLoRA cannot run on TPU",
    ),
    "_model_config_is_a_causal_lm": (
        LORA_TINY,
        {},
        ["--model_name_or_path", "{t5_model}"],
        "model_name_or_path: {t5_model} is a 't5' model, which has no causal language model head in transformers",
    ),
    "_fsdp2_size_based_wrap_shards_no_layer": (
        LORA_TINY,
        {**ACCELERATE_FSDP2, "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"},
        [],
        "auto_wrap_policy: SIZE_BASED_WRAP under FSDP2: accelerate 1.15 shards every module above min_num_params",
    ),
    "_hybrid_shard_shards_in_the_cpu_mode": (
        LORA_TINY,
        {"WORLD_SIZE": "2"},
        ["--fsdp", "hybrid_shard auto_wrap", "--fsdp_config", '{"version": 1}'],
        "fsdp: hybrid_shard under FSDP1 shards within a node by its GPU count; in the CPU mode every rank",
    ),
    "_prequantized_base_is_trainable": (
        LORA_TINY,
        {},
        ["--model_name_or_path", "{prequantized}"],
        "model_name_or_path: {prequantized} is a pre-quantized bitsandbytes 4-bit checkpoint; set load_in_4bit: true",
    ),
    "_fsdp_settings_resolve": (
        LORA_TINY,
        ACCELERATE_FSDP1,
        ["--fsdp", "true", "--fsdp_config", '{"version": 2}'],
        "fsdp_config: version is 2 in the recipe but 1 in the accelerate config (FSDP_VERSION); make them agree",
    ),
    "_quant_storage_is_floating_under_fsdp": (
        QLORA_TINY,
        ACCELERATE_FSDP2,
        ["--bnb_4bit_quant_storage", "uint8"],
        "bnb_4bit_quant_storage: 'uint8' cannot be sharded by FSDP; set it to bfloat16 (the FSDP gather dtype)",
    ),
    "_quant_storage_matches_gather_dtype": (
        QLORA_TINY,
        ACCELERATE_FSDP2,
        ["--bnb_4bit_quant_storage", "float32"],
        "bnb_4bit_quant_storage: 'float32' differs from the dtype FSDP gathers in ('bfloat16'",
    ),
    "_dtype_keys_are_known": (
        LORA_TINY,
        {},
        ["--fsdp_reduce_dtype", "fp64"],
        "fsdp_reduce_dtype: 'fp64' is not one of",
    ),
    "_data_files_exist": (
        LORA_TINY,
        {},
        ["--eval_file", "/no/such.jsonl"],
        "eval_file: file not found: /no/such.jsonl",
    ),
    "_local_model_path_exists": (
        LORA_TINY,
        {},
        ["--model_name_or_path", "/no/model"],
        "model_name_or_path: directory not found: /no/model",
    ),
    "_attention_kernel_runs_here": (
        LORA_TINY,
        {},
        ["--attn_implementation", "flash_attention_2"],
        "attn_implementation: flash_attention_2 runs on CUDA GPUs only and this machine has none; or use sdpa",
    ),
    "_architecture_has_the_attention_kernel": (
        LORA_TINY,
        {},
        ["--model_name_or_path", "{gemma2_model}", "--attn_implementation", "sdpa"],
        "attn_implementation: sdpa: Gemma2ForCausalLM has no SDPA attention in transformers",
    ),
    "_data_settings_are_known": (
        LORA_TINY,
        {},
        ["--truncation", "middle"],
        "truncation: 'middle' is not one of right, left, drop",
    ),
    "_gather_budget_is_a_size": (
        LORA_TINY,
        {},
        ["--generate_gather_budget", "8 gigs"],
        "generate_gather_budget: '8 gigs' is not 'auto' (half the free device memory), 'all', 'none'",
    ),
    "_compiled_decoding_is_a_choice": (
        LORA_TINY,
        {},
        ["--generate_compiled", "sometimes"],
        "generate_compiled: 'sometimes' is not 'auto' (on a GPU: a static KV cache",
    ),
    "_device_memory_is_a_size": (
        LORA_TINY,
        {},
        ["--device_memory", "lots"],
        "device_memory: 'lots' is not auto or a size like 20GiB (the memory of one device)",
    ),
    "_compile_where_it_is_tested": (
        LORA_TINY,
        {},
        ["--compile", "true", "--torch_compile", "true"],
        "compile: true compiles each layer; torch_compile: true compiles the whole model again: keep one",
    ),
    "_kernels_run_here": (
        LORA_TINY,
        {},
        ["--kernels", "liger"],
        "kernels: liger runs Triton kernels on NVIDIA GPUs and this machine has no CUDA device",
    ),
    "_fsdp_needs_several_processes": (
        LORA_TINY,
        {"WORLD_SIZE": "1"},
        ["--fsdp", "full_shard auto_wrap"],
        "fsdp: set in the config, but this is a single process",
    ),
    "_one_activation_checkpointing": (
        LORA_TINY,
        {**ACCELERATE_FSDP2, "FSDP_ACTIVATION_CHECKPOINTING": "true"},
        ["--gradient_checkpointing", "true"],
        "gradient_checkpointing: true together with FSDP's own activation_checkpointing",
    ),
    "_save_only_model_needs_full_state_dict": (
        LORA_TINY,
        ACCELERATE_FSDP2,
        ["--save_only_model", "true"],
        "save_only_model: true cannot be resumed from with FSDP's SHARDED_STATE_DICT",
    ),
    "_fsdp1_units_keep_adapters_apart": (
        LORA_TINY,
        {**ACCELERATE_FSDP1, "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"},
        [],
        "auto_wrap_policy: SIZE_BASED_WRAP under FSDP1 with use_orig_params: false would put frozen base weights",
    ),
    "_fsdp1_checkpoints_are_sharded": (
        LORA_TINY,
        {**ACCELERATE_FSDP1, "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"},
        ["--save_strategy", "steps"],
        "save_strategy: 'steps' under FSDP1 with state_dict_type FULL_STATE_DICT: fsdp-peft saves and resumes",
    ),
    "_offload_needs_a_cpu_optimizer": (
        LORA_TINY,
        {**ACCELERATE_FSDP2, "FSDP_OFFLOAD_PARAMS": "true"},
        ["--optim", "paged_adamw_8bit"],
        "optim: 'paged_adamw_8bit' steps on the GPU, but FSDP offload_params keeps parameters",
    ),
    "_cpu_mode_cannot_load_on_rank_0_only": (
        LORA_TINY,
        {**ACCELERATE_FSDP1, "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"},
        [],
        "cpu_ram_efficient_loading needs FSDP1's sync_module_states",
    ),
    "_preference_loss_is_known": (
        DPO_TINY,
        {},
        ["--loss_type", "dpo"],
        "loss_type: 'dpo' is not one of sigmoid, hinge, ipo,",
    ),
    "_preference_beta_is_positive": (
        DPO_TINY,
        {},
        ["--beta", "0"],
        "beta: must be above 0 for DPO/KTO (the reference's pull), got 0.0",
    ),
    "_rl_loss_is_known": (
        GRPO_TINY,
        {},
        ["--loss_type", "sigmoid"],
        "loss_type: 'sigmoid' is not one of grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo",
    ),
    "_rl_has_rewards": (
        GRPO_TINY,
        {},
        ["--reward_weights", "1.0", "2.0"],
        "reward_weights: 2 weights for 1 reward functions; give one weight per function, or none (1.0 each)",
    ),
    "_rl_groups_fill_the_batch": (
        GRPO_TINY,
        {},
        ["--num_generations", "5"],
        "num_generations: 5 does not divide the generation batch of 32 completions (per_device_train_batch_size 32",
    ),
    "_rl_checkpoints_on_generation_boundaries": (
        GRPO_TINY,
        {},
        ["--save_strategy", "steps", "--save_steps", "3", "--steps_per_generation", "2"],
        "save_steps: 3 puts checkpoints inside a rollout cycle of 2 micro-steps (steps_per_generation x "
        "num_iterations), which a resume cannot repeat; use a multiple of 2 optimizer steps",
    ),
    "_reference_is_the_adapter_disabled_model": (
        DPO_TINY,
        {},
        ["--ref_model", "meta-llama/Llama-3.1-8B-Instruct"],
        "ref_model: meta-llama/Llama-3.1-8B-Instruct would hold a second model beside the LoRA policy; remove it",
    ),
    "_precomputed_reference_sees_the_weights": (
        DPO_TINY,
        {**ACCELERATE_FSDP2, "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "WORLD_SIZE": "2"},
        ["--precompute_ref_log_probs", "true"],
        "precompute_ref_log_probs: true runs the reference before FSDP shards the model, but with "
        "cpu_ram_efficient_loading only rank 0 has weights then",
    ),
    "_trl_recipes_run_off_xla": (
        DPO_TINY,
        {"PJRT_DEVICE": "CPU"},
        [],
        "PJRT_DEVICE=CPU: the preference and GRPO recipes do not run on XLA (TPU) yet; run them on GPUs or CPUs",
    ),
    "_trl_recipes_run_without_eva": (
        DPO_TINY,
        {},
        ["--init_lora_weights", "eva"],
        "init_lora_weights: eva: its data pass (fsdp_peft.procedures.eva) reads SFT batches and the preference and "
        "GRPO recipes do not",
    ),
    "_checkpoints_are_finished_by_one_rank": (
        LORA_TINY,
        ACCELERATE_FSDP2,
        ["--save_on_each_node", "true", "--save_strategy", "steps"],
        "save_on_each_node: true with FSDP checkpoints: every rank writes its shard into one checkpoint directory",
    ),
    "_parallelism_config_fills_the_launch": (
        LORA_TINY,
        {
            **ACCELERATE_FSDP2,
            "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
            "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
            "PARALLELISM_CONFIG_DP_SHARD_SIZE": "8",
            "WORLD_SIZE": "2",
        },
        [],
        "parallelism_config: dp_replicate_size 2 x dp_shard_size 8 = 16 ranks, but this launch has 2 (num_processes)",
    ),
    "variant_keys_are_known": (
        LORA_TINY,
        {},
        ["--init_lora_weights", "pisa"],
        "init_lora_weights: 'pisa' is not one of default, gaussian, pissa, pissa_niter_N (N: subspace iterations",
    ),
    "eva_keeps_the_configured_ranks": (
        LORA_TINY,
        ACCELERATE_FSDP2,
        ["--init_lora_weights", "eva", "--eva_rho", "2"],
        "eva_rho: 2.0 redistributes LoRA ranks between layers by the data pass, so neither fsdp-peft plan nor",
    ),
    "eva_initialises_linear_layers_only": (
        LORA_TINY,
        ACCELERATE_FSDP2,
        ["--init_lora_weights", "eva", "--lora_target_modules", "q_proj", "embed_tokens"],
        "init_lora_weights: eva with LoRA on the embedding layer: peft's EVA initialises linear layers only",
    ),
    "eva_forwards_the_loaded_model_before_sharding": (
        LORA_TINY,
        {**ACCELERATE_FSDP2, "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "WORLD_SIZE": "2"},
        ["--init_lora_weights", "eva"],
        "init_lora_weights: eva runs forward passes before FSDP shards the model, and under fsdp_cpu_ram_efficient",
    ),
    "init_from_base_weights_needs_the_full_precision_base": (
        LORA_TINY,
        ACCELERATE_FSDP2,
        ["--init_lora_weights", "loftq"],
        "init_lora_weights: loftq fits the adapter to the 4-bit quantization error of each base weight, and",
    ),
    "trainable_tokens_and_their_embedding_copy_exclude_each_other": (
        LORA_TINY,
        {},
        ["--trainable_token_indices", "3", "--lora_modules_to_save", "embed_tokens"],
        "trainable_token_indices: trains rows of the embedding that lora_modules_to_save (embed_tokens) already",
    ),
    "fsdp1_keeps_tied_embeddings_in_the_root": (
        LORA_TINY,
        ACCELERATE_FSDP1,
        ["--trainable_token_indices", "3", "--model_name_or_path", "{tied_model}"],
        "trainable_token_indices under FSDP1 with tied embeddings ({tied_model} ties the input embedding and the",
    ),
    "new_special_tokens_are_new": (
        LORA_TINY,
        {},
        ["--new_special_tokens", "<|tool_call|>", "<|user|>"],
        "new_special_tokens: '<|user|>' is already in the tokenizer's vocabulary; drop it from new_special_tokens",
    ),
    "new_tokens_train_as_trainable_tokens": (
        LORA_TINY,
        {},
        ["--new_special_tokens", "<|tool_call|>", "--lora_modules_to_save", "lm_head"],
        "new_special_tokens: the new rows of the output head are trained as trainable tokens, which peft cannot",
    ),
}


@pytest.fixture(scope="module")
def odd_models(tmp_path_factory, tiny_model_dir, tiny_gemma2_dir) -> dict[str, str]:
    """Model directories the rules refuse: an encoder-decoder config, a pre-quantized 4-bit tiny-llama, a tied
    tiny-llama, a Gemma-2 (no SDPA)."""
    root = tmp_path_factory.mktemp("odd_models")
    (root / "t5").mkdir()
    (root / "t5" / "config.json").write_text('{"model_type": "t5", "d_model": 64, "num_layers": 1}')
    tiny_llama_in_4bit(tiny_model_dir).save_pretrained(root / "prequantized")
    (root / "tied").mkdir()  # the rules read its config only
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (root / "tied" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return {
        "t5_model": str(root / "t5"),
        "prequantized": str(root / "prequantized"),
        "tied_model": str(root / "tied"),
        "gemma2_model": str(tiny_gemma2_dir),
    }


def test_a_prequantized_4bit_base_validates_with_its_own_settings(odd_models, tmp_path, monkeypatch):
    for key in [k for k in __import__("os").environ if k.startswith(("FSDP_", "ACCELERATE_"))]:
        monkeypatch.delenv(key)
    argv = [
        "--config",
        str(QLORA_TINY),
        "--output_dir",
        str(tmp_path),
        "--model_name_or_path",
        odd_models["prequantized"],
    ]
    recipe, _ = parse_recipe_config(argv, QLORA_TINY, str(tmp_path))
    assert recipe.load_in_4bit
    with pytest.raises(ConfigError, match="bnb_4bit_quant_type: 'fp4' differs from the pre-quantized checkpoint"):
        parse_recipe_config([*argv, "--bnb_4bit_quant_type", "fp4"], QLORA_TINY, str(tmp_path))


def test_a_model_config_that_does_not_parse_is_refused_before_any_run_starts(tmp_path, monkeypatch):
    for key in [k for k in __import__("os").environ if k.startswith(("FSDP_", "ACCELERATE_"))]:
        monkeypatch.delenv(key)
    model = tmp_path / "cut-short"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", ')  # a download cut short
    argv = ["--config", str(LORA_TINY), "--output_dir", str(tmp_path / "out"), "--model_name_or_path", str(model)]
    with pytest.raises(ConfigError) as error:
        parse_recipe_config(argv, LORA_TINY, str(tmp_path / "out"))
    assert str(error.value) == (
        f"model_name_or_path: the config of {model} does not load: It looks like the config file at "
        f"'{model / 'config.json'}' is not a valid JSON file; fix the file or point model_name_or_path at a "
        "complete copy of the model"
    )


def test_every_rule_has_a_case():
    assert sorted(RULE_NAMED) == sorted(CASES)


TRL_REFUSALS = [
    "_trl_recipes_run_off_xla",
    "_trl_recipes_run_without_eva",
]


def test_every_rule_is_guarded_by_a_trait_of_the_procedure_or_is_one_procedures_own():
    """Shared rules are guarded by predicates of the procedure (never by its name): only the TRL recipes' refusals
    (and the reference model's) skip SFT, only the XLA route's skips the TRL recipes; the preference and GRPO rules are
    their procedures' own, and no rule is both."""
    assert set(RULES.values()) == {every, through_trl, through_the_recipes_trainer}
    assert [rule.__name__ for rule, guard in RULES.items() if not guard(SFT_PROCEDURE)] == [
        "_reference_is_the_adapter_disabled_model",
        *TRL_REFUSALS,
    ]
    assert all(RULES[RULE_NAMED[name]] is through_trl for name in TRL_REFUSALS)
    assert [rule.__name__ for rule, guard in RULES.items() if not guard(GRPO_PROCEDURE)] == ["_xla_route_can_run"]
    assert {rule.__name__: procedure.name for rule, procedure in OWN_RULES.items()} == {
        "_preference_loss_is_known": "preference",
        "_preference_beta_is_positive": "preference",
        "_precomputed_reference_sees_the_weights": "preference",
        "_rl_loss_is_known": "rl",
        "_rl_has_rewards": "rl",
        "_rl_groups_fill_the_batch": "rl",
        "_rl_checkpoints_on_generation_boundaries": "rl",
    }
    assert not set(OWN_RULES) & set(RULES)
    assert SFT_PROCEDURE.rules == VISION_SFT_PROCEDURE.rules == ()


def _refused(config, env, argv, procedure, monkeypatch, tmp_path) -> str:
    for key in [k for k in __import__("os").environ if k.startswith(("FSDP_", "ACCELERATE_"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as error:
        argv = ["--config", str(config), "--output_dir", str(tmp_path), *argv]
        parse_recipe_config(argv, config, str(tmp_path), procedure)
    return str(error.value)


@pytest.mark.parametrize("rule", sorted(CASES))
def test_rule_rejects_its_bad_combination_with_one_line(rule, monkeypatch, tmp_path, odd_models):
    config, env, argv, message = CASES[rule]
    placeholders = {"{" + name + "}": path for name, path in odd_models.items()}
    for placeholder, path in placeholders.items():
        argv, message = [a.replace(placeholder, path) for a in argv], message.replace(placeholder, path)
    procedure = procedure_of(config)  # the recipe of configs/<recipe>/: the procedure its launch runs
    assert OWN_RULES.get(RULE_NAMED[rule]) is procedure or RULES[RULE_NAMED[rule]](procedure), (rule, procedure.name)
    problem = _refused(config, env, argv, procedure, monkeypatch, tmp_path)
    lines = problem.split("\n")
    assert len(lines) == 1 and lines[0].startswith(message), problem


@pytest.mark.parametrize("rule", TRL_REFUSALS)
def test_the_grpo_recipes_get_the_refusals_of_trls_trainers(rule, monkeypatch, tmp_path):
    _, env, argv, message = CASES[rule]
    assert _refused(GRPO_TINY, env, argv, GRPO_PROCEDURE, monkeypatch, tmp_path).startswith(message)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--generate_batch_size", "0"], "generate_batch_size: must be positive, got 0"),
        (["--lora_r", "-4"], "lora_r: must be positive, got -4"),
        (["--generate_samples", "-1"], "generate_samples: must be 0 (no generation) or more, got -1"),
    ],
)
def test_sizes_are_single_key_ranges_refused_with_one_line_and_plan_refuses_them_too(argv, message, tmp_path):
    from fsdp_peft.settings.config import resolve_recipe_config
    from fsdp_peft.settings.keys import check_keys

    with pytest.raises(ConfigError) as error:
        parse_recipe_config(["--config", str(LORA_TINY), *argv], LORA_TINY, str(tmp_path))
    assert str(error.value) == message
    recipe, training, _ = resolve_recipe_config(["--config", str(LORA_TINY), *argv], LORA_TINY, str(tmp_path))
    with pytest.raises(ConfigError) as error:
        check_keys(recipe, training)
    assert str(error.value) == message


def test_the_shipped_defaults_pass_every_rule_under_both_fsdp_versions(monkeypatch, tmp_path):
    for version, env in ((1, ACCELERATE_FSDP1), (2, ACCELERATE_FSDP2)):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        for config in (QLORA_TINY, LORA_TINY):
            recipe, training = parse_recipe_config(
                ["--config", str(config), "--output_dir", str(tmp_path)], config, str(tmp_path)
            )
            assert fsdp_settings(training).version == version, config  # the launcher's FSDP was seen: no rule refused
            assert recipe.load_in_4bit is (config == QLORA_TINY)


def test_trainable_tokens_and_embedding_lora_pass_under_fsdp1_with_untied_embeddings(monkeypatch, tmp_path):
    for key, value in ACCELERATE_FSDP1.items():
        monkeypatch.setenv(key, value)
    base = ["--config", str(LORA_TINY), "--output_dir", str(tmp_path)]
    recipe, _ = parse_recipe_config([*base, "--trainable_token_indices", "3"], LORA_TINY, str(tmp_path))
    assert recipe.trainable_token_indices == [3]
    targets = ["--lora_target_modules", "q_proj", "embed_tokens"]
    recipe, _ = parse_recipe_config([*base, *targets], LORA_TINY, str(tmp_path))
    assert "embed_tokens" in recipe.lora_target_modules


def test_yaml_route_settings_follow_transformers_defaults():
    settings = fsdp_settings({"fsdp": "full_shard offload auto_wrap", "fsdp_config": '{"fsdp_version": 1}'})
    assert settings.version == 1 and settings.offload_params and settings.use_orig_params
    assert settings.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" and settings.state_dict_type == "FULL_STATE_DICT"


def test_pissa_olora_and_loftq_on_a_4bit_base_pass_and_loftq_must_fit_its_4_bits(monkeypatch, tmp_path):
    base = ["--config", str(QLORA_TINY), "--output_dir", str(tmp_path)]
    for env in (ACCELERATE_FSDP1, ACCELERATE_FSDP2):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        for init in ("pissa", "pissa_niter_4", "olora", "loftq"):
            recipe, _ = parse_recipe_config([*base, "--init_lora_weights", init], QLORA_TINY, str(tmp_path))
            assert recipe.init_lora_weights == init and recipe.load_in_4bit
    with pytest.raises(ConfigError, match=r"^loftq_bits: 2 with load_in_4bit: the base is loaded in 4 bits"):
        parse_recipe_config([*base, "--init_lora_weights", "loftq", "--loftq_bits", "2"], QLORA_TINY, str(tmp_path))


def test_eva_passes_under_both_fsdp_versions_and_its_keys_are_checked(monkeypatch, tmp_path):
    base = ["--config", str(LORA_TINY), "--output_dir", str(tmp_path), "--init_lora_weights", "eva"]
    for env in (ACCELERATE_FSDP1, ACCELERATE_FSDP2):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        for config in (LORA_TINY, QLORA_TINY):
            recipe, _ = parse_recipe_config([*base, "--config", str(config)], config, str(tmp_path))
            assert recipe.init_lora_weights == "eva" and recipe.eva_rho == 1 and recipe.eva_batches == 16
    with pytest.raises(ConfigError, match=r"^eva_tau: must be in \(0, 1\], got 1.5"):
        parse_recipe_config([*base, "--eva_tau", "1.5"], LORA_TINY, str(tmp_path))
    with pytest.raises(ConfigError, match=r"^eva_batches: must be at least 1, got 0"):
        parse_recipe_config([*base, "--eva_batches", "0"], LORA_TINY, str(tmp_path))
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    with pytest.raises(ConfigError, match=r"^init_lora_weights: eva on XLA \(PJRT_DEVICE=CPU\): its data pass is"):
        parse_recipe_config(base, LORA_TINY, str(tmp_path))
    monkeypatch.delenv("PJRT_DEVICE")
    context = rule_context(recipe, {}, PREFERENCE_PROCEDURE)
    assert _trl_recipes_run_without_eva(context).startswith("init_lora_weights: eva: its data pass (fsdp_peft")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--lora_target_modules", "all-linear"],
            "lora_target_modules: all-linear on the mixture of experts tiny-qwen3-moe: peft would also put LoRA on "
            "the router",
        ),
        (["--lora_target_modules", "q_proj", "gate"], "lora_target_modules: gate on the mixture of experts"),
        (
            ["--lora_target_parameters", "mlp.experts.up_proj"],
            "lora_target_parameters: ['mlp.experts.up_proj'] name no expert parameter of tiny-qwen3-moe; it has "
            "['mlp.experts.down_proj', 'mlp.experts.gate_up_proj'] (auto: all)",
        ),
    ],
)
def test_a_mixture_of_experts_takes_its_experts_through_lora_target_parameters_only(argv, message, tmp_path):
    with pytest.raises(ConfigError) as error:
        parse_recipe_config(["--config", str(MOE_TINY), *argv], MOE_TINY, str(tmp_path))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_one_validation_resolves_the_fsdp_settings_once(monkeypatch, tmp_path):
    """Every rule reads the settings from one context (`fsdp_peft.settings.fsdp_settings.RuleContext`), resolved
    once."""
    import fsdp_peft.settings.fsdp_settings as settings_module

    calls = []
    resolve = settings_module.fsdp_settings
    monkeypatch.setattr(settings_module, "fsdp_settings", lambda *a, **k: (calls.append(1), resolve(*a, **k))[1])
    argv = ["--output_dir", str(tmp_path), "--fsdp", "full_shard auto_wrap", "--fsdp_config", '{"version": 2}']
    for config, procedure in (
        (LORA_TINY, SFT_PROCEDURE),
        (DPO_TINY, PREFERENCE_PROCEDURE),
        (GRPO_TINY, GRPO_PROCEDURE),
    ):
        calls.clear()
        recipe, training_values, _ = resolve_recipe_config(argv, config, str(tmp_path))
        assert config_problems(recipe, training_values, procedure) == [
            "fsdp: set in the config, but this is a single process; launch with `accelerate launch --config_file "
            "configs/accelerate/cpu_fsdp2.yaml ...` (or a GPU config), or remove fsdp/fsdp_config"
        ]
        assert len(calls) == 1, (procedure, len(calls))


def test_a_mistyped_embedded_model_name_is_refused_with_the_closest_name(monkeypatch, tmp_path):
    problem = _refused(LORA_TINY, {}, ["--model_name_or_path", "tiny-lama"], SFT_PROCEDURE, monkeypatch, tmp_path)
    assert problem.startswith(
        "model_name_or_path: 'tiny-lama' is no embedded model, directory or hub id; did you mean "
        "'tiny-llama'? the models that need no hub are tiny-llama, tiny-qwen2,"
    ), problem


def test_an_offline_hub_typo_gets_the_shipped_name_it_is_closest_to(monkeypatch, tmp_path):
    argv = ["--model_name_or_path", "Qwen/Qwen2.5-7B-Instrct"]
    problem = _refused(LORA_TINY, {"HF_HUB_OFFLINE": "1"}, argv, SFT_PROCEDURE, monkeypatch, tmp_path)
    assert "did you mean 'Qwen/Qwen2.5-7B-Instruct'?" in problem and "\n" not in problem, problem


def _validate_lines(config: Path, *arguments: str) -> tuple[int, list[str]]:
    from fsdp_peft.cli import main

    with pytest.raises(SystemExit) as exit_code, contextlib.redirect_stderr(io.StringIO()) as stderr:
        main(["validate", str(config), *arguments])
    return exit_code.value.code, stderr.getvalue().splitlines()


def test_validate_passes_a_shipped_config_offline_whose_model_is_not_downloaded(monkeypatch, capsys):
    from fsdp_peft.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    main(["validate", str(REPO / "configs" / "qwen_qlora" / "qwen2_5_7b.yaml")])
    assert capsys.readouterr().out.strip().endswith("qwen2_5_7b.yaml: ok")


def test_validate_finds_what_the_launch_refuses_all_at_once(tmp_path):
    """An output_dir that is a file, an empty data file and a bad row: three lines, each naming file, row or key."""
    empty, bad = tmp_path / "empty", tmp_path / "bad"
    empty.mkdir(), bad.mkdir()
    (empty / "train.jsonl").write_text("")
    (bad / "train.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    (tmp_path / "a_file").write_text("")
    config = tmp_path / "my.yaml"
    config.write_text(
        f"include: {LORA_TINY}\ndataset: {bad}\neval_file: {empty / 'train.jsonl'}\noutput_dir: {tmp_path / 'a_file'}\n"
    )
    code, lines = _validate_lines(config)
    assert code == 2 and lines == [
        f"error: output_dir: '{tmp_path / 'a_file'}' is a file, not a directory; point output_dir at a new or "
        "existing directory",
        f"       {bad / 'train.jsonl'}: row 2: missing field 'completion'; fix the row or set skip_invalid_rows: true",
        f"       {empty / 'train.jsonl'}: the file is empty (no rows); put rows in it or point dataset elsewhere",
    ], lines


def test_skip_invalid_rows_lets_validate_pass_rows_it_would_drop_but_not_an_all_bad_file(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"prompt": "a"}\n')
    config = tmp_path / "my.yaml"
    config.write_text(f"include: {LORA_TINY}\ndataset: {data}\nskip_invalid_rows: true\noutput_dir: {tmp_path / 'o'}\n")
    code, lines = _validate_lines(config)
    assert code == 2 and lines == [
        f"error: {data / 'train.jsonl'}: no row left to train on (1 missing field dropped); fix the data"
    ], lines
    (data / "train.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    from fsdp_peft.cli import main

    main(["validate", str(config)])
    assert capsys.readouterr().out.strip() == f"{config}: ok"


@pytest.mark.parametrize("data_format", ["auto", "messages", "sharegpt"])
def test_an_empty_data_file_stops_the_launch_in_one_line_naming_it(data_format, tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("\n")
    config = tmp_path / "my.yaml"
    config.write_text(f"include: {LORA_TINY}\ndataset: {data}\ndata_format: {data_format}\n")
    from fsdp_peft.data.sources import data_sources, read_source

    recipe, _ = parse_recipe_config(["--config", str(config), "--output_dir", str(tmp_path / "o")], config, "o")
    with pytest.raises(ConfigError) as error:
        read_source(data_sources(recipe)[0])  # what the launch's data step reads first, whatever the format
    assert (
        str(error.value)
        == f"{data / 'train.jsonl'}: the file is empty (no rows); put rows in it or point dataset elsewhere"
    )


def test_a_wrong_type_does_not_hide_the_other_problems(tmp_path):
    """The rules see an ill-typed key at its default, so the type line comes first and the rest follow it."""
    (tmp_path / "a_file").write_text("")
    config = tmp_path / "my.yaml"
    config.write_text(
        f"include: {LORA_TINY}\nlora_alpha: [1, 2]\noutput_dir: {tmp_path / 'a_file'}\ndataset: /no/such/data\n"
    )
    code, lines = _validate_lines(config)
    assert code == 2 and [line.split(":")[0].strip() for line in lines] == [
        "error",
        "dataset",
        "output_dir",
    ], lines
    assert lines[0] == "error: lora_alpha: expected a whole number, got [1, 2] (list)", lines


def test_an_unknown_key_and_an_unreadable_value_are_listed_with_every_other_problem(tmp_path):
    """Neither stops validate alone: the rules see those keys at their defaults and say the rest."""
    (tmp_path / "a_file").write_text("")
    config = tmp_path / "my.yaml"
    config.write_text(
        f"include: {LORA_TINY}\nlearnin_rate: 1\nlora_alpha: many\nlora_r: 0\noutput_dir: {tmp_path / 'a_file'}\n"
    )
    code, lines = _validate_lines(config)
    assert code == 2 and [line.strip() for line in lines] == [
        f"error: {config}: unknown key 'learnin_rate'; did you mean 'learning_rate'?",
        "lora_alpha: expected a whole number, got 'many' (str)",
        "lora_r: must be positive, got 0",
        f"output_dir: '{tmp_path / 'a_file'}' is a file, not a directory; point output_dir at a new or existing "
        "directory",
    ], lines


@pytest.mark.parametrize(
    "config_name, trainer_module",
    [("DPOConfig", "dpo_trainer"), ("KTOConfig", "kto_trainer"), ("GRPOConfig", "grpo_trainer")],
)
def test_the_loss_types_read_from_trls_declarations_are_the_ones_its_trainer_computes(config_name, trainer_module):
    """`trl_loss_types` reads a config's declared values (help or docstring); the reference is the installed trainer's
    own source: every ``loss_type == "x"`` branch and ``loss_type in [...]`` list of its loss."""
    import importlib
    import inspect
    import re

    from fsdp_peft.tools.validation import trl_loss_types

    source = inspect.getsource(importlib.import_module(f"trl.trainer.{trainer_module}"))
    computed = set(re.findall(r'loss_type == "(\w+)"', source))
    for listed in re.findall(r"loss_type (?:not )?in [\[\(\{]([^\]\)\}]*)[\]\)\}]", source):
        computed |= set(re.findall(r'"(\w+)"', listed))
    declared = trl_loss_types(config_name)
    assert len(declared) == len(set(declared)) >= 2 and set(declared) == computed
