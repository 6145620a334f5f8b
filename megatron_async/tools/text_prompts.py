"""Text-prompt workloads for the main job: ``--prompts`` or ``--prompt-file`` lines, optionally
wrapped as user messages in the checkpoint's chat template, tokenized once here."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_async.models.chat_template import ChatTemplate
from megatron_async.tools.workload import WorkloadRequest, WorkloadSpec, arrival_steps


def read_prompt_file(path: str | Path) -> list[str]:
    """Non-empty lines of ``path``."""
    try:
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read prompt file {path}: {e}") from e
    if not lines:
        raise ValueError(f"{path} has no prompts")
    return lines


def text_workload(texts: list[str], tokenizer, spec: WorkloadSpec,
                  chat_template: ChatTemplate | None = None) -> list[WorkloadRequest]:
    """One request per text, with output lengths drawn from the spec's range and arrivals as for
    synthetic prompts (``spec.num_requests`` is not used: the texts are the workload). With a
    chat template each text becomes a user message; the rendered prompt already holds its
    special tokens, so none are added."""
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer: pass a checkpoint with tokenizer.json")
    rng = np.random.default_rng(spec.seed)
    output_lens = rng.integers(spec.output_len_min, spec.output_len_max + 1, size=len(texts))
    arrivals = arrival_steps(len(texts), spec.arrival_rate, rng)
    requests = []
    for text, out_len, arrival in zip(texts, output_lens, arrivals):
        if chat_template is not None:
            tokens = tokenizer.encode(chat_template.render([{"role": "user", "content": text}]), add_special_tokens=False)
        else:
            tokens = tokenizer.encode(text)
        requests.append(WorkloadRequest(tokens, int(out_len), arrival, prompt_text=text))
    return requests
