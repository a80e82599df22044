"""Tensors handed to another process of the same machine by reference, in the form SGLang's
/update_weights_from_tensor takes (sglang.srt.utils.MultiprocessingSerializer: a pickle made with
torch's multiprocessing reductions, base64'd): a CUDA tensor travels as a CUDA IPC handle of its GPU
memory, a CPU tensor as the name of a shared-memory file. The receiver maps them; nothing is copied
until it copies the values into its own weights.

A CUDA tensor names its GPU by UUID instead of index, as SGLang's patch of torch's reductions does
(sglang.srt.utils.patch_torch): two processes on one GPU may number it differently under their own
CUDA_VISIBLE_DEVICES. A real SGLang engine maps the UUID back with that patch; the receiver here with
its own unpickler, which also admits nothing but the tensor classes, dtypes and rebuild functions
that tensors by reference need (a payload cannot run other code).

The sender must keep its tensors alive until the receiver has copied them (the call that carried
them returned). CPU tensors must be views of a shared_buffer: an anonymous memory file the receiver
maps through /proc (slurmrl's own form: torch's CPU sharing needs a torch_shm_manager daemon, which
the sender would start and which outlives it while receivers hold its memory). SGLang takes CUDA only.

A bucket goes either as a list of (name, tensor), each tensor a handle of its own (load_format None),
or as SGLang's load_format "flattened_bucket": one 1-D tensor of one dtype and each name's place in
it (flattened_bucket, reconstruct), so the receiver maps one handle a bucket, not one a tensor.
"""

from __future__ import annotations

import base64
import io
import itertools
import os
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
from torch.multiprocessing import reductions

# rebuild_cuda_tensor's argument that holds the device index (torch's signature; SGLang's patch
# changes the same one)
_DEVICE_ARG = 6
_REBUILD_CUDA = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")


class TensorHandleError(Exception):
    """A payload that is not tensors by reference, or names a GPU this process cannot see."""


_MEMFD = "slurmrl-weights-"  # the name of every shared_buffer's memory file
_buffers = itertools.count()
_shared_files: dict[int, str] = {}  # data_ptr of a live CPU shared_buffer -> the path that maps it
_BUFFER_PATH = re.compile(r"/proc/\d+/fd/\d+")


@contextmanager
def shared_buffer(nbytes: int, device: torch.device) -> Iterator[torch.Tensor]:
    """A uint8 buffer another process of this machine can map while the block runs: on a GPU, any
    (its IPC handle is made when it is pickled); on the CPU, an anonymous memory file (memfd) that
    others open through /proc/<pid>/fd: nothing in /dev/shm, nothing left if the sender dies."""
    if device.type == "cuda":
        yield torch.empty(nbytes, dtype=torch.uint8, device=device)
        return
    fd = os.memfd_create(f"{_MEMFD}{next(_buffers)}")
    try:
        os.ftruncate(fd, max(nbytes, 1))
        path = f"/proc/{os.getpid()}/fd/{fd}"
        buffer = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
        _shared_files[buffer.data_ptr()] = path
        try:
            yield buffer[:nbytes]
        finally:
            del _shared_files[buffer.data_ptr()]
    finally:
        os.close(fd)  # the mapping keeps the memory while a view of it lives


def _map_cpu(path: str, nbytes: int, offset: int, dtype: torch.dtype, size: list[int], stride: list[int]
             ) -> torch.Tensor:
    """A view of a sender's shared_buffer (offset: in elements of dtype); no other file."""
    try:
        if not (_BUFFER_PATH.fullmatch(path) and os.readlink(path).startswith(f"/memfd:{_MEMFD}")):
            raise TensorHandleError(f"{path} is not a sender's shared buffer")
        buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError) as err:
        raise TensorHandleError(f"cannot map {path}: {err} (the sender must share this machine)") from err
    if 0 in size:
        return torch.empty(size, dtype=dtype)
    extent = 1 + sum((n - 1) * step for n, step in zip(size, stride))  # elements the view spans
    start = offset * dtype.itemsize
    return buffer[start:start + extent * dtype.itemsize].view(dtype).as_strided(size, stride)


class _Pickler(ForkingPickler):
    """torch's reductions (ForkingPickler's table), with the GPU of a CUDA tensor named by UUID."""

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        if obj.is_cuda:
            rebuild, args = reductions.reduce_tensor(obj)
            uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
            return rebuild, (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1:])
        storage = obj.untyped_storage()
        path = _shared_files.get(storage.data_ptr())
        if path is None:
            raise TensorHandleError("a CPU tensor goes by reference only as a view of a shared_buffer")
        return _map_cpu, (path, storage.nbytes(), obj.storage_offset(), obj.dtype, list(obj.shape), list(obj.stride()))


