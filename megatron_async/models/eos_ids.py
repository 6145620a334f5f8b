"""Every token id that ends generation for a checkpoint.

Llama 3 / Qwen list several EOS ids (config.json and generation_config.json may hold a list,
and the tokenizer names its own EOS token); Hugging Face stops on any of them, so all are
collected, in first-seen order."""
from __future__ import annotations

import json
from pathlib import Path


def _ids(value) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"eos_token_id must be an integer or a list of integers, got {value!r}")
    return list(values)


def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def checkpoint_eos_ids(path: str | Path, tokenizer_eos: int | None = None) -> tuple[int, ...]:
    """EOS ids of the tokenizer, generation_config.json and config.json, deduplicated."""
    root = Path(path)
    ids = [] if tokenizer_eos is None else [tokenizer_eos]
    for name in ("generation_config.json", "config.json"):
        try:
            ids += _ids(_read(root / name).get("eos_token_id"))
        except ValueError as e:
            raise ValueError(f"{root / name}: {e}") from None
    return tuple(dict.fromkeys(ids))
