"""The prompt data checked at submit (and by --dry-run) with the trainer's own reader
(rollout/data.py), streamed and bounded: every bad row by file:line, and prompts longer than the
model's context (an error: no engine can take them) or than --rollout-max-prompt-len (a note: they
are dropped, as slime drops them)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ckpt_tools.qwen3_5_config import language_model_config
from rollout.data import DataError, read_prompt_rows

CHECK_MAX_ROWS = 200_000  # rows read at submit; the rest is checked when the trainer reads the file
CHECK_MAX_SECONDS = 20.0  # time spent reading at submit, whichever bound comes first
MAX_REPORTED = 10  # bad rows named one per line; the count of the rest follows
_MAX_CHARS_PER_TOKEN = 64  # no tokenizer's token is longer: a prefix of limit x 64 chars decides "too long"


def check_prompt_data(path: Path, *, input_key: str, label_key: str | None, metadata_key: str | None,
                      tool_key: str | None, hf_checkpoint: str, max_prompt_len: int | None,
                      notes: list[str]) -> list[str]:
    """Problems of the prompt file, one line each (empty: fine); `notes` gets what was only noted."""
    try:
        rows = read_prompt_rows(Path(path), input_key, label_key, metadata_key, tool_key)
        lengths = _PromptLengths(hf_checkpoint)
        problems: list[str] = []
        bad = checked = 0
        dropped: list[str] = []
        deadline = time.monotonic() + CHECK_MAX_SECONDS
        for where, row in rows:
            checked += 1
            problem: DataError | str | None = None
            if isinstance(row, DataError):
                problem = row
            elif lengths.over(row["prompt"], lengths.context):
                problem = (f"{where}: the prompt is longer than the model's context ({lengths.context} tokens, "
                           "max_position_embeddings); shorten or remove it")
            elif lengths.over(row["prompt"], max_prompt_len):
                dropped.append(where)
            if problem is not None:
                bad += 1
                if bad <= MAX_REPORTED:
                    problems.append(str(problem))
            if checked >= CHECK_MAX_ROWS or time.monotonic() > deadline:
                notes.append(f"--prompt-data {path}: checked the first {checked} rows (the submit-time bound is "
                             f"{CHECK_MAX_ROWS} rows or {CHECK_MAX_SECONDS:.0f} s); the trainer checks the rest "
                             "as it reads them")
                break
    except DataError as err:
        return [str(err)]
    if bad > MAX_REPORTED:
        problems.append(f"--prompt-data {path}: {bad - MAX_REPORTED} more bad rows")
    if not checked:
        problems.append(f"--prompt-data {path} holds no prompts")
    elif dropped and len(dropped) == checked:
        problems.append(f"--prompt-data {path}: every prompt is longer than --rollout-max-prompt-len "
                        f"{max_prompt_len} tokens; raise it")
    elif dropped:
        notes.append(f"--prompt-data {path}: {len(dropped)} prompts are longer than --rollout-max-prompt-len "
                     f"{max_prompt_len} tokens and will be dropped, as slime does (first: {dropped[0]})")
    return problems


class _PromptLengths:
    """Prompt lengths in tokens, paid for only where it matters: a token is at least one byte of
    UTF-8, so a prompt of at most `limit` bytes is within `limit` tokens without tokenizing."""

    def __init__(self, hf_checkpoint: str) -> None:
        self.hf_checkpoint = hf_checkpoint
        try:
            config = language_model_config(json.loads((Path(hf_checkpoint) / "config.json").read_text()))
            self.context: int | None = config.get("max_position_embeddings")
        except (OSError, ValueError):
            self.context = None
        self._tokenizer: Any = None

    def over(self, prompt: str | list[dict[str, str]], limit: int | None) -> bool:
        """Whether the prompt is more than `limit` tokens. Only a prefix that must hold more than
        `limit` tokens if the whole does is tokenized, so a 10 MB line costs no more than a short one."""
        text = prompt if isinstance(prompt, str) else "".join(str(m.get("content", "")) for m in prompt)
        if limit is None or len(text.encode()) <= limit:
            return False
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.hf_checkpoint)
        # Tokens of a prefix never outnumber the whole's by more than the one split at the cut.
        head = text[: (limit + 1) * _MAX_CHARS_PER_TOKEN]
        return len(self._tokenizer(head, add_special_tokens=False)["input_ids"]) > limit + (head != text)
