"""This process's place in the launch and its process group: the one reader of the launcher's environment.

Every distributed entry point (recipes, ``fsdp-peft generate``/``export``) joins the group through
`start_process_group` and leaves through `release_process_group`; everything else asks `ranks()`.
"""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_peft.core._compat.torch_patches import process_groups_released


@dataclass(frozen=True)
class Ranks:
    """This process's place in the launch: global and node-local rank and sizes."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0


def ranks() -> Ranks:
    """The launcher's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE`` (one process without them)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    return Ranks(
        rank=int(env.get("RANK", "0")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=world,
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
    )


def start_process_group() -> None:
    """Join the launcher's process group (NCCL on GPUs, gloo on the CPU) unless one exists, and make sure it
    is torn down before the interpreter ends, whatever happens (`release_process_group` at exit)."""
    atexit.register(release_process_group)
    if dist.is_initialized() or ranks().world_size < 2:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(ranks().local_rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def release_process_group() -> None:
    """Destroy the process group and join its native threads while the interpreter is whole; every distributed
    entry point ends here (in ``finally``, and again at exit).

    Threads of a process group left running into interpreter shutdown race finalization and the C++ static
    destructors: finished runs aborted at exit ("terminate called without an active exception", SIGABRT),
    which the launcher reports as a failure. torch's destroy alone leaves them running under FSDP2
    (`fsdp_peft.core._compat.torch_patches.process_groups_released`); a thread still running afterwards is named in a
    warning."""
    if not dist.is_available():
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    if still_running := process_groups_released():
        # fsdp_peft.core.log's logger by its name (that module reads this one's ranks)
        logging.getLogger("fsdp_peft").warning(
            f"{len(still_running)} native threads of the process group outlived it ({', '.join(still_running)}): "
            "something still holds the group; the process may abort at exit"
        )


def gathered_from_every_rank(value) -> list:
    """``value`` of every rank, in rank order (``[value]`` without a process group); collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
