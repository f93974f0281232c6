"""torch's private parts read or patched: FSDP2 unit state, the process group's threads, FSDP2's accumulated
gradients, CPU bf16 matrix products."""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
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


CPU_BF16_PRODUCTS = ("mm", "addmm", "bmm", "baddbmm")  # aten's matrix products: each, its .out form, in place
FP32_FROM_ROWS = (
    32  # fewer rows or columns: aten's bf16 loop beats the weight's fp32 copy (benchmarks/cpu_bf16_products.py)
)
_CPU_BF16: dict = {}  # "originals": aten's own CPU kernels by op name, "library": the registration that replaced them


def cpu_has_native_bf16_products() -> bool:
    """Whether aten multiplies bf16 matrices on this CPU with oneDNN's bf16 GEMM (AVX512 with BW, AVX512-BF16, AMX):
    the question ATen itself asks before using it, on a build with oneDNN, enabled."""
    mkldnn = torch.backends.mkldnn
    return bool(mkldnn.is_available() and mkldnn.enabled and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@patch("torch")
def cpu_bf16_products_in_fp32() -> bool:
    """On a CPU without native bf16 matrix products, replaces aten's CPU kernels of ``mm``, ``addmm``, ``bmm`` and
    ``baddbmm`` (their ``.out`` forms and ``addmm_``, ``baddbmm_``) with ones that compute a product of bf16 tensors
    with at least `FP32_FROM_ROWS` rows and columns as the fp32 product of the same values, rounded once to bf16;
    any other product runs aten's own kernel. Returns whether it was installed now (idempotent; process-wide; CUDA and
    every other device keep their kernels; a CPU with native bf16 products is left as it is).

    Why: where oneDNN has no bf16 GEMM (AVX2 CPUs: Zen 3 and older, most laptops) ATen multiplies bf16 matrices with
    a generic loop, 7-8x slower than its fp32 product (MKL) on a training step's shapes: 15-17 GFLOP/s against
    91-115 for 384 rows through SmolLM2's layers; a bf16 forward and backward of a model spent 85-91 % of its time in
    ``aten::mm`` (docs/compat.md#the-measurements). Below 32 rows (decoding) copying the weight to fp32 costs more
    than the loop for SmolLM2's output layer (at 8 rows for its other layers): those stay aten's. The arithmetic is
    a bf16 GEMM's as GPUs run it: each product of two bf16
    values is exact in fp32, the sums run in fp32, the result is rounded to bf16 once; aten's own loop accumulates in
    fp32 too, so the two agree but for the order of the fp32 sums (nearly every result equal, the others within the
    fp32 sums' error). Autograd's products (a backward's ``mm``), compiled graphs (inductor calls the ``.out``
    forms), bitsandbytes' dequantize-and-multiply and the generation merge (``addmm_``) reach the same kernels.
    Remove when: aten computes bf16 products through its fp32 GEMM itself where oneDNN has none.
    """
    if "originals" in _CPU_BF16 or cpu_has_native_bf16_products():
        return False
    originals, library = {}, torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # torch warns that a kernel is overridden: that is the point
        warnings.simplefilter("ignore")
        for op in CPU_BF16_PRODUCTS:
            for name, form in ((op, "returned"), (f"{op}.out", "out"), (f"{op}_", "in_place")):
                if form == "in_place" and not op.startswith(("addmm", "baddbmm")):
                    continue
                originals[name] = torch.library.get_kernel(f"aten::{name}", "CPU")
                library.impl(name, _in_fp32(originals[name], originals[op], form), "CPU", with_keyset=True)
    _CPU_BF16.update(originals=originals, library=library)
    return True


def aten_cpu_kernel(name: str):
    """aten's own CPU kernel of the op ``name`` (``"mm"``, ``"addmm.out"``): the replaced one, once replaced."""
    return _CPU_BF16.get("originals", {}).get(name) or torch.library.get_kernel(f"aten::{name}", "CPU")


def _in_fp32(original, product, form: str = "returned"):
    """A kernel that runs ``product`` (aten's CPU kernel of a matrix product, returning its result) on the bf16
    operands as fp32 and rounds the result to bf16: returned, written into ``out`` (``form`` "out") or into the first
    operand ("in_place"); products of other dtypes, mixed dtypes or fewer than `FP32_FROM_ROWS` rows or columns go
    to ``original``, the replaced kernel, as they are (its own result, checks and errors)."""

    def kernel(keys, *arguments, **options):
        out = options.get("out")
        operands = [a for a in arguments if isinstance(a, torch.Tensor)] + ([out] if form == "out" else [])
        first, second = [a for a in arguments if isinstance(a, torch.Tensor)][-2:]  # the matrices multiplied
        matrices = first.dim() >= 2 and second.dim() >= 2  # else aten's own error
        if not matrices or min(first.shape[-2], second.shape[-1]) < FP32_FROM_ROWS:
            return original.call_boxed(keys, *arguments, **options)
        if not all(operand.dtype == torch.bfloat16 for operand in operands):
            return original.call_boxed(keys, *arguments, **options)
        upcast = [_fp32(a) if isinstance(a, torch.Tensor) else a for a in arguments]
        if form == "returned":
            return product.call_boxed(keys, *upcast, **options).to(torch.bfloat16)
        result = product.call_boxed(keys, *upcast, **{k: v for k, v in options.items() if k != "out"})
        target = out if form == "out" else arguments[0]
        if form == "out" and target.shape != result.shape:
            if target.numel():  # as aten's resize_output says it
                warnings.warn(
                    f"An output with one or more elements was resized since it had shape {list(target.shape)}, which "
                    f"does not match the required output shape {list(result.shape)}.",
                    stacklevel=2,
                )
            target.resize_(result.shape)
        return target.copy_(result)

    return kernel


def _fp32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in fp32; a batch of one matrix expanded (stride 0: ``F.linear`` on a sliced 3-D input multiplies
    by the weight expanded over the batch) stays one matrix, expanded."""
    if tensor.dim() == 3 and tensor.stride(0) == 0 and tensor.shape[0] > 0:
        return tensor[0].float().expand(tensor.shape)
    return tensor.float()
