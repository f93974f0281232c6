"""Run under torchrun (2 gloo ranks): which process-group threads outlive torch's destroy, and ours.

An FSDP2 model trains one step; then ``dist.destroy_process_group()`` alone, then
`fsdp_peft.core._compat.torch_patches.process_groups_released`. Prints one JSON line on rank 0 with the process-group
thread names running at each point: {"training": [...], "after_torch_destroy": [...], "after_release": [...]}."""

import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from fsdp_peft.core._compat.torch_patches import process_group_threads, process_groups_released
from fsdp_peft.core.distributed import ranks, start_process_group


def train_one_step() -> None:
    """An FSDP2 model (two units and a root), one step: DTensors, a device mesh, gathers and reductions."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).square().mean().backward()
    optimizer.step()


start_process_group()
train_one_step()
threads = {"training": process_group_threads()}
dist.destroy_process_group()
threads["after_torch_destroy"] = process_group_threads()
threads["after_release"] = process_groups_released()
if ranks().is_main:
    print(json.dumps(threads))
