"""Models: GPT / hybrid decoders, HF checkpoint loading, tokenizer, built-in default models."""
from megatron_async.models.checkpoint import load_checkpoint
from megatron_async.models.default_model import DEFAULT_CONFIGS, build_default_model
from megatron_async.models.tokenizer import Tokenizer, load_tokenizer

__all__ = ["DEFAULT_CONFIGS", "Tokenizer", "build_default_model", "load_checkpoint", "load_tokenizer"]
