"""Prompt log-probs on the device side of a step (``SamplingParams.return_prompt_log_probs``).

A prefill row of a request that scores its prompt computes positions [start, start + n); the
hidden state at position p predicts prompt[p + 1], so each such position p < len(prompt) - 1
yields log P(prompt[p + 1] | prompt[:p + 1]). The targets are prompt tokens the host knows, so a
chunk's last position scores the next chunk's first token with no carry between steps, and a
row of a scoring-only step needs nothing from the launch before it.

Only steps with such rows pay anything: ``PromptScoring.plan`` is None for every other step, and
the steps that have one run eager (their hidden states are read after the forward). The logits of
the scored positions are computed ``SUBCHUNK_BYTES`` at a time ([2048, 151k] float32 logits of a
whole chunk would be 1.2 GB), through the model's ``compute_logits`` (vocab-parallel under TP) and
``sampling.log_probs_of``: the very calls that give generated tokens their log-probs, so in
batch-invariant mode a scored position has the bits the generated token had."""
from __future__ import annotations

import torch

from megatron_async.inference.async_pipeline import PromptRowScores
from megatron_async.inference.device import copy_to_host
from megatron_async.inference.step_plan import StepPlan
from megatron_async.inference.text_generation_controllers import sampling

SUBCHUNK_BYTES = 1 << 28
"""What one sub-chunk of scored positions may hold at once (logits and their temporaries):
[220, 151k] without top-n, [55, 151k] with it."""


def wants_prompt_scoring(plan: StepPlan) -> bool:
    """Some row of ``plan`` computes positions whose prompt log-probs its request asked for."""
    for row in plan.rows:
        req = row.request
        if req.sampling_params.return_prompt_log_probs and row.start < len(req.prompt_tokens) - 1:
            return True
    return False


class PromptScoring:
    """The scored positions of one step: planned on the host, computed after the forward,
    copied to the host with the step's samples, handed to the request book as plain lists."""

    def __init__(self, plan: StepPlan):
        """The packed layout: row r's tokens follow the rows before it (an eager step without
        verify padding)."""
        self.rows: list[tuple[int, int, int]] = []  # (row, first position, positions)
        token_idx, targets = [], []
        offset = 0
        self.top_n = 0
        for r, row in enumerate(plan.rows):
            req, start, n = row.request, row.start, row.num_tokens
            sp = req.sampling_params
            end = min(start + n, len(req.prompt_tokens) - 1)
            if sp.return_prompt_log_probs and end > start:
                self.rows.append((r, start, end - start))
                token_idx.extend(range(offset, offset + end - start))
                targets.extend(req.prompt_tokens[start + 1 : end + 1])
                self.top_n = max(self.top_n, sp.top_n_logprobs)
            offset += n
        self._host_idx = torch.tensor(token_idx, dtype=torch.int64)
        self._host_targets = torch.tensor(targets, dtype=torch.int64)
        self.log_probs = self.top_vals = self.top_ids = None  # device results, then host copies

    @property
    def num_positions(self) -> int:
        return self._host_idx.numel()

    def compute(self, model, hidden: torch.Tensor, vocab_size: int, batch_invariant: bool, model_dtype: bool) -> None:
        """Log-probs of the targets (and top-n) from ``hidden`` [T, H], in sub-chunks.
        ``model_dtype``: logits in the model dtype, as the step's sampler reads them
        (``SampleLauncher.reads_model_dtype``)."""
        dev = hidden.device
        idx = self._host_idx.to(dev, non_blocking=True)
        targets = self._host_targets.to(dev, non_blocking=True)
        M, n = self.num_positions, self.top_n
        per_row = vocab_size * (32 if n else 8)  # float32 logits and a temporary; the top-n's int64 keys
        step = max(1, SUBCHUNK_BYTES // per_row)
        lps, vals, ids = [], [], []
        for s in range(0, M, step):
            e = min(M, s + step)
            logits = model.compute_logits(hidden[idx[s:e]], batch_invariant=batch_invariant, float32=not model_dtype)
            lp, tv, ti = sampling.log_probs_of(logits, targets[s:e], n, batch_invariant, triton=model_dtype)
            lps.append(lp)
            if n:
                vals.append(tv)
                ids.append(ti)
        self.log_probs = torch.cat(lps)
        if n:
            self.top_vals, self.top_ids = torch.cat(vals), torch.cat(ids)

    def copy_to_host(self) -> None:
        """Enqueue the D2H copies (before the step's event is recorded)."""
        self.log_probs, self.top_vals, self.top_ids = (None if t is None else copy_to_host(t)
                                                       for t in (self.log_probs, self.top_vals, self.top_ids))

    def collect(self) -> list[PromptRowScores]:
        """After the step's event: per-row plain lists."""
        lps = self.log_probs.tolist()
        vals = self.top_vals.tolist() if self.top_vals is not None else None
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        out, k = [], 0
        for r, start, m in self.rows:
            out.append(PromptRowScores(r, start, lps[k : k + m], ids[k : k + m] if ids is not None else None,
                                       vals[k : k + m] if vals is not None else None))
            k += m
        return out
