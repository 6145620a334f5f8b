"""Text-prompt workloads for the main job: ``--prompts`` or ``--prompt-file`` lines, optionally
wrapped as user messages in the checkpoint's chat template, tokenized once here."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_async.cli.workload import WorkloadRequest, WorkloadSpec, arrival_steps
from megatron_async.models.chat_template import ChatTemplate

TEXT_MAX_TOKENS = 1024
"""Text prompts without a requested length run to EOS (or a stop word) under this cap, or the
room their prompt leaves in ``max_sequence_length`` if that is less: an answer is not cut at a
synthetic length."""


def read_prompt_file(path: str | Path) -> list[str]:
    """Non-empty lines of ``path``."""
    try:
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read prompt file {path}: {e}") from e
    if not lines:
        raise ValueError(f"{path} has no prompts")
    return lines


def text_workload(texts: list[str], tokenizer, spec: WorkloadSpec, chat_template: ChatTemplate | None = None,
                  max_sequence_length: int | None = None) -> list[WorkloadRequest]:
    """One request per text, arriving as synthetic prompts do (``spec.num_requests`` is not used:
    the texts are the workload). Output lengths: drawn from the spec's range when it has one
    (``output_len_max`` set), else ``TEXT_MAX_TOKENS`` or the room left in
    ``max_sequence_length``, a cap for a run to EOS. With a chat template each text becomes a
    user message; the rendered prompt already holds its special tokens, so none are added."""
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer: pass a checkpoint with tokenizer.json")
    rng = np.random.default_rng(spec.seed)
    drawn = None
    if spec.output_len_max is not None:
        drawn = rng.integers(spec.output_len_min or 1, spec.output_len_max + 1, size=len(texts))
    arrivals = arrival_steps(len(texts), spec.arrival_rate, rng)
    requests = []
    for i, (text, arrival) in enumerate(zip(texts, arrivals)):
        if chat_template is not None:
            tokens = tokenizer.encode(chat_template.render([{"role": "user", "content": text}]), add_special_tokens=False)
        else:
            tokens = tokenizer.encode(text)
        if drawn is not None:
            out_len = int(drawn[i])
        else:
            room = TEXT_MAX_TOKENS if max_sequence_length is None else max_sequence_length - len(tokens)
            out_len = max(1, min(TEXT_MAX_TOKENS, room))
        requests.append(WorkloadRequest(tokens, out_len, arrival, prompt_text=text))
    return requests
