"""Tiny random Hugging Face GPT checkpoints and HF reference outputs for parity tests.

Everything is built from configs (no downloads). ``initializer_range=0.2`` keeps
logit gaps wide enough for exact greedy-token comparisons in float32; norm weights
and biases are perturbed away from HF's 1 / 0 init so that a mis-mapped tensor shows."""
from __future__ import annotations

from pathlib import Path

import torch

GPT_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

TINY_DEFAULTS: dict = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "rms_norm_eps": 1e-6,
    "eos_token_id": None,
    "bos_token_id": None,
    "pad_token_id": None,
}
# Qwen3's head_dim is its own field; pick one != hidden / heads so that path is exercised.
_ARCH_DEFAULTS: dict[str, dict] = {"Qwen3ForCausalLM": {"head_dim": 32}}


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep test logs readable


@torch.no_grad()
def perturb_norms_and_biases(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Norm weights ~1 + 0.1 N(0, 1) and biases ~0.1 N(0, 1) instead of HF's 1 / 0, so that a
    mis-mapped norm or bias tensor changes the outputs."""
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "norm_f.weight")):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def make_tiny_config(arch: str, **overrides):
    """A transformers config object of ``arch`` with tiny defaults, ``overrides`` applied."""
    import transformers

    if arch not in GPT_ARCHS:
        raise ValueError(f"make_tiny_config: {arch!r} is not one of {GPT_ARCHS}")
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(**{**TINY_DEFAULTS, **_ARCH_DEFAULTS.get(arch, {}), **overrides})
    config.architectures = [arch]
    return config


@torch.no_grad()
def make_tiny_checkpoint(
    arch: str,
    path: str | Path,
    *,
    seed: int = 0,
    with_tokenizer: bool = False,
    max_shard_size: str | None = None,
    **overrides,
) -> Path:
    """Build a seeded random float32 HF model of ``arch`` and ``save_pretrained`` it to ``path``.

    ``overrides`` are config fields (e.g. ``tie_word_embeddings=True``,
    ``rope_scaling={"rope_type": "linear", "factor": 2.0}``). ``max_shard_size`` (e.g.
    "20KB") writes a sharded checkpoint with an index. ``with_tokenizer`` adds the tiny
    byte-level BPE (tokenizer.json + tokenizer_config.json) sized to the vocabulary."""
    from transformers import AutoModelForCausalLM

    _quiet()
    config = make_tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_norms_and_biases(model, torch.Generator().manual_seed(seed + 1))
    root = Path(path)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(root, **kwargs)
    if with_tokenizer:
        from megatron_async.models.tiny_tokenizer import save_tiny_tokenizer

        save_tiny_tokenizer(root, vocab_size=config.vocab_size)
    return root


def load_hf_reference(path: str | Path):
    """The saved checkpoint as a float32 transformers model in eval mode (the reference)."""
    from transformers import AutoModelForCausalLM

    _quiet()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Full-sequence forward of one prompt: [len, vocab] float32 logits."""
    return model(torch.tensor([token_ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """HF ``generate`` greedy continuation of exactly ``num_tokens`` tokens (EOS ignored)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),  # else generate masks prompt ids equal to pad_token_id
        max_new_tokens=num_tokens,
        min_new_tokens=None,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    tokens = out[0, len(prompt):].tolist()
    if len(tokens) != num_tokens:
        raise RuntimeError(f"HF generate returned {len(tokens)} tokens, expected {num_tokens}")
    return tokens
