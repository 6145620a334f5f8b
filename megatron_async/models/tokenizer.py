"""Text <-> token ids through a checkpoint's ``tokenizer.json`` (the `tokenizers` package)."""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from megatron_async.models.eos_ids import checkpoint_eos_ids


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, eos_token_ids: int | tuple[int, ...] | None):
        self._tok = tokenizer
        if eos_token_ids is None:
            eos_token_ids = ()
        elif isinstance(eos_token_ids, int):
            eos_token_ids = (eos_token_ids,)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        """Every id that ends generation (the engine stops on any of them)."""

    @property
    def eos_token_id(self) -> int | None:
        """The main EOS id (the tokenizer's own EOS token when it names one)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json``. EOS ids: tokenizer_config.json's ``eos_token`` first, then every
        id of generation_config.json's and config.json's ``eos_token_id`` (an int or a list, as in
        Llama 3 and Qwen), deduplicated: the same set the engine stops on."""
        root = Path(path)
        tok = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        eos: int | None = None
        eos_token = _read_json(root / "tokenizer_config.json").get("eos_token")
        if isinstance(eos_token, dict):  # older files store an AddedToken dict
            eos_token = eos_token.get("content")
        if isinstance(eos_token, str):
            eos = tok.token_to_id(eos_token)
        return cls(tok, checkpoint_eos_ids(root, eos))

    @property
    def backend_tokenizer(self) -> tokenizers.Tokenizer:
        """The ``tokenizers.Tokenizer`` itself (the grammar libraries read its vocabulary)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode holds it): a long text tokenized on a worker
        # thread leaves the server's event loop running
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(path: str | Path | None) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it has no tokenizer.json (token-id prompts only)."""
    if path is None or not (Path(path) / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_dir(path)
