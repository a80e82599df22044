"""--only-train-params-name-list / --freeze-params-name-list, as slime's freeze_model_params: regex
patterns (re.search) over the megatron model's parameter names. With the first, only matching
parameters train; with the second, matching ones are frozen (applied after the first). A frozen
parameter gets no gradient and no optimizer state; the published weights stay whole."""

from __future__ import annotations

import logging
import re
from typing import Any, TypeVar

from torch import nn

from trainer.args_actions import ArgsError

log = logging.getLogger(__name__)
Model = TypeVar("Model", bound=nn.Module)


def freeze_parameters(model: nn.Module, only_train: list[str] | None, freeze: list[str] | None) -> list[str]:
    """Set requires_grad by the patterns; returns the frozen parameters' names. ValueError when
    nothing would train."""
    if only_train:
        for name, param in model.named_parameters():
            param.requires_grad = any(re.search(pattern, name) for pattern in only_train)
    if freeze:
        for name, param in model.named_parameters():
            if any(re.search(pattern, name) for pattern in freeze):
                param.requires_grad = False
    frozen = [name for name, param in model.named_parameters() if not param.requires_grad]
    if frozen and len(frozen) == len(list(model.parameters())):
        raise ValueError(f"--only-train-params-name-list {only_train} / --freeze-params-name-list {freeze} freeze "
                         f"every parameter; names look like {next(iter(dict(model.named_parameters())))!r}")
    return frozen


# megatron's multi-token prediction block: kept, but trained only with --enable-mtp-training
MTP_BLOCK = r"^mtp\."


def frozen(model: Model, options: Any) -> Model:
    """The model with the model options' patterns applied (ArgsError when nothing would train); an
    MTP block without --enable-mtp-training is frozen too, so it stays exactly as loaded (with a
    zero gradient, weight decay would still move it)."""
    freeze = [*(options.freeze_params_name_list or []), *([] if options.enable_mtp_training else [MTP_BLOCK])]
    try:
        names = freeze_parameters(model, options.only_train_params_name_list, freeze)
    except ValueError as err:
        raise ArgsError(str(err)) from None
    if names:
        log.info("%d parameters frozen, e.g. %s", len(names), ", ".join(names[:3]))
    return model
