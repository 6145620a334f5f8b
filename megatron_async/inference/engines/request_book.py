"""RequestBook: the one owner of a request's state once it is admitted.

Every change to a ``DynamicInferenceRequest`` after admission goes through here: a launched
step is committed (computed positions, in-flight counts), its samples land (tokens, log-probs,
stop conditions, acceptance of drafts), and a request finishes (its blocks and slots go back to
the context). The context assembles the step buffer and owns the resources (blocks, slots), the
runner launches and collects, the scheduler plans; none of them changes a request's progress.

``land`` runs for every row of every step: one loop for every launch (with or without drafts),
a row without drafts taking one pass of its inner loop."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from megatron_async.inference.engines.prompt_log_probs import land_prompt_scores
from megatron_async.inference.request import DynamicInferenceRequest, FinishReason, Status
from megatron_async.inference.routed_experts import land_routing
from megatron_async.inference.speculative.acceptance import emitted_tokens
from megatron_async.inference.stop_conditions import finish_reason, generation_limit, plain_stop_ids

if TYPE_CHECKING:
    from megatron_async.inference.async_pipeline import HostSamples, PendingLaunch
    from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron_async.inference.speculative.policy import SpecPolicy
    from megatron_async.inference.step_plan import StepPlan

_LIVE = (Status.ACTIVE, Status.PAUSED)  # states that hold blocks


@dataclass
class Landing:
    finished: list[DynamicInferenceRequest]
    updated: list[DynamicInferenceRequest]
    """Requests that gained a token in this step (finished ones included), in row order."""
    num_discarded: int
    num_tokens: int = 0
    """Tokens appended to requests."""
    drafted: list[int] | None = None
    """Speculative decoding: verify rows with at least d + 1 drafts, at index d (kept rows only)."""
    accepted: list[int] | None = None
    """Of those, rows whose draft d + 1 was accepted (index d)."""
    truncated: int = 0
    """Rows whose request finished before their last emitted token (the rest was dropped)."""


class RequestBook:
    def __init__(self, context: DynamicInferenceContext, spec_policy: SpecPolicy | None = None):
        """``spec_policy``: speculative decoding's, told every landed verify row (the scheduler's)."""
        self.ctx = context
        self.spec_policy = spec_policy
        self.max_sequence_length = context.max_sequence_length
        self.num_speculative_tokens = context.num_speculative_tokens if context.spec is not None else 0
        self.finishing: list[DynamicInferenceRequest] = []
        """Requests whose sample in flight may reach their length limit (``len(generated) +
        num_inflight`` reached it when a row was committed or drafts landed): the only ones
        ``Scheduler.release_finishing`` needs to look for."""
        self.fast_landings = 0
        """Launches that landed without drafts, one sample per row (EngineStats.fast_landings)."""
        self.on_release: Callable[[DynamicInferenceRequest], None] | None = None
        """Called with a request before its blocks and slots go back (disaggregation: a prompt
        computed for another engine keeps its blocks until they were sent)."""

    # ------------------------------------------------------------------ admission / endings
    def admit(self, req: DynamicInferenceRequest) -> None:
        """A request enters the queue: its length limit, fixed for its life, and (speculative
        decoding) its starting acceptance."""
        req.max_generated_tokens = generation_limit(req.sampling_params, len(req.prompt_tokens),
                                                    self.max_sequence_length)
        req.plain_stop_ids = plain_stop_ids(req)
        if self.spec_policy is not None and self.spec_policy.enabled:
            self.spec_policy.admit(req)

    def activate(self, req: DynamicInferenceRequest, transferred: list[int] | None = None) -> int:
        """A waiting request becomes active with its slots; the positions of the cached prefix
        blocks the context matched (or of its ``transferred`` blocks) count as computed. Returns
        those prefix tokens."""
        hit = self.ctx.admit(req, transferred)
        req.status = Status.ACTIVE
        req.num_computed_tokens = hit
        return hit

    def pause(self, req: DynamicInferenceRequest) -> None:
        """No KV block for its next token: it keeps its blocks and waits for one."""
        req.status = Status.PAUSED

    def resume(self, req: DynamicInferenceRequest) -> None:
        req.status = Status.ACTIVE

    def finish(self, req: DynamicInferenceRequest, reason: FinishReason, error: str | None = None) -> None:
        """End ``req`` (any state): its blocks and slots go back; a row it has in flight is
        discarded when that launch lands."""
        req.finish_reason, req.error = reason, error
        if self.on_release is not None:
            self.on_release(req)
        self.ctx.release(req)
        req.status = Status.FINISHED

    def release_ahead(self, req: DynamicInferenceRequest) -> None:
        """Its in-flight sample surely finishes it by length (``release_finishing``):
        its blocks and slots go back now, ``land`` finishes it."""
        assert req.num_inflight > 0
        if self.on_release is not None:
            self.on_release(req)
        self.ctx.release(req)

    def release_finishing(self) -> None:
        """Launch-ahead schedules step N+1 before step N is bookkept. A request whose last token
        is in flight reaches its length limit when N lands, and the serial engine releases it
        before scheduling N+1; releasing it before N+1 is scheduled frees the same blocks, state
        slot and request place, so both modes build the same schedules (on the GPU a different
        schedule means different bf16 rounding, and different greedy tokens). Stream order keeps
        N's KV writes before any next owner's. Finishes by EOS / stop words cannot be foreseen:
        after one, launch-ahead still schedules one step with the request's blocks held.

        Only a request noted in ``finishing`` can qualify: while none of them is active with its
        limit in flight, nothing is walked; else every active request is, in the order the
        context holds them (the order blocks go back in)."""
        noted, active = self.finishing, self.ctx.active
        if not noted:
            return
        noted[:] = [r for r in noted if r.num_inflight and active.get(r.request_id) is r
                    and r.tokens_certain >= r.max_generated_tokens]
        if not any(r.status == Status.ACTIVE for r in noted):
            return  # paused ones stay noted
        done = [r for r in active.values() if r.num_inflight and r.status == Status.ACTIVE
                and r.tokens_certain >= r.max_generated_tokens]
        for req in done:
            self.release_ahead(req)
        noted[:] = [r for r in noted if active.get(r.request_id) is r]

    def evict(self, req: DynamicInferenceRequest) -> None:
        """Back to waiting, every block and slot given back: it recomputes later."""
        self.ctx.release(req)
        req.status = Status.WAITING
        req.num_computed_tokens = 0

    # ------------------------------------------------------------------ launch
    def commit(self, plan: StepPlan, speculative: bool | None = None) -> None:
        """``plan``'s step was assembled and is about to launch: its rows' positions count as
        computed, sampling rows as in flight, and blocks whose KV it completes are published.
        ``speculative`` (speculative engines): the step runs the drafter, so each row's spec
        slot will hold fresh drafts for its next row."""
        # without prefix caching only prompt blocks are published: a row past its prompt has none
        alloc = self.ctx.allocator
        register, caching = alloc.publishes, alloc.enable_prefix_caching
        for r, row in enumerate(plan.rows):
            req = row.request
            req.num_computed_tokens = row.start + row.num_tokens
            if row.samples:
                req.num_inflight += 1
                req.inflight_row = r
                req.num_inflight_drafts = row.num_drafts
                if len(req.generated_tokens) + req.num_inflight >= req.max_generated_tokens:  # tokens_certain
                    self.finishing.append(req)
            if speculative is not None:
                req.spec_drafts_fresh = speculative
            if register and (caching or row.start < len(req.prompt_tokens)):
                self.ctx.register_complete_blocks(req)

    # ------------------------------------------------------------------ landing
    def land(self, pending: PendingLaunch, samples: HostSamples) -> Landing:
        """Append each live sampling row's emitted samples to its request, up to the first that
        finishes it; release finished requests; correct verify rows for rejected drafts; publish
        complete prefix blocks. Rows of requests that finished after the launch are discarded."""
        ctx, rows = self.ctx, pending.rows
        tokens, lps, tis, tvs = samples.tokens, samples.log_probs, samples.top_n_ids, samples.top_n_vals
        accepted, base = samples.accepted, pending.sample_base
        K = self.num_speculative_tokens
        drafted_d, accepted_d = ([0] * K, [0] * K) if K else (None, None)
        finished, updated = [], []
        discarded = num_tokens = truncated = 0
        # a landed sample completes a block only with prefix caching (``commit`` publishes prompt blocks)
        register = ctx.allocator.enable_prefix_caching
        finished_status = Status.FINISHED
        reason = None
        version = pending.weight_version
        if samples.prompt_scores:
            land_prompt_scores(rows, samples.prompt_scores)
        if samples.routed_experts is not None:  # every row (prefill chunks too), before any finishes
            land_routing(rows, samples.routed_experts, accepted, finished_status)
        if base is None and lps is None and tis is None and (accepted is None or not K):
            return self._land_plain(rows, tokens, version, drafted_d, accepted_d)
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
            if not req.max_generated_tokens:  # scoring only: its prefill's sample is not kept
                self.finish(req, FinishReason.LENGTH)  # its update says finished, as every other ending's does
                finished.append(req)
                continue
            first = i if base is None else base[i]
            k = row.num_drafts
            if k:  # a verify row: its accepted drafts, then the bonus sample
                a = accepted[i]
                self.spec_policy.observe(req, k, a)
                for d in range(k):
                    drafted_d[d] += 1
                    accepted_d[d] += d < a
                emitted = emitted_tokens(first, a)
            else:
                a, emitted = 0, (first,)
            sp = req.sampling_params
            gen = req.generated_tokens
            runs = req.weight_version_runs
            if not runs or runs[-1][1] != version:
                runs.append((len(gen), version))
            for last in emitted:  # up to the first sample that finishes the request
                gen.append(tokens[last])
                if sp.return_log_probs:
                    req.generated_log_probs.append(lps[last])
                if sp.top_n_logprobs > 0:
                    n = sp.top_n_logprobs
                    req.generated_top_n_logprobs.append(dict(zip(tis[last][:n], tvs[last][:n])))
                reason = finish_reason(req)
                if reason is not None:
                    break
            num_tokens += last - first + 1
            if reason is not None:
                truncated += last != first + a
                self.finish(req, reason)
                finished.append(req)
                continue
            if k != a and req.status in _LIVE:  # take back the rejected drafts (evicted: recomputes anyway)
                req.num_computed_tokens -= k - a
                ctx.trim_blocks(req)
            if a and req.num_inflight and len(gen) + req.num_inflight >= req.max_generated_tokens:
                self.finishing.append(req)  # accepted drafts brought the limit within the next launch
            if register:
                ctx.register_complete_blocks(req)
        # (a step without the speculative machinery has no accepted counts: no pass over its rows)
        self.fast_landings += not K or accepted is None or not any(r.num_drafts for r in rows)
        return Landing(finished, updated, discarded, num_tokens, drafted_d, accepted_d, truncated)

    def _land_plain(self, rows, tokens: list[int], version: int, drafted: list[int] | None,
                    accepted: list[int] | None) -> Landing:
        """``land`` for a launch of one sample per row, no drafts, log-probs or top-n: the same
        steps, without what those need (this runs for every row of most steps; its first lines
        repeat ``land``'s loop on purpose: a shared helper would cost a call per row)."""
        finished, updated = [], []
        discarded = num_tokens = 0
        ctx, finished_status = self.ctx, Status.FINISHED
        register = ctx.allocator.enable_prefix_caching  # as in land
        for i, row in enumerate(rows):
            if not row.samples:
                continue
            req = row.request
            if req.status == finished_status:  # finished (or aborted) after this launch: drop its sample
                discarded += 1
                continue
            n = req.num_inflight - 1
            req.num_inflight = n
            if not n:  # else a later launch holds its newest sample
                req.inflight_row = -1
                req.num_inflight_drafts = 0
            updated.append(req)
            if not req.max_generated_tokens:  # scoring only: its prefill's sample is not kept
                self.finish(req, FinishReason.LENGTH)
                finished.append(req)
                continue
            gen = req.generated_tokens
            runs = req.weight_version_runs
            if not runs or runs[-1][1] != version:
                runs.append((len(gen), version))
            token = tokens[i]
            gen.append(token)
            num_tokens += 1
            stop_ids = req.plain_stop_ids  # finish_reason inline for the common requests (stop_conditions.py)
            if stop_ids is None:
                reason = finish_reason(req)
            elif token in stop_ids:  # EOS: the text stops before it
                if req.text is not None:
                    req.text.end_before_last()
                reason = FinishReason.STOP
            else:
                reason = FinishReason.LENGTH if len(gen) >= req.max_generated_tokens else None
            if reason is not None:
                self.finish(req, reason)
                finished.append(req)
            elif register:
                ctx.register_complete_blocks(req)
        self.fast_landings += 1
        return Landing(finished, updated, discarded, num_tokens, drafted, accepted)
