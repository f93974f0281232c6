"""Run under torchrun (2 gloo ranks): greedy generation from an FSDP1 model wrapped by ``torch.compile``.

FSDP1 frees the root's flat parameter between forwards; `register_generate` must find the FSDP root behind
the compiled module to gather it around ``generate``. Prints one JSON line on rank 0: the sharded and the
unsharded token ids, and whether ``generate`` was registered on the FSDP root.
"""

import functools
import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from fsdp_peft.core.distributed import release_process_group, start_process_group
from fsdp_peft.model.paths import tiny_model_path
from fsdp_peft.parallel.fsdp_policies import register_generate

start_process_group()
try:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32).eval()
    prompt = torch.tensor([[1, 72, 101, 108, 108, 111]])
    with torch.no_grad():
        reference = model.generate(prompt, max_new_tokens=8, do_sample=False)[0].tolist()
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    sharded = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=False)
    with torch.no_grad():
        sharded(prompt)  # one forward, as training does before generating: the root is resharded after it
    compiled = torch.compile(sharded)
    register_generate(compiled)
    with torch.no_grad():
        tokens = compiled.generate(prompt, max_new_tokens=8, do_sample=False)[0].tolist()
    if dist.get_rank() == 0:
        print(json.dumps({"reference": reference, "sharded": tokens, "registered": "generate" in vars(sharded)}))
finally:
    release_process_group()