def serialize(obj: Any) -> str:
    """`obj` (e.g. a list of (name, tensor)) as one entry of serialized_named_tensors."""
    buffer = io.BytesIO()
    _Pickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode()


def _device_index(device: int | str) -> int:
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device:
            return index
    raise TensorHandleError(f"the tensors are on GPU {device}, which this process does not see "
                            f"(CUDA_VISIBLE_DEVICES={torch.cuda.device_count()} GPUs): they must share one GPU")


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    index = _device_index(args[_DEVICE_ARG])
    rebuild: Any = reductions.rebuild_cuda_tensor  # typed with fewer arguments than torch passes it
    return rebuild(*args[:_DEVICE_ARG], index, *args[_DEVICE_ARG + 1:])


# What a payload may name besides the two rebuild functions: the classes and dtypes a tensor's
# reduction refers to (torch's own reduce_tensor for CUDA tensors), nothing that runs code.
# (A flattened bucket's metadata entries are SimpleNamespaces: plain attributes, no code.)
_TYPES = {("torch", "Tensor"), ("torch", "Size"), ("torch.nn.parameter", "Parameter"),
          ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("types", "SimpleNamespace")}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _REBUILD_CUDA:
            return _rebuild_cuda_tensor
        if (module, name) == (__name__, "_map_cpu"):
            return _map_cpu
        if (module, name) in _TYPES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise TensorHandleError(f"a tensor payload may hold tensors only, not {module}.{name}")


def deserialize(payload: str) -> Any:
    """What serialize() was given, its tensors mapped from the sender's memory."""
    try:
        data = base64.b64decode(payload, validate=True)
        return _Unpickler(io.BytesIO(data)).load()
    except TensorHandleError:
        raise
    except (ValueError, pickle.UnpicklingError, EOFError, RuntimeError, OSError) as err:
        raise TensorHandleError(f"not tensors by reference: {err}") from err


def flattened_bucket(named: list[tuple[str, torch.Tensor]], flat: torch.Tensor) -> dict[str, Any]:
    """SGLang's "flattened_bucket" for /update_weights_from_tensor: `flat`, a 1-D tensor of one dtype
    holding `named`'s values back to back in order, and each tensor's place in it, with the fields of
    sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata. SGLang reads them as attributes, so
    they go as SimpleNamespaces: any engine unpickles those, with or without slurmrl."""
    metadata, start = [], 0
    for name, tensor in named:
        numel = tensor.numel()
        metadata.append(SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=start,
                                        end_idx=start + numel, numel=numel))
        start += numel
    if flat.dim() != 1 or flat.numel() != start or any(t.dtype != flat.dtype for _, t in named):
        raise TensorHandleError(f"a flattened bucket is one 1-D tensor of its tensors' one dtype and {start} "
                                f"elements, got {flat.dtype} of shape {list(flat.shape)}")
    return {"flattened_tensor": flat, "metadata": metadata}


def reconstruct(bucket: Any) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) views of a flattened bucket, as SGLang's FlattenedTensorBucket makes them
    (a slice of the flat tensor, reshaped, converted where its dtype differs)."""
    if not isinstance(bucket, dict) or set(bucket) != {"flattened_tensor", "metadata"}:
        raise TensorHandleError("a flattened bucket is a dict of flattened_tensor and metadata")
    flat, metadata = bucket["flattened_tensor"], bucket["metadata"]
    if not (isinstance(flat, torch.Tensor) and flat.dim() == 1 and isinstance(metadata, list)):
        raise TensorHandleError("a flattened bucket's flattened_tensor is one 1-D tensor, its metadata a list")
    named = []
    for meta in metadata:
        try:
            name, shape, dtype = meta.name, torch.Size(meta.shape), meta.dtype
            start, end = int(meta.start_idx), int(meta.end_idx)
        except (AttributeError, TypeError, ValueError) as err:
            raise TensorHandleError(f"a flattened bucket's metadata entry lacks a field: {err}") from err
        if not (isinstance(name, str) and isinstance(dtype, torch.dtype)
                and 0 <= start <= end <= flat.numel() and end - start == shape.numel()):
            raise TensorHandleError(f"{name!r}: elements {start}..{end} of {flat.numel()} do not hold shape "
                                    f"{list(shape)}")
        tensor = flat[start:end].reshape(shape)
        named.append((name, tensor if tensor.dtype == dtype else tensor.to(dtype)))
    return named
