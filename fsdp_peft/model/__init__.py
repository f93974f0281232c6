"""The model: where its files come from (the embedded tiny models, SmolLM2, the cache), how it loads (16-bit or
4-bit, low-memory), the PEFT adapter and its variants on top, MoE experts and vision towers, the attention kernel,
the loss and the compiled decoder layers, and the merge of an adapter into full weights.

`fsdp_peft.model.modeling` builds the model a recipe asks for; the other modules are the pieces it puts together.
Import from the module: this package imports none of them.
"""
