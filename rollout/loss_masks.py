"""A conversation's tokens and per-token loss mask, as slime's MultiTurnLossMaskGenerator makes
them (its utils/mask_utils.py; --loss-mask-type): assistant turns are trained, everything else is
not, and an assistant turn with "step_loss_mask" other than 1 is not trained either.

Ported so the masks equal slime's for each tokenizer type; one difference: a message whose
step_loss_mask is null (a parquet struct column fills absent fields with null) counts as absent,
that is 1.
"""

from __future__ import annotations

from typing import Any

LOSS_MASK_TYPES = ("qwen", "qwen3", "qwen3_5", "distill_qwen")
_PROBE = "FOR TESTING ONLY"
_PREFIX_MESSAGE = {"role": "user", "content": "FOR CALCULATING LOSS MASK ONLY"}


def _trained(message: dict[str, Any]) -> bool:
    """slime's `message.get("step_loss_mask", 1) == 1`."""
    step = message.get("step_loss_mask")
    return step is None or step == 1


def _sublist_indices(main: list[int], sub: list[int]) -> list[int]:
    return [i for i in range(len(main) - len(sub) + 1) if main[i: i + len(sub)] == sub]


def _ids(tokenizer: Any, messages: list[dict], **kwargs: Any) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


class LossMaskGenerator:
    def __init__(self, tokenizer: Any, tokenizer_type: str = "qwen") -> None:
        if tokenizer_type not in LOSS_MASK_TYPES:
            raise ValueError(f"--loss-mask-type {tokenizer_type}: one of {', '.join(LOSS_MASK_TYPES)}")
        self.tokenizer, self.tokenizer_type = tokenizer, tokenizer_type
        self.system_message_length = self.gen_token_length = 0
        if tokenizer_type in ("qwen", "qwen3"):
            self.system_message_length, self.gen_token_length = self._system_message_length()

    def _system_message_length(self) -> tuple[int, int]:
        """How many tokens the template's default system message adds before a lone message, and
        how many the assistant header (the generation prompt) has."""
        probe = [{"role": "user", "content": _PROBE}, {"role": "user", "content": _PROBE}]
        raw = self.tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
        text = self.tokenizer.apply_chat_template(probe, add_special_tokens=False, tokenize=False)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        idx_1, idx_2 = _sublist_indices(ids, raw)
        end_interval = len(ids) - len(raw) - idx_2
        with_prompt = _ids(self.tokenizer, probe, add_special_tokens=False, add_generation_prompt=True)
        gen_token_length = len(with_prompt) - len(ids)
        return idx_1 - ((idx_2 - idx_1) - end_interval - len(raw)), gen_token_length

    def get_loss_mask(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        """(token ids, a 0/1 mask per token)."""
        if self.tokenizer_type == "qwen":
            if "<｜Assistant｜>" in self.tokenizer.get_added_vocab():
                return self._distill_qwen(messages, tools)
            return self._qwen(messages, tools)
        if self.tokenizer_type == "qwen3":
            return self._qwen3(messages, tools)
        if self.tokenizer_type == "qwen3_5":
            return self._qwen3_5(messages, tools)
        return self._distill_qwen(messages, tools)

    def _turn_mask(self, message: dict, message_ids: list[int]) -> list[int]:
        if message["role"] == "assistant" and _trained(message):
            return [0] * self.gen_token_length + [1] * (len(message_ids) - self.gen_token_length)
        return [0] * len(message_ids)

    def _qwen(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
        token_ids: list[int] = []
        mask: list[int] = []
        for i, message in enumerate(messages):
            message_ids = _ids(self.tokenizer, [message], **({"tools": tools} if i == 0 else {}))
            if message["role"] != "system" and i > 0:
                message_ids = message_ids[self.system_message_length:]
            token_ids += message_ids
            mask += self._turn_mask(message, message_ids)
        return token_ids, mask

    def _qwen3(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
        token_ids: list[int] = []
        mask: list[int] = []
        prefix_ids = _ids(self.tokenizer, [_PREFIX_MESSAGE])
        i = 0
        while i < len(messages):
            message = messages[i]
            end = i + 1
            if message["role"] == "tool":  # Qwen's templates wrap consecutive tool answers in one user turn
                while end < len(messages) and messages[end]["role"] == "tool":
                    end += 1
            turn = messages[i:end]
            if i == 0:
                message_ids = _ids(self.tokenizer, turn + [_PREFIX_MESSAGE], tools=tools)[: -len(prefix_ids)]
            else:
                message_ids = _ids(self.tokenizer, [_PREFIX_MESSAGE] + turn)[len(prefix_ids):]
            if message["role"] != "system" and i > 0:
                message_ids = message_ids[self.system_message_length:]
            token_ids += message_ids
            mask += self._turn_mask(message, message_ids)
            i = end
        return token_ids, mask

    def _qwen3_5(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
        """By characters: an assistant turn's content (after "<think>\\n") through its <|im_end|>
        and newline is trained; a token is trained if any of its characters is."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, tools=tools, return_dict=False)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        token_ids, offsets = encoded["input_ids"], encoded.get("offset_mapping")
        if offsets is None:
            raise ValueError("--loss-mask-type qwen3_5 needs a fast tokenizer (one with return_offsets_mapping)")
        if token_ids != _ids(self.tokenizer, messages, tools=tools):
            raise ValueError("--loss-mask-type qwen3_5: the rendered text tokenizes differently from "
                             "apply_chat_template(tokenize=True); use another --loss-mask-type")
        header, think, end_marker = "<|im_start|>assistant\n", "<think>\n", "<|im_end|>"
        trained = [0] * (len(text) + 1)  # prefix sums of trained characters
        char_mask = [0] * len(text)
        cursor = 0
        for message in messages:
            if message["role"] != "assistant":
                continue
            header_at = text.find(header, cursor)
            if header_at < 0:
                raise ValueError("--loss-mask-type qwen3_5: an assistant message is not in the rendered template")
            start = header_at + len(header)
            end_at = text.find(end_marker, start)
            if end_at < 0:
                raise ValueError("--loss-mask-type qwen3_5: an assistant message has no <|im_end|>")
            span_end = end_at + len(end_marker)
            if span_end < len(text) and text[span_end] == "\n":
                span_end += 1
            cursor = span_end
            if not _trained(message):
                continue
            if text[start: start + len(think)] == think:
                start += len(think)
            for pos in range(start, span_end):
                char_mask[pos] = 1
        for pos, value in enumerate(char_mask):
            trained[pos + 1] = trained[pos] + value
        mask = [int(end > start and trained[end] - trained[start] > 0) for start, end in offsets]
        return token_ids, mask

    def _distill_qwen(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
        """The first message is the prompt, the last one's content the response."""
        prompt = self.tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True,
                                                    tools=tools)
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_ids = self.tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        token_ids = prompt_ids + response_ids
        if not _trained(messages[-1]):
            return token_ids, [0] * len(token_ids)
        return token_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


def response_length(mask: list[int]) -> int:
    """slime's: from the first trained token to the end (0 if none is trained)."""
    return len(mask) - mask.index(1) if 1 in mask else 0
