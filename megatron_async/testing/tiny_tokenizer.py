"""The tiny BPE tokenizer lives in the library (``megatron_async.models.tiny_tokenizer``: the
built-in tiny model uses it); tests keep importing it from here."""
from megatron_async.models.tiny_tokenizer import (  # noqa: F401
    EOS_TOKEN,
    EOS_TOKEN_ID,
    save_tiny_tokenizer,
    train_tiny_tokenizer,
)
