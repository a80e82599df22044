"""Prompts from a jsonl or parquet file (by its suffix, as slime reads them), in a seeded order,
epoch after epoch, with an exact resume position."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rollout.sample import Sample


class DataError(ValueError):
    """Bad data: the message names the file, the line and the fix."""


PROMPT_SUFFIXES = (".jsonl", ".parquet")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """Each line's JSON value, or the DataError saying why it is not JSON. A UTF-8 BOM is skipped."""
    with open(path, encoding="utf-8-sig") as f:
        number = 0
        while True:
            try:
                line = f.readline()
            except UnicodeDecodeError as err:
                yield f"{path}:{number + 1}", DataError(f"{path}:{number + 1}: not UTF-8 ({err.reason}); "
                                                        "save the file as UTF-8")
                return
            if not line:
                return
            number += 1
            if not line.strip():
                continue
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as err:
                yield f"{path}:{number}", DataError(f"{path}:{number}: not valid JSON ({err.msg})")


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    number = 0
    for batch in pq.ParquetFile(path).iter_batches():
        for row in batch.to_pylist():
            number += 1
            yield f"{path} row {number}", row


def read_prompt_rows(path: Path, input_key: str, label_key: str | None, metadata_key: str | None,
                     tool_key: str | None = None) -> Iterator[tuple[str, dict[str, Any] | DataError]]:
    """Every row of a prompt file, streamed, as (where, the prompt row) or (where, what is wrong with
    it): the one reader behind the trainer's data and the checks at submit (rollout/data_check.py)."""
    if not path.is_file():
        raise DataError(f"--prompt-data {path} does not exist")
    if path.suffix not in PROMPT_SUFFIXES:
        raise DataError(f"--prompt-data {path}: unsupported format; give a {' or '.join(PROMPT_SUFFIXES)} file")
    for where, row in (_jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path)):
        if isinstance(row, DataError):
            yield where, row
            continue
        try:
            yield where, _prompt_row(where, row, input_key, label_key, metadata_key, tool_key)
        except DataError as err:
            yield where, err


def _prompt_row(where: str, row: Any, input_key: str, label_key: str | None, metadata_key: str | None,
                tool_key: str | None) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: not a JSON object (a {type(row).__name__}); each line must be an object "
                        f"with an {input_key!r} field")
    if input_key not in row:
        raise DataError(f"{where}: no {input_key!r} field (set --input-key to the prompt's field)")
    prompt = row[input_key]
    if not (isinstance(prompt, str) or _is_messages(prompt)):
        raise DataError(f"{where}: {input_key!r} must be a string or a list of "
                        "{'role', 'content'} messages")
    if label_key and label_key not in row:
        raise DataError(f"{where}: no {label_key!r} field (check --label-key)")
    if metadata_key and not isinstance(row.get(metadata_key) or {}, dict):
        raise DataError(f"{where}: {metadata_key!r} must be an object (check --metadata-key)")
    return {"prompt": prompt, "label": row.get(label_key) if label_key else None,
            "metadata": dict(row.get(metadata_key) or {}) if metadata_key else {},
            "tools": row.get(tool_key) if tool_key else None}


def _read_rows(path: Path, input_key: str, label_key: str | None, metadata_key: str | None,
               tool_key: str | None = None) -> list[dict[str, Any]]:
    rows = []
    for _, row in read_prompt_rows(path, input_key, label_key, metadata_key, tool_key):
        if isinstance(row, DataError):
            raise row
        rows.append(row)
    if not rows:
        raise DataError(f"{path} holds no prompts")
    return rows


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


class JsonlDataSource:
    """Hands out groups of `n_samples_per_prompt` samples, one group per prompt. The order is a
    permutation seeded by (seed, epoch); state_dict() records where the next prompt comes from."""

    def __init__(self, path: str | Path, *, input_key: str = "input", label_key: str | None = None,
                 metadata_key: str | None = None, tokenizer: Any = None, apply_chat_template: bool = False,
                 apply_chat_template_kwargs: dict[str, Any] | None = None, tool_key: str | None = "tools",
                 max_prompt_len: int | None = None,
                 shuffle: bool = True, seed: int = 42, n_samples_per_prompt: int = 1,
                 stamp: Callable[[Sample], None] | None = None) -> None:
        """stamp: called on every sample made (an eval set gives its samples its own functions)."""
        if n_samples_per_prompt < 1:
            raise DataError(f"--n-samples-per-prompt must be 1 or more, got {n_samples_per_prompt}")
        if (apply_chat_template or max_prompt_len is not None) and tokenizer is None:
            raise DataError("--apply-chat-template and --rollout-max-prompt-len need the model's tokenizer")
        self.path = Path(path)
        self.rows = _read_rows(self.path, input_key, label_key, metadata_key, tool_key)
        self.tokenizer = tokenizer
        self.apply_chat_template = apply_chat_template
        self.apply_chat_template_kwargs = dict(apply_chat_template_kwargs or {})  # e.g. {"enable_thinking": False}
        if max_prompt_len is not None:
            self.rows = self._short_enough(max_prompt_len)
        self.shuffle = shuffle
        self.seed = seed
        self.n_samples_per_prompt = n_samples_per_prompt
        self.stamp = stamp
        self.epoch = 0
        self.offset = 0  # position in this epoch's order
        self.next_sample_index = 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _prompt(self, row: dict[str, Any]) -> str | list[dict[str, str]]:
        raw = row["prompt"]
        if not self.apply_chat_template:
            return raw
        messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
        tools = {"tools": row["tools"]} if row.get("tools") else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **tools, **self.apply_chat_template_kwargs)

    def _short_enough(self, max_prompt_len: int) -> list[dict[str, Any]]:
        """slime's filter_long_prompt: rows whose prompt is at most max_prompt_len tokens. A prompt
        of messages without --apply-chat-template is kept unchecked, as slime keeps it."""
        kept = [row for row in self.rows if not isinstance(prompt := self._prompt(row), str)
                or len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]) <= max_prompt_len]
        if not kept:
            raise DataError(f"{self.path}: every prompt is longer than --rollout-max-prompt-len {max_prompt_len} "
                            "tokens; raise it")
        return kept

    def get_samples(self, num_prompts: int) -> list[list[Sample]]:
        groups = []
        for _ in range(num_prompts):
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._order_of(self.epoch)
            row_index = self._order[self.offset]
            self.offset += 1
            row = self.rows[row_index]
            metadata = {**row["metadata"], "row": row_index, "epoch": self.epoch}
            group_index = self.next_sample_index // self.n_samples_per_prompt
            group = []
            for _ in range(self.n_samples_per_prompt):
                group.append(Sample(index=self.next_sample_index, group_index=group_index,
                                    prompt=self._prompt(row), label=row["label"], metadata=dict(metadata)))
                if self.stamp is not None:
                    self.stamp(group[-1])
                self.next_sample_index += 1
            groups.append(group)
        return groups

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "next_sample_index": self.next_sample_index,
                "seed": self.seed, "shuffle": self.shuffle, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_rows"] != len(self.rows) or state["seed"] != self.seed or state["shuffle"] != self.shuffle:
            raise DataError(f"resume state is for {state['num_rows']} prompts with seed {state['seed']}, "
                            f"shuffle {state['shuffle']}; {self.path} has {len(self.rows)} with seed {self.seed}, "
                            f"shuffle {self.shuffle}: resume with the same data and --seed")
        self.epoch, self.offset, self.next_sample_index = state["epoch"], state["offset"], state["next_sample_index"]
        self._order = self._order_of(self.epoch)
