"""The GRPO recipe with its rollouts held fixed, for the 2-rank vs one-process equivalence tests.

`fsdp_peft.procedures.rl.GRPO_PROCEDURE` runs unchanged (model build, FSDP, TRL's reward scoring, advantages, reference
pass and loss) except for sampling: each completion is a function of its prompt and its place in its group, and the
reward (`token_reward`, named in the YAML as ``grpo_fixed_rollouts:token_reward``) a function of the completion alone.
So 2 ranks x B and one process x 2B see the same completions, rewards and advantages, and what is left to compare is the
sharded loss and gradients. The generation batch keeps its order (TRL shuffles it before cutting it into micro-batches):
one process accumulating 2 micro-batches of B then holds exactly the rows each rank holds, which bf16 (QLoRA) needs, as
its sums round differently over other partitions of the same rows. The first optimizer step's adapter gradients
(unsharded; the tests set ``max_grad_norm 0``, so no clipping) are written to ``--grads_out`` by rank 0.

    accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml tests/distributed/grpo_fixed_rollouts.py \
        --grads_out grads.pt --output_dir ... [--key value ...]
"""

from __future__ import annotations

import os
import sys
import zlib

import torch
import torch.distributed as dist
import trl.trainer.grpo_trainer
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import TrainerCallback

from fsdp_peft.procedures import rl
from fsdp_peft.recipe import run_recipe
from fsdp_peft.settings.catalog import CONFIGS


def token_reward(completions, completion_ids, **kwargs) -> list[float]:
    """A reward of the completion's tokens alone (so the same on every rank), spread over [0, 1)."""
    return [(sum(ids) % 97) / 97 + 0.01 * len(ids) for ids in completion_ids]


def fixed_completion(prompt: list[int], place: int, length: int, vocabulary: list[int], eos: int) -> list[int]:
    """``length`` or fewer tokens chosen by a hash of the prompt and the place in its group; every third ends
    with EOS (a shorter, finished completion), the others run to the length limit."""
    generator = torch.Generator().manual_seed(zlib.crc32(bytes(str((prompt, place)), "ascii")))
    size = 1 + int(torch.randint(length, (1,), generator=generator)) if place % 3 == 0 else length
    ids = [vocabulary[i] for i in torch.randint(len(vocabulary), (size,), generator=generator).tolist()]
    return ids[:-1] + [eos] if place % 3 == 0 else ids


class FixedRollouts(rl.rollout_trainer()):
    """The recipe's trainer with sampling replaced by `fixed_completion` and the first step's gradients saved."""

    grads_out: str | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(FirstGradients(self.grads_out))

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # A rank's prompts come in whole groups of num_generations copies (the test's batch sizes see to it).
        vocabulary = self.processing_class("abcdefghijklmnopqrstuvwxyz", add_special_tokens=False)["input_ids"]
        length, eos = self.args.max_completion_length, self.eos_token_ids[0]
        completions = [
            fixed_completion(list(p), i % num_generations, length, vocabulary, eos) for i, p in enumerate(prompt_ids)
        ]
        return completions, None


class FirstGradients(TrainerCallback):
    """Every trainable parameter's full gradient at the first optimizer step (gathered from the FSDP2 shards, or
    FSDP1's flat parameters, on every rank; written by rank 0)."""

    def __init__(self, path: str | None):
        self.path = path

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.path is None or state.global_step != 0:
            return
        grads = fsdp1_gradients(model) if isinstance(model, FSDP) else full_gradients(model)
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(grads, self.path)


def full_gradients(model) -> dict[str, torch.Tensor]:
    """Each trainable parameter's full gradient: FSDP2's sharded ones gathered (DTensor), plain ones as they are."""
    grads = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and parameter.grad is not None:
            grad = parameter.grad
            grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().float().cpu()
    return grads


def fsdp1_gradients(model) -> dict[str, torch.Tensor]:
    """Each trainable parameter's full gradient from FSDP1's flat parameters (``use_orig_params: false``): every
    rank's shard of the flat gradient gathered, cut at the parameters' sizes, named without FSDP's wrappers."""
    grads = {}
    for prefix, unit in model.named_modules():
        handle = unit._handle if isinstance(unit, FSDP) else None
        if handle is None or handle.flat_param.grad is None:
            continue
        shard = handle.flat_param.grad.detach().contiguous()
        shards = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(shards, shard)
        flat, offset = torch.cat(shards), 0
        for fqn, shape, numel in zip(handle.flat_param._fqns, handle.flat_param._shapes, handle.flat_param._numels):
            name = f"{prefix}.{fqn}" if prefix else fqn
            grads[name.replace("_fsdp_wrapped_module.", "")] = flat[offset : offset + numel].view(shape).float().clone()
            offset += numel
    return grads


if __name__ == "__main__":
    if "--grads_out" in sys.argv:
        at = sys.argv.index("--grads_out")
        FixedRollouts.grads_out = sys.argv[at + 1]
        del sys.argv[at : at + 2]
    rl.rollout_trainer = lambda: FixedRollouts
    trl.trainer.grpo_trainer.shuffle_sequence_dict = lambda batch: batch
    run_recipe("llama_grpo", CONFIGS / "llama_grpo" / "tiny.yaml", procedure=rl.GRPO_PROCEDURE)
