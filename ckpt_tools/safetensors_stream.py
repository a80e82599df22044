"""Write HF safetensors shards one tensor at a time. The safetensors library writes a whole file
from a dict in memory; its format (8-byte header length, JSON header, raw data) lets each header
be written up front from shapes alone, so only the tensor being written is ever in memory."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import BinaryIO

import torch

_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
INDEX = "model.safetensors.index.json"


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.tensor([], dtype=dtype).element_size()


class StreamingSafetensorsWriter:
    """Tensors must arrive in the order given; shards split at `shard_bytes`, HF's naming and index."""

    def __init__(self, folder: Path, tensors: list[tuple[str, tuple[int, ...], torch.dtype]], shard_bytes: int):
        self.folder = Path(folder)
        shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for entry in tensors:
            n = _nbytes(entry[1], entry[2])
            if shards[-1] and size + n > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(entry)
            size += n
        count = len(shards)
        self.files = ["model.safetensors"] if count == 1 else [
            f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self.shards = shards
        self.total_bytes = sum(_nbytes(s, d) for _, s, d in tensors)
        self._order = [name for shard in shards for name, _, _ in shard]
        self._next = 0
        self._shard = -1
        self._file: BinaryIO | None = None
        self._remaining: set[str] = set()

    def _open_next_shard(self) -> None:
        self._close_file()
        self._shard += 1
        header: dict[str, dict] = {}
        offset = 0
        for name, shape, dtype in self.shards[self._shard]:
            n = _nbytes(shape, dtype)
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format aligns data to 8 bytes
        self._file = open(self.folder / self.files[self._shard], "wb")
        self._file.write(len(raw).to_bytes(8, "little") + raw)
        self._remaining = set(header)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order) or self._order[self._next] != name:
            raise RuntimeError(f"tensor {name} written out of the planned order")
        if not self._remaining:
            self._open_next_shard()
        self._file.write(tensor.contiguous().view(torch.uint8).numpy())  # the buffer itself: no copy
        self._remaining.discard(name)
        self._next += 1

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def close(self) -> None:
        if self._next != len(self._order):
            raise RuntimeError(f"only {self._next} of {len(self._order)} tensors were written")
        self._close_file()
        if len(self.files) > 1:
            weight_map = {name: self.files[i] for i, shard in enumerate(self.shards) for name, _, _ in shard}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.folder / INDEX).write_text(json.dumps(index, indent=2))
