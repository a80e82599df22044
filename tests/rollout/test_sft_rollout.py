"""step_loss_mask, where slime applies it: the SFT rollout tokenizes each conversation with the
loss mask of --loss-mask-type, assistant turns trained unless their step_loss_mask is 0; the
mask reaches the trainer's TrainSample, and a masked turn contributes nothing to the loss."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.loss_masks import LOSS_MASK_TYPES, LossMaskGenerator
from rollout.sft_rollout import generate_rollout
from rollout.tiny_model import write_tiny_model
from trainer.batch import TrainSample
from trainer.losses import policy_loss

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "one"},
    {"role": "assistant", "content": "1"},
    {"role": "user", "content": "two"},
    {"role": "assistant", "content": "wrong", "step_loss_mask": 0},
    {"role": "user", "content": "two?"},
    {"role": "assistant", "content": "2"},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _trained_text(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The runs of trained tokens, decoded."""
    runs, run = [], []
    for token, m in zip(ids, mask):
        if m:
            run.append(token)
        elif run:
            runs, run = runs + [tokenizer.decode(run)], []
    return runs + ([tokenizer.decode(run)] if run else [])


@pytest.mark.parametrize("kind", ["qwen", "qwen3", "qwen3_5"])
def test_only_assistant_turns_with_step_loss_mask_1_are_trained(tokenizer, kind: str) -> None:
    ids, mask = LossMaskGenerator(tokenizer, kind).get_loss_mask(CONVERSATION)
    assert ids == tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    # each trained turn: its content through <|im_end|> and the newline (the header is not trained)
    assert _trained_text(tokenizer, ids, mask) == ["1<|im_end|>\n", "2<|im_end|>\n"]
    unmasked = [{k: v for k, v in m.items() if k != "step_loss_mask"} for m in CONVERSATION]
    _, mask = LossMaskGenerator(tokenizer, kind).get_loss_mask(unmasked)
    assert _trained_text(tokenizer, ids, mask) == ["1<|im_end|>\n", "wrong<|im_end|>\n", "2<|im_end|>\n"]


def test_distill_qwen_trains_the_last_message_unless_masked(tokenizer) -> None:
    generator = LossMaskGenerator(tokenizer, "distill_qwen")
    ids, mask = generator.get_loss_mask(CONVERSATION[1:3])
    assert _trained_text(tokenizer, ids, mask) == ["1"]
    _, mask = generator.get_loss_mask([CONVERSATION[1], {**CONVERSATION[2], "step_loss_mask": 0}])
    assert not any(mask)
    with pytest.raises(ValueError, match="--loss-mask-type nope: one of " + ", ".join(LOSS_MASK_TYPES)):
        LossMaskGenerator(tokenizer, "nope")


def test_a_masked_turn_contributes_nothing_to_the_loss(model: Path, tokenizer, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    # slime's SFT recipes read parquet; a message without step_loss_mask gets a null there
    data = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": CONVERSATION}]), data)
    buffer = DataBuffer(JsonlDataSource(data, input_key="messages", shuffle=False))
    args = SimpleNamespace(hf_checkpoint=str(model), loss_mask_type="qwen", rollout_batch_size=1)
    [[sample]] = generate_rollout(args, 0, buffer)
    train = TrainSample.from_sample(sample)
    assert train.tokens.tolist() == tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    response = train.tokens[train.prompt_length:].tolist()
    assert tokenizer.decode(response).startswith("1<|im_end|>")  # the response starts at the first trained turn
    assert _trained_text(tokenizer, response, train.loss_mask.int().tolist()) == ["1<|im_end|>\n", "2<|im_end|>\n"]

    # The trainer's loss on the tiny model's log-probs: its gradient reaches the logits that
    # predict the trained turns' tokens, and not one of those predicting the masked turn's.
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    logits = lm(train.tokens[None]).logits[0].detach().requires_grad_(True)
    predicting = logits[train.prompt_length - 1: -1]  # the position before each response token
    logp = torch.log_softmax(predicting, -1).gather(-1, train.tokens[train.prompt_length:, None])[:, 0]
    loss, _ = policy_loss(logp[None], logp.detach()[None], torch.ones(1, train.response_length),
                          train.loss_mask[None], eps_clip=0.2)
    loss.backward()
    touched = logits.grad[train.prompt_length - 1: -1].abs().sum(-1) > 0
    assert touched.tolist() == train.loss_mask.bool().tolist()
    wrong = tokenizer("wrong", add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(response)) if response[i: i + len(wrong)] == wrong)
    assert not touched[start: start + len(wrong)].any() and touched.sum() == len(
        tokenizer("1<|im_end|>\n2<|im_end|>\n", add_special_tokens=False)["input_ids"])


def test_the_sft_rollout_needs_conversations(model: Path, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "a plain prompt"}\n')
    args = SimpleNamespace(hf_checkpoint=str(model), loss_mask_type="qwen", rollout_batch_size=1)
    with pytest.raises(ValueError, match="the SFT rollout needs each prompt as a list of messages"):
        generate_rollout(args, 0, DataBuffer(JsonlDataSource(data)))
