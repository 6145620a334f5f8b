"""Text <-> token ids through a checkpoint's ``tokenizer.json`` (the `tokenizers` package)."""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from megatron_async.models.config_fields import first_id


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, eos_token_id: int | None):
        self._tok = tokenizer
        self.eos_token_id = eos_token_id

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json``; the EOS id comes from tokenizer_config.json's ``eos_token``,
        else generation_config.json, else config.json (first id of a list)."""
        root = Path(path)
        tok = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        eos: int | None = None
        eos_token = _read_json(root / "tokenizer_config.json").get("eos_token")
        if isinstance(eos_token, dict):  # older files store an AddedToken dict
            eos_token = eos_token.get("content")
        if isinstance(eos_token, str):
            eos = tok.token_to_id(eos_token)
        if eos is None:
            eos = first_id(_read_json(root / "generation_config.json").get("eos_token_id"))
        if eos is None:
            eos = first_id(_read_json(root / "config.json").get("eos_token_id"))
        return cls(tok, eos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(path: str | Path | None) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it has no tokenizer.json (token-id prompts only)."""
    if path is None or not (Path(path) / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_dir(path)
