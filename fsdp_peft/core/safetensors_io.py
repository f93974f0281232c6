"""Safetensors files read and written tensor by tensor, with plain file reads and writes, and byte sizes.

`read_header` and `read_tensors` read a file's header and then one tensor at a time (not a memory map,
which keeps every page read so far resident); `base_tensor_files` maps a checkpoint directory's keys to
its files; `StreamingShardWriter` writes shards in a layout planned up front, one tensor at a time.
`parse_size` reads sizes as users write them (``5GB``, ``2GiB``): shard sizes, GPU memory, gather budgets.
`behind` moves writes to a thread, so that file writes (which release the GIL) overlap with the caller's
work. Export and low-memory loading stream checkpoints through here.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import re
import threading
from pathlib import Path
from typing import Callable, Iterator

import torch

from fsdp_peft.core.errors import ConfigError

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_END = object()


def parse_size(text: str, key: str = "--max-shard-size") -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or bytes as an integer; errors name ``key``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise ConfigError(f"{key}: '{text}' is not a size like 5GB, 500MB or 2GiB")
    unit = (match[2] or "B").upper()
    powers = {
        "B": 1,
        "KB": 1e3,
        "MB": 1e6,
        "GB": 1e9,
        "TB": 1e12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    return int(float(match[1]) * powers[unit])


def read_header(path: Path) -> dict:
    """A safetensors file's header: ``{key: {"dtype", "shape", "data_offsets"}}`` (and ``__metadata__``)."""
    with open(path, "rb") as handle:
        return json.loads(handle.read(int.from_bytes(handle.read(8), "little")))


def read_tensors(path: Path, keys: list[str]):
    """Yield ``(key, tensor)`` from a safetensors file with plain reads, one tensor in memory at a time.

    Memory-mapping (``safe_open``) would keep every page read so far resident for as long as the file
    is open, which on a multi-gigabyte shard is most of the export's memory. Each tensor's bytes are read
    straight into its own storage (no intermediate copy).
    """
    with open(path, "rb", buffering=0) as handle:
        header_size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_size))
        for key in keys:
            entry = header[key]
            start, end = entry["data_offsets"]
            data = torch.empty(end - start, dtype=torch.uint8)
            handle.seek(8 + header_size + start)
            view, done = memoryview(data.numpy()), 0
            while done < len(view):  # a raw read may return fewer bytes than asked
                got = handle.readinto(view[done:])
                if not got:
                    raise ValueError(f"{path}: file ends inside tensor {key} (truncated checkpoint)")
                done += got
            yield key, data.view(SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])


@contextlib.contextmanager
def behind(write: Callable[..., None], depth: int = 1) -> Iterator[Callable[..., None]]:
    """A ``put(*args)`` that hands ``write(*args)`` to a thread, at most ``depth`` calls waiting; leaving the
    block waits for every call to finish. A failed write is raised by the next ``put`` or on leaving."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    failed: list[BaseException] = []

    def consume() -> None:
        while (args := slots.get()) is not _END:
            if not failed:  # after a failure, drain without writing so that ``put`` never blocks for ever
                try:
                    write(*args)
                except BaseException as error:
                    failed.append(error)

    def put(*args) -> None:
        if failed:
            raise failed[0]
        slots.put(args)

    thread = threading.Thread(target=consume, name="fsdp-peft-write-behind", daemon=True)
    thread.start()
    try:
        yield put
    finally:
        slots.put(_END)
        thread.join()
    if failed:
        raise failed[0]


def base_tensor_files(base: Path) -> dict[str, Path]:
    """``{tensor key: safetensors file}`` for the base checkpoint (sharded with an index, or single)."""
    index = base / "model.safetensors.index.json"
    if index.is_file():
        return {key: base / name for key, name in json.loads(index.read_text())["weight_map"].items()}
    single = base / "model.safetensors"
    if not single.is_file():
        raise ConfigError(f"--base: {base} holds no safetensors checkpoint (model.safetensors or its index)")
    return {key: single for key in read_header(single) if key != "__metadata__"}


class StreamingShardWriter:
    """Writes safetensors shards tensor by tensor, straight to disk, in a layout planned up front.

    Every output key, shape and dtype is known from the base headers before anything is merged, so
    each shard's header is written first and tensors follow as they are produced: nothing but the
    tensor in hand is held in memory, whatever the shard size.
    """

    def __init__(self, directory: Path, layout: list[tuple[str, list[int], torch.dtype]], max_bytes: int):
        self.directory = directory
        self.shards: list[list[tuple[str, list[int], torch.dtype]]] = [[]]
        size = 0
        for key, shape, dtype in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            if self.shards[-1] and size + nbytes > max_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append((key, shape, dtype))
            size += nbytes
        self.names = (
            ["model.safetensors"]
            if len(self.shards) == 1
            else [f"model-{n + 1:05d}-of-{len(self.shards):05d}.safetensors" for n in range(len(self.shards))]
        )
        self.order = [(shard, entry) for shard, entries in enumerate(self.shards) for entry in entries]
        self.position, self.handle, self.total = 0, None, 0

    def _open(self, shard: int) -> None:
        if self.handle:
            self.handle.close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, shape, dtype in self.shards[shard]:
            nbytes = math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # tensor data starts 8-byte aligned
        self.handle = open(self.directory / self.names[shard], "wb")
        self.handle.write(len(encoded).to_bytes(8, "little") + encoded)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        shard, (expected, shape, dtype) = self.order[self.position]
        if key != expected or list(tensor.shape) != shape or tensor.dtype != dtype:
            raise RuntimeError(
                f"export: got {key} {list(tensor.shape)} {tensor.dtype}, planned {expected} {shape} {dtype}"
            )
        if self.position == 0 or shard != self.order[self.position - 1][0]:
            self._open(shard)
        if tensor.numel():  # the tensor's own bytes, not a copy
            self.handle.write(tensor.contiguous().view(torch.uint8).numpy())
        self.total += tensor.numel() * tensor.element_size()
        self.position += 1

    def finish(self) -> None:
        """Close the last shard and, for several shards, write Hugging Face's index."""
        if self.handle:
            self.handle.close()
        if self.position != len(self.order):
            raise RuntimeError(f"export: wrote {self.position} of {len(self.order)} planned tensors")
        if len(self.shards) > 1:
            weight_map = {key: self.names[shard] for shard, (key, _, _) in self.order}
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
