"""--offload-train: the trainer's GPU memory handed over to colocated engines while they generate.

`offload(keep_weights=False)` moves every model's weights and grads and every optimizer's state
to the host (and gives the freed blocks back to the driver, so that the engines can use them);
`onload()` brings them back to the device. keep_weights=True moves only grads and optimizer state:
the weights stay to be published. Parameters keep their identity (Module.to moves their .data), so the
optimizers, hooks and ties that hold them see the same objects. On a CPU-only machine the device
is the host: the moves change nothing, and the phases still run in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

HOST = torch.device("cpu")


@dataclass
class Offloadable:
    """What a backend holds on its device: its models (actor, reference, critic...) and optimizers."""

    modules: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    device: torch.device
    masters: list[nn.Parameter] = field(default_factory=list)  # fp32 master weights beside bf16 models


class TrainerOffload:
    def __init__(self, held: Offloadable) -> None:
        self.held = held
        self.weights_on_host = False
        self.state_on_host = False  # grads and optimizer state
        self._host_grads: dict[nn.Parameter, torch.Tensor] = {}  # offloaded grads, by parameter

    def offload(self, keep_weights: bool = False) -> None:
        if not self.state_on_host:
            self._move_state(HOST)
            self.state_on_host = True
        if not keep_weights and not self.weights_on_host:
            self._move_weights(HOST)
            self.weights_on_host = True
        if self.held.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def onload(self) -> None:
        device = self.held.device
        if self.weights_on_host:
            self._move_weights(device)
            self.weights_on_host = False
        if self.state_on_host:
            self._move_state(device)
            self.state_on_host = False

    def _params(self) -> Iterable[nn.Parameter]:
        seen: set[int] = set()
        for module in self.held.modules:
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield param

    def _move_weights(self, device: torch.device) -> None:
        # Module.to keeps each Parameter (its .data moves, grads and buffers with it); FSDP2's
        # modules re-point their sharded parameters on it.
        for module in self.held.modules:
            module.to(device)

    def _move_state(self, device: torch.device) -> None:
        """Grads and fp32 masters to `device`; optimizer state to the host, or (onload) back beside
        its parameter: the host copies of --optimizer-cpu-offload keep theirs on the host."""
        with torch.no_grad():
            for master in self.held.masters:  # first: onloaded state goes where its master is
                master.data = master.data.to(device, non_blocking=True)
            # A grad must live on its parameter's device (torch refuses a host grad on a GPU
            # parameter), and the weights may stay on the GPU to be published: host copies of the
            # grads wait aside and come back beside their parameters.
            if device == HOST:
                for param in self._params():
                    if param.grad is not None:
                        self._host_grads[param] = param.grad.to(HOST, non_blocking=True)
                        param.grad = None
            else:
                for param, grad in self._host_grads.items():
                    param.grad = grad.to(param.device, non_blocking=True)
                self._host_grads.clear()
            for optimizer in self.held.optimizers:
                for owner, state in optimizer.state.items():
                    where = HOST if device == HOST else owner.device
                    for key, value in state.items():
                        # Adam's scalar step count stays on the host (torch keeps it there)
                        if torch.is_tensor(value) and value.dim() > 0:
                            state[key] = value.to(where, non_blocking=True)
