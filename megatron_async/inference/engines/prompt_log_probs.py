"""Landing of prompt log-probs (``SamplingParams.return_prompt_log_probs``): the request book's
side. A step's scored rows arrive as plain lists (``PromptRowScores``, from the runner's
``PromptScoring``) and are written into the request by position, so a prompt recomputed after
an eviction rewrites the same entries and the list never has a hole (a request scoring its
prompt takes no prefix-cache hit past what it holds: ``DynamicInferenceRequest.max_prefix_hit``)."""
from __future__ import annotations

from typing import NamedTuple

from megatron_async.inference.engines.step_plan import RowPlan
from megatron_async.inference.request import Status


class PromptRowScores(NamedTuple):
    row: int
    """The row of the launch."""
    start: int
    """Its first scored position p (entry p: log P(prompt[p + 1] | prompt[:p + 1]))."""
    log_probs: list[float]
    top_n_ids: list[list[int]] | None
    top_n_vals: list[list[float]] | None


def land_prompt_scores(rows: list[RowPlan], scores: list[PromptRowScores]) -> None:
    """Write each scored row's values into its request (rows of finished requests dropped)."""
    for s in scores:
        req = rows[s.row].request
        if req.status == Status.FINISHED:
            continue
        lps = req.prompt_log_probs
        assert s.start <= len(lps), "prompt log-probs would have a hole"
        del lps[s.start :]
        lps.extend(s.log_probs)
        n = req.sampling_params.top_n_logprobs
        if n > 0:
            tops = req.prompt_top_n_logprobs
            del tops[s.start :]
            tops.extend(dict(zip(ids[:n], vals[:n])) for ids, vals in zip(s.top_n_ids, s.top_n_vals))
