"""Landing a launch without speculative decoding: one sample per row, in one pass.

``TextGenerationController.bookkeep_step``'s general loop also handles verify rows (accepted
drafts, corrections, acceptance statistics); a launch without drafts needs none of it, and
this loop runs for every row of every step, so it is its own short function: reconcile
(drop rows of requests that finished meanwhile), append the token (and log-probs), check
the stop conditions, release finished requests, publish complete prefix blocks."""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_async.inference.request import DynamicInferenceRequest, Status
from megatron_async.inference.stop_conditions import finish_reason

if TYPE_CHECKING:
    from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron_async.inference.engines.step_plan import RowPlan


def land_plain_rows(ctx: DynamicInferenceContext, rows: list[RowPlan], tokens: list[int], lps, tis, tvs,
                    ) -> tuple[list[DynamicInferenceRequest], list[DynamicInferenceRequest], int]:
    """Append row i's sample ``tokens[i]`` to each live sampling row's request. Returns
    (finished, updated, discarded rows); the same as the general loop with no drafts: a
    request has at most one row per launch, so reconciling row by row equals reconciling first."""
    finished, updated = [], []
    discarded = 0
    max_len = ctx.config.max_sequence_length
    register = ctx.allocator.enable_prefix_caching
    finished_status = Status.FINISHED
    for i, row in enumerate(rows):
        if not row.samples:
            continue
        req = row.request
        if req.status == finished_status:  # finished (or aborted) after this launch: drop its sample
            discarded += 1
            continue
        req.num_inflight -= 1
        if req.num_inflight == 0:  # else a later launch holds its newest sample
            req.inflight_row = -1
            req.num_inflight_drafts = 0
        updated.append(req)
        req.generated_tokens.append(tokens[i])
        sp = req.sampling_params
        if sp.return_log_probs:
            req.generated_log_probs.append(lps[i])
        if sp.top_n_logprobs > 0:
            n = sp.top_n_logprobs
            req.generated_top_n_logprobs.append(dict(zip(tis[i][:n], tvs[i][:n])))
        reason = finish_reason(req, max_len)
        if reason is not None:
            req.finish_reason = reason
            ctx.release(req)
            finished.append(req)
        elif register:
            ctx.register_complete_blocks(req)
    return finished, updated, discarded
