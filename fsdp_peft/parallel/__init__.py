"""How the model is spread over processes: FSDP2/FSDP1 wrap and mixed-precision policies (`fsdp_policies`), the
sharding step (`shard`), the wrapped layout as a run records it (`fsdp_layout`), the CPU (gloo) mode accelerate lacks
(`cpu_fsdp`), and sequence parallelism (`sequence_parallel`).

Everything here works on a model `fsdp_peft.model` built; nothing here knows which procedure trains it. Import from
the module: this package imports none of them.
"""
