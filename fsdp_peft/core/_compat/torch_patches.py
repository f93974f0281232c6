"""torch's private parts read or patched: FSDP2 unit state, the process group's threads, FSDP2's accumulated
gradients."""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

from fsdp_peft.core._compat.registry import FSDP2_ACCUMULATED_GRAD, _resolve, _source, patch


def fsdp_param_groups(state) -> list:
    """An FSDP2 unit's parameter groups: torch 2.13 keeps a list (``_fsdp_param_groups``), torch 2.11 (what the GPU
    images this was checked on ship) one group or None (``_fsdp_param_group``)."""
    if hasattr(state, "_fsdp_param_groups"):
        return state._fsdp_param_groups
    return [group] if (group := state._fsdp_param_group) is not None else []


@contextlib.contextmanager
def fsdp2_forward_hooks_detached(units: list) -> Iterator[None]:
    """The forward pre- and post-hooks FSDP2 put on each of ``units`` (FSDP2 modules) set aside for the block, and
    put back, in their places, after it.

    Why: each hook is wrapped in ``torch._dynamo.disable``, so a compiled forward breaks its graph at every unit
    (one graph per layer, no CUDA graph of the whole step). For units the caller keeps gathered, with resharding
    after forward off, the hooks do nothing a decode step needs (the unshard is already done, the reshard is off, no
    gradient is recorded); the mixed-precision casts they would apply are of tensors already in the gathered dtype.
    The hooks are the ones ``FSDPState.init`` registers and keeps as ``_pre_forward_hook_handle`` and
    ``_post_forward_hook_handle`` (torch 2.11-2.13).
    """
    removed: list[tuple[dict, list, dict]] = []  # (a hook table, its keys in order before, what left it)
    try:
        for unit in units:
            state = unit._get_fsdp_state()
            for handle in {state._pre_forward_hook_handle, state._post_forward_hook_handle}:
                # a unit of several modules (``fully_shard([a, b])``) has a handle of another kind: left in place
                for reference in (getattr(handle, "hooks_dict_ref", None), *getattr(handle, "extra_dict_ref", ())):
                    table = reference() if reference is not None else None
                    if table is not None and handle.id in table:
                        removed.append((table, list(table), {handle.id: table.pop(handle.id)}))
        yield
    finally:
        for table, order, taken in reversed(removed):  # each back in its place; hooks added meanwhile kept, after
            current = dict(table)
            table.clear()
            table.update(
                {key: taken[key] if key in taken else current[key] for key in order if key in taken or key in current}
            )
            table.update({key: value for key, value in current.items() if key not in order})


PROCESS_GROUP_THREADS = ("pt_gloo", "gloo_", "pt_nccl")  # name prefixes of c10d's native threads (Linux)


@patch("torch")
def process_groups_released() -> list[str]:
    """Drops what every `DeviceMesh` still holds of its process groups after ``destroy_process_group``, so that the
    groups are destructed (their native threads joined) now, while the interpreter is whole; returns the names of
    process-group threads still running (Linux; empty where it cannot tell).

    Why: torch 2.13's ``destroy_process_group`` unregisters the groups and shuts their backends down, but each
    `DeviceMesh` keeps its groups in ``_pg_registry``, and DTensor's sharding-propagation cache keeps the mesh
    of every DTensor a run created, so the gloo group of an FSDP2 run is never destructed: its 2 worker threads
    and its TCP loop thread were still running at interpreter exit in every recipe run (under gdb its destructor
    never ran), left to race interpreter finalization and the C++ static destructors. That is the state in
    which finished runs aborted at exit ("terminate called without an active exception", SIGABRT). Cleared
    registries are rebuilt from the group names if a mesh is used again; once the model is gone, nothing
    else holds the group. tests/distributed/process_group_release_check.py shows both states.
    Remove when: ``destroy_process_group`` alone joins the threads of an FSDP2 run's group.
    """

    gc.collect()  # the model and trainer of the run: reference cycles
    for mesh in [o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)]:  # type(): no __class__ lookups
        mesh._pg_registry.clear()
    gc.collect()
    return process_group_threads()


@patch(
    "torch",
    still_needed=lambda: (
        "self._unsharded_param.grad is None" in _source(inspect.unwrap(_resolve(FSDP2_ACCUMULATED_GRAD)))
    ),
)
def fsdp2_accumulation_skips_ungathered_parameters() -> None:
    """Makes FSDP2's ``FSDPParam.to_accumulated_grad_if_needed`` return at once for a parameter its unit never
    gathered (idempotent; for every FSDP2 model of the process).

    Why: TRL 1.16's fused log-prob head (DPO, KTO, GRPO) reads ``lm_head.weight`` without calling the head's
    forward, so the output head's own FSDP2 unit (accelerate carves it) is never gathered by its hooks and its
    ``FSDPParam`` never gets an ``_unsharded_param``. On a micro-step without gradient sync (gradient
    accumulation) with a reduce dtype set (bf16 mixed precision: QLoRA), torch's final post-backward callback
    converts every unit's unsharded gradient to the reduce dtype and fails with "'FSDPParam' object has no
    attribute '_unsharded_param'" (docs/compat.md#the-measurements). A
    parameter that was never gathered has no unsharded gradient to convert (the frozen head has none at all).
    Remove when: torch skips parameters that were never unsharded there.
    """
    original = FSDPParam.to_accumulated_grad_if_needed
    if getattr(original, "skips_ungathered", False):
        return

    @functools.wraps(original)
    def skipping_ungathered(self) -> None:
        if not hasattr(self, "_unsharded_param"):  # never gathered: no unsharded gradient
            return
        original(self)

    skipping_ungathered.skips_ungathered = True
    FSDPParam.to_accumulated_grad_if_needed = skipping_ungathered


def process_group_threads() -> list[str]:
    """The names of this process's native threads that belong to a process group (Linux ``/proc``; else empty)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return []
    names = []
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(PROCESS_GROUP_THREADS):
            names.append(name)
    return sorted(names)
