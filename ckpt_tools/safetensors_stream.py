"""Write HF safetensors shards one tensor at a time, from several threads. The safetensors library
writes a whole file from a dict in memory; its format (8-byte header length, JSON header, raw data)
lets each header be written up front from shapes alone, so every tensor has a known file and offset
and any thread can write it there (pwrite) in any order, with only the tensors in flight in memory."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
INDEX = "model.safetensors.index.json"
def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.tensor([], dtype=dtype).element_size()


def plan_shards(tensors: list[tuple[str, tuple[int, ...], torch.dtype]],
                shard_bytes: int) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """huggingface_hub's split_state_dict_into_shards: in order, a new shard when the next tensor would
    pass the cap; a tensor larger than the cap gets a shard of its own (the current one goes on)."""
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = []
    current: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    size = 0
    for entry in tensors:
        n = _nbytes(entry[1], entry[2])
        if n > shard_bytes:
            shards.append([entry])
            continue
        if size + n > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += n
    if current or not shards:
        shards.append(current)
    return shards


class StreamingSafetensorsWriter:
    """All shard files are created (header written, data area sized) at once; `write` may then be
    called from any thread, once per tensor, in any order. HF's shard naming and index."""

    def __init__(self, folder: Path, tensors: list[tuple[str, tuple[int, ...], torch.dtype]], shard_bytes: int):
        self.folder = Path(folder)
        self.shards = plan_shards(tensors, shard_bytes)
        count = len(self.shards)
        self.files = ["model.safetensors"] if count == 1 else [
            f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self.total_bytes = sum(_nbytes(s, d) for _, s, d in tensors)
        self._fds: list[int] = []
        self._where: dict[str, tuple[int, int, int]] = {}  # name -> (fd, file offset, bytes)
        try:
            for shard, file in zip(self.shards, self.files):
                self._create(shard, self.folder / file)
        except BaseException:
            self._close_fds()
            raise
        self._lock = threading.Lock()
        self._written: set[str] = set()

    def _create(self, shard: list[tuple[str, tuple[int, ...], torch.dtype]], path: Path) -> None:
        header: dict[str, dict] = {}
        offset = 0
        for name, shape, dtype in shard:
            n = _nbytes(shape, dtype)
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format aligns data to 8 bytes
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fds.append(fd)
        start = 8 + len(raw)
        os.pwrite(fd, len(raw).to_bytes(8, "little") + raw, 0)
        os.ftruncate(fd, start + offset)
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            self._where[name] = (fd, start + begin, end - begin)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one planned tensor at its place; thread-safe (each tensor owns its byte range)."""
        with self._lock:
            if name not in self._where or name in self._written:
                raise RuntimeError(f"tensor {name} is not planned or was written twice")
            self._written.add(name)
        fd, offset, size = self._where[name]
        data = tensor.contiguous().view(torch.uint8).reshape(-1).numpy().data  # the buffer itself: no copy
        if len(data) != size:
            raise RuntimeError(f"tensor {name} has {len(data)} bytes, its header says {size}")
        while data:
            done = os.pwrite(fd, data, offset)
            data, offset = data[done:], offset + done

    def _close_fds(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def close(self) -> None:
        """Check every tensor arrived, fsync the shards (in parallel) and write the index."""
        if len(self._written) != len(self._where):
            self._close_fds()
            raise RuntimeError(f"only {len(self._written)} of {len(self._where)} tensors were written")
        try:
            with ThreadPoolExecutor(min(8, len(self._fds))) as pool:
                list(pool.map(os.fsync, self._fds))
        finally:
            self._close_fds()
        if len(self.files) > 1:
            weight_map = {name: self.files[i] for i, shard in enumerate(self.shards) for name, _, _ in shard}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.folder / INDEX).write_text(json.dumps(index, indent=2))
