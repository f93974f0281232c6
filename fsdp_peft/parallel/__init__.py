"""How the model is spread over processes: FSDP2/FSDP1 wrapping and its policies, what is sharded and how, the CPU
(gloo) route, and sequence parallelism.

Everything here works on a model already built by `fsdp_peft.model`; nothing here knows which procedure trains
it. Import from the module: this package imports none of them.
"""
