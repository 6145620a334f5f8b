"""Readers of config.json fields shared by the GPT and hybrid config parsers (and the tokenizer)."""
from __future__ import annotations

from typing import Any


def positive_int(cfg: dict, key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ValueError(f"config.json: missing required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: {key!r} must be a positive integer, got {value!r}")
    return value


def first_id(value: Any) -> int | None:
    """A token id field that may be an int, a list of ids (first one wins) or null."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)
