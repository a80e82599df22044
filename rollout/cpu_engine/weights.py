"""Reading an HF safetensors folder and loading tensors into the live model, all or nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ckpt_tools.architectures import mtp_layer_prefixes
from rollout.cpu_engine.expert_weights import expert_views


class WeightError(Exception):
    """The new weights cannot be loaded; the model keeps its previous weights."""


def read_safetensors_folder(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF model folder (single file or sharded with an index)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise WeightError(f"{folder} is not a folder")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, AttributeError) as err:
            raise WeightError(f"{index} is not a valid safetensors index: {err}") from err
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{folder} holds no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    if name in tensors:
                        raise WeightError(f"tensor {name} appears in more than one file of {folder}")
                    tensors[name] = handle.get_tensor(name)
        except WeightError:
            raise
        except Exception as err:  # safetensors raises its own error types for damaged files
            raise WeightError(f"cannot read {path}: {err}") from err
    return tensors


Plan = list[tuple[torch.Tensor, torch.Tensor]]  # (the model's parameter, its new value)


def load_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor], complete: bool) -> None:
    """Copy `tensors` into the model's parameters, or change nothing and raise WeightError."""
    copy_plan(plan_load(model, tensors, complete))


def _without_mtp_layers(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """As SGLang's DeepSeek-V3 and GLM-4.5 models, the main model passes over the multi-token
    prediction layers' tensors (config.json's num_nextn_predict_layers, after the decoder's layers):
    a draft model for speculative decoding loads those."""
    config = getattr(model, "config", None)
    skipped = mtp_layer_prefixes(config.to_dict()) if config is not None else ()
    return {name: t for name, t in tensors.items() if not name.startswith(skipped)} if skipped else tensors


def _text_model_names(model: torch.nn.Module, tensors: dict[str, torch.Tensor],
                      targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """As transformers loads a checkpoint: a multimodal one's language model (Qwen3.5's model.language_model.)
    under the names of the text model (model.), and what the model's class ignores on loading passed over (the
    text Qwen3.5's: a vision tower, the mtp. module)."""
    prefix = "model.language_model."
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    out = {}
    for name, tensor in tensors.items():
        if name not in targets and name.startswith(prefix):
            name = "model." + name.removeprefix(prefix)
        if name in targets or not any(p.search(name) for p in ignored):
            out[name] = tensor
    return out


def plan_load(model: torch.nn.Module, tensors: dict[str, torch.Tensor], complete: bool) -> Plan:
    """Check `tensors` against the model (WeightError if they do not fit) and pair each with its parameter.

    complete=True (a whole checkpoint) requires every parameter; tied parameters (an lm_head
    sharing the embedding) count as one and may come under either name."""
    targets = model.state_dict(keep_vars=True)
    tensors, expert_plan = expert_views(_text_model_names(model, _without_mtp_layers(model, tensors), targets), targets)
    unknown = sorted(set(tensors) - set(targets))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise WeightError(f"unexpected tensor {unknown[0]}{more}")
    by_storage: dict[int, list[str]] = {}
    for name, target in targets.items():
        by_storage.setdefault(target.data_ptr(), []).append(name)
    plan: Plan = []
    for name, view, tensor in expert_plan:
        if tuple(tensor.shape) != tuple(view.shape):
            raise WeightError(f"tensor {name} has shape {list(tensor.shape)}, the model needs {list(view.shape)}")
    # a fused expert parameter counts as given when some expert's tensor fills part of it (a
    # complete checkpoint holds every expert: the converter checks that)
    filled = {view.untyped_storage().data_ptr() for _, view, _ in expert_plan}
    for names in by_storage.values():
        given = [name for name in names if name in tensors]
        if not given and targets[names[0]].untyped_storage().data_ptr() in filled:
            continue
        if not given:
            if complete:
                raise WeightError(f"missing tensor {names[0]}")
            continue
        target = targets[given[0]]
        for name in given:
            if tuple(tensors[name].shape) != tuple(target.shape):
                raise WeightError(f"tensor {name} has shape {list(tensors[name].shape)}, "
                                  f"the model needs {list(target.shape)}")
            if not torch.equal(tensors[name], tensors[given[0]]):
                raise WeightError(f"tied tensors {given[0]} and {name} differ")
        plan.append((target, tensors[given[0]]))
    plan += [(view, tensor) for _, view, tensor in expert_plan]
    return plan


def copy_plan(plan: Plan) -> None:
    """Copy every new value into its parameter. plan_load checked every name and shape, so a copy fails
    only on a device error, after which the engine is replaced anyway: there is no backup to restore
    (a host copy of every bucket would cost more than the update: SGLang keeps none either)."""
    with torch.no_grad():
        for target, source in plan:
            target.copy_(source)
