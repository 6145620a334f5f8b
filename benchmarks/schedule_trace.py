"""Record what an engine launched, step by step, without touching the engine's code.

``ScheduleRecorder.install(engine)`` wraps the engine's ``launch_plan`` (and, optionally,
the model's ``compute_logits``) on that one instance: an engine without a recorder runs the
unwrapped methods, so there is no cost when unused. Used by python -m benchmarks async-vs-serial
to find the first launch where serial and launch-ahead schedules differ, and the first
(request, position) whose logits differ."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_async.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron_async.inference.request import Status

TOP_N = 8
"""Logit values kept per sampled row (enough to see how far two rows are apart)."""


@dataclass(frozen=True)
class RowRecord:
    request_id: int
    start: int
    num_tokens: int
    samples: bool


@dataclass(frozen=True)
class LaunchRecord:
    index: int
    """0-based launch order."""
    overlapped: bool
    rows: tuple[RowRecord, ...]
    free_blocks: int
    """KV blocks free after this launch's reservations."""
    waiting: int
    active: int
    paused: int
    finishing_in_flight: tuple[int, ...]
    """Active requests whose last token an earlier, not yet bookkept launch computes (their
    blocks are still held although the serial engine would have released them)."""

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    def describe(self) -> str:
        rows = " ".join(f"{r.request_id}@{r.start}+{r.num_tokens}{'*' if r.samples else ''}" for r in self.rows)
        return (f"launch {self.index}: {len(self.rows)} rows, {self.num_tokens} tokens "
                f"(free blocks {self.free_blocks}, waiting {self.waiting}, active {self.active}, paused {self.paused}, "
                f"finishing in flight {list(self.finishing_in_flight)}) [{rows}]")


@dataclass(frozen=True)
class LogitRecord:
    launch: int
    digest: int
    """Exact bit digest of the row's logits (equal rows give equal digests)."""
    argmax: int
    top_vals: tuple[float, ...]
    top_ids: tuple[int, ...]


def bit_digest(rows: torch.Tensor) -> list[int]:
    """One integer per row of a 2-D float tensor that changes when any bit changes."""
    ints = rows.contiguous().view({2: torch.int16, 4: torch.int32}[rows.element_size()]).to(torch.int64)
    weights = (torch.arange(ints.shape[1], device=rows.device, dtype=torch.int64) % 8191) + 1
    return ((ints * weights).sum(dim=1) * 1_000_003 + ints.sum(dim=1)).tolist()


@dataclass
class ScheduleRecorder:
    record_logits: bool = False
    launches: list[LaunchRecord] = field(default_factory=list)
    logits: dict[tuple[int, int], LogitRecord] = field(default_factory=dict)
    """(request id, position of the sampled token) -> that row's logits."""
    after_launch: list = field(default_factory=list)
    """Callbacks ``fn(engine, plan, shape, pending)`` run after each launch (e.g. a determinism check)."""
    _plan_rows: list | None = None

    def install(self, engine: DynamicInferenceEngine) -> ScheduleRecorder:
        runner, ctx = engine.runner, engine.context
        launch_plan = engine.launch_plan
        init_state = ctx.initialize_attention_state
        shapes: list = []

        def init_wrapper(plan, **kwargs):  # kwargs: e.g. verify_width
            shape = init_state(plan, **kwargs)
            shapes.append(shape)
            return shape

        def launch_wrapper(plan, step_id, overlapped, timed, *agreed):
            self._plan_rows = list(plan.rows)
            shapes.clear()
            snap = self._snapshot(engine, plan, overlapped)  # before this launch's samples count as in flight
            pending = launch_plan(plan, step_id, overlapped, timed, *agreed)
            self.launches.append(snap)
            for fn in self.after_launch:
                fn(engine, plan, shapes[-1], pending)
            return pending

        ctx.initialize_attention_state = init_wrapper
        engine.launch_plan = launch_wrapper
        if self.record_logits:
            compute_logits = runner.model.compute_logits

            def logits_wrapper(hidden, **kwargs):  # kwargs: e.g. batch_invariant
                logits = compute_logits(hidden, **kwargs)
                self._keep_logits(logits)
                return logits

            runner.model.compute_logits = logits_wrapper
        return self

    def _snapshot(self, engine: DynamicInferenceEngine, plan, overlapped: bool) -> LaunchRecord:
        active = list(engine.context.active.values())
        finishing = tuple(sorted(
            r.request_id for r in active
            if r.num_inflight and r.tokens_certain >= r.sampling_params.num_tokens_to_generate))
        return LaunchRecord(
            index=len(self.launches), overlapped=overlapped,
            rows=tuple(RowRecord(r.request.request_id, r.start, r.num_tokens, r.samples) for r in plan.rows),
            free_blocks=engine.context.allocator.num_available, waiting=len(engine.scheduler.waiting),
            active=len(active), paused=sum(r.status == Status.PAUSED for r in active), finishing_in_flight=finishing,
        )

    def _keep_logits(self, logits: torch.Tensor) -> None:
        rows = self._plan_rows or []
        if logits.shape[0] != len(rows):  # e.g. graph capture on padding rows
            return
        idx = [i for i, r in enumerate(rows) if r.samples]
        if not idx:
            return
        sel = logits[idx]
        digests = bit_digest(sel)
        vals, ids = torch.topk(sel.float(), min(TOP_N, sel.shape[1]), dim=1)
        vals, ids = vals.tolist(), ids.tolist()
        launch = len(self.launches)  # this launch is appended once launch_plan returns
        for k, i in enumerate(idx):
            r = rows[i]
            key = (r.request.request_id, r.start + r.num_tokens)
            self.logits.setdefault(key, LogitRecord(launch, digests[k], ids[k][0], tuple(vals[k]), tuple(ids[k])))


