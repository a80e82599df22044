"""Where the engine's model lives: the host (the default, for CI and the local demo) or one CUDA GPU
(SGLang's `--device cuda`: a GPU that SLURM bound to the step, picked by `--base-gpu-id` among those
CUDA_VISIBLE_DEVICES shows). Each place puts a model there, says which backend and tensors a
weight-update group uses there, releases the model's memory for /release_memory_occupation and takes
it back, and reports what it holds. Everything else in the engine is the same on both.

On a GPU, `--mem-fraction-static` (SGLang's share of the GPU for weights and KV cache) is a cap this
process cannot pass: torch's allocator is held to that fraction of the GPU's memory
(torch.cuda.set_per_process_memory_fraction), so a load beyond it stops the engine at start with the
flag named, and a batch beyond it fails its requests with CUDA's out-of-memory error, instead of
taking memory that a colocated trainer or another engine on the GPU counts on.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file, save_file

from rollout.cpu_engine.args import ServerArgs
from rollout.weight_group import Backend

Model = TypeVar("Model", bound=torch.nn.Module)
_GIB = 1024**3
# cuBLAS is deterministic only with a fixed workspace (torch.use_deterministic_algorithms needs it).
_DETERMINISTIC_CUBLAS = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


class DeviceError(Exception):
    """The engine cannot use the device its flags ask for; the message names the flag and the fix."""


class HostDevice:
    """--device cpu. Released weights are written to a host file and the model's tensors emptied, so
    the process's memory really goes down; resuming reads them back."""

    name = "cpu"
    torch_device = torch.device("cpu")

    def __init__(self) -> None:
        # Made at a release and removed at the resume: an engine that is killed (as most end) leaves
        # no folder behind unless it is killed while released.
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._backup: Path | None = None

    def place(self, model: Model) -> Model:
        return model

    def update_backend(self, asked: Any) -> Backend:
        """A CPU engine joins every weight-update group over gloo, whatever the trainer asked for."""
        return "gloo"

    def receive_device(self, backend: Backend) -> torch.device:
        return self.torch_device

    def release_weights(self, model: torch.nn.Module) -> None:
        state = {name: t.detach().contiguous() for name, t in unique_parameters(model).items()}
        self._tmp = tempfile.TemporaryDirectory(prefix="cpu-engine-weights-")
        self._backup = Path(self._tmp.name) / "weights.safetensors"
        save_file(state, str(self._backup))
        with torch.no_grad():
            for param in model.parameters():
                param.data = torch.empty(0, dtype=param.dtype)  # freed: a forward now fails loudly

    def restore_weights(self, model: torch.nn.Module) -> None:
        if self._backup is None:
            return
        tensors = load_file(str(self._backup))
        with torch.no_grad():
            for name, param in model.named_parameters():  # a tied weight is listed once
                param.data = tensors[name]
        self._backup = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def free_cache(self) -> None:
        """Nothing to give back: freed CPU tensors go back to the allocator at once."""

    def memory_usage(self) -> dict[str, float]:
        return {}


