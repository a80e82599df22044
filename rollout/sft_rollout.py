"""slime's SFT rollout (`--rollout-function-path rollout.sft_rollout.generate_rollout`, slime's
slime.rollout.sft_rollout): no engine; each prompt is a whole conversation, tokenized with the
loss mask of --loss-mask-type, so the trained tokens are the assistant turns whose
step_loss_mask is 1 (the default). This is where slime applies a message's step_loss_mask.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from rollout.buffer import DataBuffer
from rollout.loss_masks import LossMaskGenerator, response_length
from rollout.sample import Sample, Status


@lru_cache(maxsize=4)
def _generator(hf_checkpoint: str, loss_mask_type: str) -> LossMaskGenerator:
    from transformers import AutoTokenizer

    return LossMaskGenerator(AutoTokenizer.from_pretrained(hf_checkpoint), loss_mask_type)


def generate_rollout(args: Any, rollout_id: int, data_buffer: DataBuffer,
                     evaluation: bool = False) -> list[list[Sample]]:
    if evaluation:
        raise ValueError("the SFT rollout has no eval: it generates nothing")
    generator = _generator(args.hf_checkpoint, getattr(args, "loss_mask_type", "qwen"))
    groups = data_buffer.get(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            to_sft_sample(sample, generator)
    return groups


def to_sft_sample(sample: Sample, generator: LossMaskGenerator) -> Sample:
    """Fill the sample's tokens, response and loss mask from its conversation (reward 0)."""
    if isinstance(sample.prompt, str):
        raise ValueError(f"sample {sample.index}: the SFT rollout needs each prompt as a list of messages "
                         "(--input-key naming them); drop --apply-chat-template")
    token_ids, mask = generator.get_loss_mask(sample.prompt, tools=sample.metadata.get("tools"))
    n = response_length(mask)
    sample.tokens, sample.response_length = token_ids, n
    sample.loss_mask = mask[len(mask) - n:]
    sample.reward, sample.status = 0, Status.COMPLETED
    return sample
