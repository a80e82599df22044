"""The engine's state shared by its HTTP routes, and loading it from a model folder."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ckpt_tools.hf_cpu_kernels import use_torch_kernels
from rollout.cpu_engine.args import ServerArgs
from rollout.cpu_engine.codec import Codec
from rollout.cpu_engine.device import EngineDevice, open_device
from rollout.cpu_engine.kv_batch import has_recurrent_layers
from rollout.cpu_engine.scheduler import Scheduler
from rollout.weight_group import UpdateGroup

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rollout.cpu_engine.node_link import NodeLink

STARTING, UP, UNHEALTHY, SHUTTING_DOWN = "Starting", "Up", "UnHealthy", "ShuttingDown"


class EngineLoadError(Exception):
    """The model or tokenizer cannot be loaded."""


@dataclass
class Engine:
    args: ServerArgs
    device: EngineDevice
    model: PreTrainedModel
    codec: Codec
    scheduler: Scheduler
    context_len: int
    model_path: str  # the folder the current weights came from
    health_timeout_s: float
    seeds: random.Random  # seeds of requests without sampling_seed
    status: str = STARTING
    paused: bool = False
    weight_update_open: bool = False  # between /begin_weight_update and /end_weight_update
    groups: dict[str, UpdateGroup] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)  # memory tags released (memory_routes.py)
    link: NodeLink | None = None  # node rank 0 of an engine over several nodes: the other ranks

    def tell_followers(self, op: str, **fields: object) -> None:
        """Have the engine's other node ranks (if any) take their part in a weight-group operation."""
        if self.link is not None:
            self.link.send(op, **fields)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size


def load_engine(args: ServerArgs) -> Engine:
    """The engine of `args`, its model on its device (EngineLoadError, or DeviceError for the device's flags)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    device = open_device(args)  # first: a device the flags cannot have fails before anything is read
    folder = Path(args.model_path)
    if not (folder / "config.json").is_file():
        raise EngineLoadError(f"{folder} is not a Hugging Face model folder (no config.json)")
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer_path)
    except (OSError, ValueError, KeyError) as err:
        raise EngineLoadError(f"cannot load {folder}: {err}") from err
    model.requires_grad_(False)
    # The batched forward keeps every past token per sequence: sliding windows are not honoured (a hybrid's gated
    # delta nets run each sequence in its own cache: rollout.cpu_engine.kv_batch.recurrent_step).
    kinds = getattr(model.config, "layer_types", None) or []
    if any(kind not in ("full_attention", "linear_attention") for kind in kinds):
        raise EngineLoadError(f"{folder} uses sliding-window attention, which the stand-in engine does not support")
    if device.torch_device.type == "cpu" and has_recurrent_layers(model.config):
        use_torch_kernels()  # not fla's (Triton, CUDA only), where installed
    codec = Codec(tokenizer, model.config, args.model_path)
    model = device.place(model)
    return Engine(
        args=args, device=device, model=model, codec=codec,
        scheduler=Scheduler(model, codec, args.weight_version, args.max_running_requests,
                            batch_invariant=args.enable_deterministic_inference,
                            step_hold_s=args.decode_step_hold_ms / 1000),
        context_len=args.context_length or model.config.max_position_embeddings,
        model_path=args.model_path,
        # SGLang's variable and default, so probes behave the same against either engine.
        health_timeout_s=float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20")),
        seeds=random.Random(args.random_seed),
    )
