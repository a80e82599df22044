"""HF's max_shard_size, parsed without torch (the CLI's --help must stay light)."""

from __future__ import annotations

import re

DEFAULT_MAX_SHARD_SIZE = "5GB"  # huggingface_hub's MAX_SHARD_SIZE
# HF's units: decimal KB/MB/GB/TB (huggingface_hub), binary KiB/MiB/GiB/TiB (transformers 4.x).
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_shard_size(text: str) -> int:
    """HF's max_shard_size: bytes as an integer, or a number with a unit ("5GB", "500MB", "2GiB")."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B)?\s*", text, re.IGNORECASE)
    if not match or (match.group(2) is None and "." in match.group(1)):
        raise ValueError(f"{text!r} is not a size: give bytes (e.g. 5000000000) or a number with a unit "
                         f"(KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 5GB")
    value = float(match.group(1)) * _UNITS.get((match.group(2) or "").upper(), 1)
    if value < 1:
        raise ValueError(f"{text!r} is not a size of 1 byte or more")
    return int(value)