@dataclass(frozen=True)
class ScheduleDiff:
    index: int
    serial: LaunchRecord | None
    other: LaunchRecord | None
    reason: str


def first_schedule_difference(serial: list[LaunchRecord], other: list[LaunchRecord]) -> ScheduleDiff | None:
    """The first launch whose rows differ (None: identical schedules), with a reason."""
    for i in range(max(len(serial), len(other))):
        a = serial[i] if i < len(serial) else None
        b = other[i] if i < len(other) else None
        if a is not None and b is not None and a.rows == b.rows:
            continue
        return ScheduleDiff(i, a, b, _why(a, b))
    return None


def _why(a: LaunchRecord | None, b: LaunchRecord | None) -> str:
    if a is None or b is None:
        return f"one mode made {'fewer' if a is None else 'more'} launches than the other"
    ra = {r.request_id: r for r in a.rows}
    rb = {r.request_id: r for r in b.rows}
    parts = []
    if set(ra) - set(rb):
        parts.append(f"rows only in serial: {sorted(set(ra) - set(rb))}")
    if set(rb) - set(ra):
        parts.append(f"rows only in the other mode: {sorted(set(rb) - set(ra))}")
    for rid in sorted(set(ra) & set(rb)):
        x, y = ra[rid], rb[rid]
        if (x.start, x.num_tokens) != (y.start, y.num_tokens):
            parts.append(f"request {rid}: serial computes [{x.start}, +{x.num_tokens}), the other mode [{y.start}, +{y.num_tokens})")
    if not parts:
        parts.append("same rows in a different order")
    if b.finishing_in_flight:
        parts.append(f"the other mode scheduled while requests {list(b.finishing_in_flight)} had their last token in "
                     f"flight (their KV blocks not yet released: free blocks {b.free_blocks} vs serial {a.free_blocks})")
    if a.paused != b.paused:
        parts.append(f"paused requests: serial {a.paused}, other {b.paused}")
    return "; ".join(parts)


@dataclass(frozen=True)
class LogitDiff:
    key: tuple[int, int]
    serial: LogitRecord
    other: LogitRecord

    def describe(self) -> str:
        a, b = self.serial, self.other
        gap = max(abs(x - y) for x, y in zip(a.top_vals, b.top_vals))
        return (f"request {self.key[0]} position {self.key[1]}: serial launch {a.launch}, other launch {b.launch}; "
                f"argmax {a.argmax} vs {b.argmax}; top-{len(a.top_vals)} values differ by up to {gap:.3g} "
                f"(serial top-2 margin {a.top_vals[0] - a.top_vals[1]:.3g})")


def first_logit_difference(serial: dict, other: dict) -> tuple[LogitDiff | None, int, int]:
    """First (in serial launch order) common (request, position) whose logits bits differ;
    also the number of common keys and of keys with different bits."""
    common = sorted(set(serial) & set(other), key=lambda k: (serial[k].launch, k))
    diffs = [k for k in common if serial[k].digest != other[k].digest]
    first = LogitDiff(diffs[0], serial[diffs[0]], other[diffs[0]]) if diffs else None
    return first, len(common), len(diffs)
