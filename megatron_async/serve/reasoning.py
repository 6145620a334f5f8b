"""Reasoning sections of a chat answer (``--reasoning-parser``): Qwen3 and DeepSeek-R1 style models
think inside ``<think>...</think>`` before they answer. The section becomes the message's
``reasoning_content`` and the rest its ``content``. Qwen3's templates may open ``<think>`` in the
prompt (thinking models, or ``enable_thinking``): then the answer starts inside the section, and
its text up to ``</think>`` is reasoning."""
from __future__ import annotations

from megatron_async.serve.tag_stream import TagStream

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3",)
"""Names ``--reasoning-parser`` accepts."""


def starts_inside(prompt: str) -> bool:
    """Whether the rendered prompt leaves a ``<think>`` section open for the answer."""
    return prompt.rstrip().endswith(THINK_OPEN)


def reasoning_stream(parser: str, prompt: str) -> TagStream:
    """The splitter for one answer: "inside" pieces are reasoning, "outside" ones the answer."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(REASONING_PARSERS)}")
    return TagStream(THINK_OPEN, THINK_CLOSE, inside=starts_inside(prompt), once=True)
