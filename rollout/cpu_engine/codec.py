"""The engine's view of the tokenizer: encode, decode and the token ids that end a sequence."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any


class Codec:
    """Thread-safe text <-> token ids for the HTTP handlers and the scheduler thread.

    A lock guards every call because a fast HF tokenizer's backend is not safe to share between
    threads when transformers adjusts its truncation and padding state on each call."""

    def __init__(self, tokenizer: Any, model_config: Any, model_path: str) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self.eos_ids = _eos_ids(tokenizer, model_config, Path(model_path))

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self._tokenizer.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        with self._lock:
            return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _eos_ids(tokenizer: Any, model_config: Any, model_path: Path) -> frozenset[int]:
    """The union of the tokenizer's, the config's and generation_config.json's eos ids, as SGLang
    stops on any of them (a chat model ends turns with one and documents with another)."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(model_config, "eos_token_id", None),
                  _generation_eos(model_path / "generation_config.json")):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def _generation_eos(path: Path) -> Any:
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("eos_token_id")