class CudaDevice:
    """--device cuda: the model on one GPU, capped at --mem-fraction-static of it. Released weights
    go to pinned host memory and the GPU's cached blocks back to the driver (what another process on
    the GPU can then use); resuming copies them back."""

    name = "cuda"

    def __init__(self, index: int, mem_fraction: float | None) -> None:
        self.torch_device = torch.device("cuda", index)
        self.mem_fraction = mem_fraction
        self._host: dict[str, torch.Tensor] = {}
        torch.cuda.set_device(self.torch_device)
        if mem_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(mem_fraction, self.torch_device)

    @property
    def cap_bytes(self) -> int:
        total = torch.cuda.get_device_properties(self.torch_device).total_memory
        return int(total * (self.mem_fraction or 1.0))

    def place(self, model: Model) -> Model:
        try:
            return model.to(self.torch_device)
        except torch.OutOfMemoryError:
            need = sum(p.numel() * p.element_size() for p in unique_parameters(model).values())
            raise DeviceError(f"--mem-fraction-static {self.mem_fraction}: the model's {need / _GIB:.2f} GiB do not "
                              f"fit in {self.cap_bytes / _GIB:.2f} GiB of GPU {self.torch_device.index} (beside what "
                              f"other processes hold there); give a larger fraction or a smaller model") from None

    def update_backend(self, asked: Any) -> Backend:
        """NCCL, as SGLang's engines join, unless the trainer asked for gloo (a trainer on CPU)."""
        return "gloo" if asked == "gloo" else "nccl"

    def receive_device(self, backend: Backend) -> torch.device:
        """NCCL broadcasts into CUDA tensors; gloo into host ones (copied to the GPU when loaded)."""
        return self.torch_device if backend == "nccl" else torch.device("cpu")

    def release_weights(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for name, param in _parameters_and_buffers(model).items():
                host = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=True)
                host.copy_(param.detach())
                self._host[name] = host
                param.data = host  # the GPU copy is dropped; a forward now fails on the device mismatch
        self.free_cache()

    def restore_weights(self, model: torch.nn.Module) -> None:
        if not self._host:
            return
        with torch.no_grad():
            for name, param in _parameters_and_buffers(model).items():
                param.data = self._host[name].to(self.torch_device, non_blocking=True)
        torch.cuda.synchronize(self.torch_device)  # the pinned copies are dropped next
        self._host.clear()

    def free_cache(self) -> None:
        # cuBLAS's workspaces (32 MiB on Hopper) are allocator blocks that empty_cache keeps; the
        # next matmul makes them again
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()

    def memory_usage(self) -> dict[str, float]:
        """In GiB, as SGLang's /server_info memory_usage: this process's tensors (allocated), what its
        allocator holds from the GPU (reserved), the most it ever allocated, and its cap."""
        d = self.torch_device
        return {"allocated_gb": torch.cuda.memory_allocated(d) / _GIB,
                "reserved_gb": torch.cuda.memory_reserved(d) / _GIB,
                "peak_allocated_gb": torch.cuda.max_memory_allocated(d) / _GIB, "cap_gb": self.cap_bytes / _GIB}


EngineDevice = HostDevice | CudaDevice


def open_device(args: ServerArgs) -> EngineDevice:
    """The device of args.device, checked (DeviceError: a one-line reason naming the flag)."""
    if args.device == "cpu":
        return HostDevice()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    if args.enable_deterministic_inference:  # before CUDA makes its first cuBLAS handle
        for name, value in _DETERMINISTIC_CUBLAS.items():
            os.environ.setdefault(name, value)
        torch.use_deterministic_algorithms(True, warn_only=True)
    if not torch.cuda.is_available():
        raise DeviceError(f"--device cuda: torch sees no CUDA device here (CUDA_VISIBLE_DEVICES={visible}); run the "
                          "engine where SLURM binds it a GPU (--rollout-engine standin), or give --device cpu")
    count = torch.cuda.device_count()
    if args.base_gpu_id >= count:
        raise DeviceError(f"--base-gpu-id {args.base_gpu_id}: this process sees {count} CUDA device(s) "
                          f"(CUDA_VISIBLE_DEVICES={visible}); give 0..{count - 1}")
    return CudaDevice(args.base_gpu_id, args.mem_fraction_static)


def _parameters_and_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model holds on its device, once: its parameters and its buffers (rotary
    frequencies...), all of which a release gives back."""
    buffers = {name: b for name, b in model.named_buffers()}
    return {**unique_parameters(model), **buffers}


def unique_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every parameter once (a tied lm_head is the embedding's tensor, under one name)."""
    seen: set[int] = set()
    out: dict[str, torch.nn.Parameter] = {}
    for name, param in model.named_parameters():
        if id(param) not in seen:
            seen.add(id(param))
            out[name] = param
    return out
