"""Megatron's torch_dist checkpoint format through plain torch.distributed.checkpoint (no process
group, no megatron import): chunked writes whose data is produced on demand, region reads, and
the Megatron files around them (common.pt, metadata.json, writing the tracker; the folder names
and reading the tracker are ckpt_tools.tracker's)."""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)

from contract.job_dir import write_atomic

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a global tensor, produced only when it is written."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n * torch.tensor([], dtype=self.dtype).element_size()


class _ChunkSavePlanner(DefaultSavePlanner):
    """Plans exactly the given chunks and byte entries; DCP's own global planning builds (and
    validates: no overlaps, in bounds) the metadata from them."""

    def __init__(self, chunks: list[Chunk], byte_entries: dict[str, bytes], on_written: Callable[[int], None]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(c.key, c.offsets): c for c in chunks}
        self._bytes = byte_entries
        self._on_written = on_written

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(c.key, torch.Size(c.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                    properties=TensorProperties(dtype=c.dtype),
                    size=torch.Size(c.global_shape),
                ),
            )
            for c in self._chunks.values()
        ]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self._bytes]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._bytes[write_item.index.fqn])
        if write_item.index.offset is None:
            raise RuntimeError(f"write item {write_item.index.fqn}: a tensor without its offset")
        chunk = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        tensor = chunk.produce().to(chunk.dtype).reshape(chunk.sizes).contiguous()
        self._on_written(chunk.nbytes)
        return tensor


def write_chunks(folder: Path, chunks: list[Chunk], byte_entries: dict[str, bytes], threads: int,
                 on_written: Callable[[int], None] = lambda n: None) -> None:
    """Write a torch_dist folder (.metadata and __0_K.distcp files, fsync'd) from lazy chunks."""
    writer = dcp.FileSystemWriter(str(folder), single_file_per_rank=True, sync_files=True, thread_count=threads)
    with _single_process():
        dcp.save({}, storage_writer=writer, planner=_ChunkSavePlanner(chunks, byte_entries, on_written), no_dist=True)


class _RegionLoadPlanner(LoadPlanner):
    """Reads the requested regions of stored tensors into fresh buffers, whatever their chunking."""

    def __init__(self, regions: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]):
        self.regions = regions
        self.out: dict[str, torch.Tensor] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for key, (offsets, sizes) in self.regions.items():
            md = self.metadata.state_dict_metadata[key]
            self.out[key] = torch.empty(sizes, dtype=md.properties.dtype)
            region = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items += create_read_items_for_chunk_list(key, md, [region])
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise ValueError(f"{read_item.dest_index.fqn} holds bytes, not a tensor")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self.out[read_item.dest_index.fqn]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out views of the output buffers


@contextmanager
def _single_process() -> Iterator[None]:
    """DCP warns that no process group is set up: running in one process is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_metadata(folder: Path) -> Metadata:
    return dcp.FileSystemReader(str(folder)).read_metadata()


def tensor_entries(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def read_regions(folder: Path, regions: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """key -> (offsets, sizes): read just those regions of a torch_dist folder."""
    planner = _RegionLoadPlanner(regions)
    with _single_process():
        dcp.load({}, storage_reader=dcp.FileSystemReader(str(folder)), planner=planner, no_dist=True)
    return planner.out


# ---- Megatron's files around the DCP ones ----------------------------------------------------

def write_megatron_files(ckpt_folder: Path, common: dict) -> None:
    """common.pt and metadata.json beside the DCP files, fsync'd."""
    buffer = io.BytesIO()
    torch.save(common, buffer)
    write_atomic(ckpt_folder / "common.pt", buffer.getvalue())
    write_atomic(ckpt_folder / "metadata.json", json.dumps(METADATA_JSON))
