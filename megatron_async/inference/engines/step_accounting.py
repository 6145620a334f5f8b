"""What the engine counts: the ``EngineStats`` of every landed launch (steps, tokens, speculation,
graph replays, the scheduler's and caches' counters), of launches not made, of host wall time,
of the warm-up, and the log line of every ``logging_step_interval``-th step. It reads the
engine's rooms and writes only the stats, which it holds: ``engine.stats`` is its ``stats``
(a caller that puts a fresh ``EngineStats`` there counts a window from then on)."""
from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from megatron_async.config import Scheduling
from megatron_async.inference import gc_pauses, triton_builds
from megatron_async.inference.async_pipeline import PendingLaunch
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_async.inference.engines.engine_stats import EngineStats
from megatron_async.inference.engines.grammar_masks import GrammarMasks
from megatron_async.inference.engines.request_book import Landing, RequestBook
from megatron_async.inference.engines.scheduler import Scheduler
from megatron_async.inference.request import Status

if TYPE_CHECKING:  # type-only: the engine's rooms import nothing of the controllers at import
    from megatron_async.inference.text_generation_controllers.model_runner import ModelRunner

log = logging.getLogger("megatron_async")


class StepAccounting:
    def __init__(self, config: Scheduling, context: DynamicInferenceContext, scheduler: Scheduler, book: RequestBook,
                 runner: ModelRunner, grammars: GrammarMasks | None = None):
        self.stats = EngineStats()
        self.config = config
        self.context = context
        self.scheduler = scheduler
        self.book = book
        self.runner = runner
        self.grammars = grammars
        self._builds_at_warmup: int | None = None  # the process's Triton build count after warm-up

    def warmed_up(self, report) -> None:
        """The runner's ``WarmupReport``; from now on Triton builds and graph captures count as late."""
        st = self.stats
        st.warmup_seconds += report.seconds
        st.warmup_memory_bytes += report.memory_bytes
        st.warmup_graphs += report.graphs_captured
        st.warmup_triton_builds += report.triton_builds
        self._builds_at_warmup = triton_builds.builds()

    def landed(self, pending: PendingLaunch, res: Landing, step_time: float | None) -> None:
        """``pending`` was landed by the request book with result ``res`` (``step_time``: its
        device time when the launch was timed)."""
        st = self.stats
        st.steps += 1
        st.discarded_rows += res.num_discarded
        st.fast_decode_snapshots = self.context.fast_decode_snapshots
        st.fast_landings = self.book.fast_landings
        st.lora_free_steps = self.runner.lora_free_steps
        st.long_tile_steps = self.context.long_tile_steps
        self._count_graph_use()
        gc_pauses.record(st)
        st.paused = self.scheduler.num_paused_events
        st.evicted = self.scheduler.num_evicted_events
        st.prefix_hit_tokens = self.scheduler.prefix_hit_tokens
        st.admitted_out_of_order = self.scheduler.out_of_order
        st.held_steps = self.scheduler.held_steps
        sharing = self.context.sharing
        st.prompt_shares, st.shared_prompt_tokens = sharing.waits_started, sharing.shared_tokens
        cache = self.context.mamba.prefix_cache if self.context.mamba is not None else None
        if cache is not None:
            st.mamba_states_stored, st.mamba_states_restored, st.mamba_states_evicted = cache.stored, cache.restored, cache.evicted
        if pending.is_decode_only:
            st.decode_steps += 1
            st.overlapped_decode_steps += pending.overlapped
        else:
            st.prefill_steps += 1
            st.prefill_tokens += sum(r.num_tokens for r in pending.rows if r.num_tokens > 1 + r.num_drafts or not r.is_decode)
            st.mixed_step_tokens += sum(r.num_tokens for r in pending.rows)
            st.mixed_kv_read_tokens += sum(r.start + r.num_tokens for r in pending.rows)
        st.generated_tokens += res.num_tokens
        if res.drafted is not None:
            self._count_speculation(res)
        st.finished_requests += len(res.finished)
        if self.grammars is not None:
            st.grammar_steps, st.grammar_rows = self.grammars.steps, self.grammars.rows
            st.grammar_fill_time = self.grammars.fill_seconds
            st.grammar_early_fills, st.grammar_fill_wait_time = self.grammars.early_fills, self.grammars.wait_seconds
        if step_time is not None and pending.timing_events:
            st.timed_steps += 1
            st.timed_device_time += step_time

    def rejected_launch(self) -> None:
        """A launch ahead found nothing to launch while requests were unfinished."""
        self.stats.rejected_launches += 1
        self.stats.rejected_causes[self._rejection_cause()] += 1

    def wall_time(self, pending: PendingLaunch, wall: float) -> None:
        """Host seconds of the ``step()`` that landed ``pending``; a decode step tells the
        speculative policy what it cost."""
        if pending.is_decode_only:
            self.stats.decode_wall_time += wall
            spec = self.scheduler.spec
            if spec.adaptive:  # (a step without the machinery verified nothing: no pass over its rows)
                drafter = pending.host_accepted is not None
                drafts = max((r.num_drafts for r in pending.rows), default=0) if drafter else 0
                spec.observe_step(len(pending.rows), drafts, wall, drafter=drafter)
        else:
            self.stats.prefill_wall_time += wall

    def log_step(self, pending: PendingLaunch, step_time: float | None) -> None:
        """The log line of a landed launch, every ``logging_step_interval`` steps."""
        interval = self.config.logging_step_interval
        if not interval or pending.step_id % interval:
            return
        st = self.stats
        t = f"{1e3 * step_time:.2f} ms" if step_time is not None else "n/a"
        log.info(
            "step %d: rows=%d tokens=%d %s device=%s | active=%d waiting=%d free_blocks=%d | overlapped=%d/%d paused=%d evicted=%d",
            pending.step_id, len(pending.rows), pending.num_tokens, "decode" if pending.is_decode_only else "mixed", t,
            len(self.context.active), len(self.scheduler.waiting), self.context.allocator.num_available,
            st.overlapped_decode_steps, st.decode_steps, st.paused, st.evicted,
        )

    def _count_graph_use(self) -> None:
        graphs, st = self.runner.graphs, self.stats
        if graphs is not None:
            st.graph_replays, st.mixed_graph_replays = graphs.num_replays, graphs.num_mixed_replays
            st.spec_graph_replays = graphs.num_verify_replays
            st.lora_free_graph_replays = graphs.num_lora_free_replays
            st.long_tile_graph_replays = graphs.num_long_tile_replays
            st.graph_captures_after_warmup = graphs.captures_after_warmup if graphs.warmed_up else len(graphs.graphs)
        if self._builds_at_warmup is not None:
            st.triton_builds_after_warmup = triton_builds.builds() - self._builds_at_warmup

    def _count_speculation(self, res: Landing) -> None:
        st = self.stats
        if not st.spec_draft_tokens_per_depth:
            st.spec_draft_tokens_per_depth = [0] * len(res.drafted)
            st.spec_accepted_tokens_per_depth = [0] * len(res.accepted)
        for d, (n, a) in enumerate(zip(res.drafted, res.accepted)):
            st.spec_draft_tokens_per_depth[d] += n
            st.spec_accepted_tokens_per_depth[d] += a
        st.spec_draft_tokens += sum(res.drafted)
        st.spec_accepted_tokens += sum(res.accepted)
        st.spec_verify_rows += res.drafted[0] if res.drafted else 0
        st.spec_truncated_rows += res.truncated
        st.spec_off_rows = Counter(self.scheduler.spec.off_rows)
        st.spec_plain_steps = self.runner.spec_steps.plain_steps
        st.spec_plain_mixed_steps = self.runner.spec_steps.plain_mixed_steps

    def _rejection_cause(self) -> str:
        active = list(self.context.active.values())
        if any(r.status == Status.PAUSED for r in active):
            return "paused"
        if not active and self.scheduler.waiting:
            return "admission_blocked"
        # every remaining row at its limit (those released ahead have left ``active`` already)
        if all(not self.scheduler.wants_token(r) for r in active if not r.is_prefilling):
            return "length_limit"
        if self.scheduler.waiting:
            return "admission_blocked"
        return "other"
