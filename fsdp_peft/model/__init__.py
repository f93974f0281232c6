"""The model: where its files come from (`paths`: the cache and the embedded models, `tiny`, `tiny_vision`, `smollm2`
and its tasks `real_tasks`), the whole build (`modeling.build_model`) with its low-memory loading (`loading`), 4-bit
experts (`moe_quantization`) and mixtures of experts (`moe`), vision towers (`vision`), the attention kernel
(`attention`), the LoRA variants (`variants`) and initialisations computed from the base (`residual`), new tokens
(`new_tokens`), the record of what the build decided (`model_record`), the chunked loss (`loss`), the compiled layers
(`compiled`), the fused kernels (`kernels`), the adapter directory (`adapter_files`) and the merge of an adapter into
full weights (`merge`).

Import from the module: this package imports none of them.
"""
