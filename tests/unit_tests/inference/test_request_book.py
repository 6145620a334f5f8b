"""RequestBook.land: which rows of a landed (launch-ahead) step are kept, and what a kept row
appends; RequestBook.commit: what a launched step counts as computed and in flight."""
from types import SimpleNamespace

from megatron_async import SamplingParams
from megatron_async.inference.async_pipeline import HostSamples, PendingLaunch
from megatron_async.inference.engines.request_book import RequestBook
from megatron_async.inference.request import DynamicInferenceRequest, FinishReason, Status
from megatron_async.inference.step_plan import RowPlan, StepPlan


class _Context:
    """What the book asks of a context (no blocks, no prefix cache)."""

    max_sequence_length = 64
    num_speculative_tokens = 0
    spec = None
    allocator = SimpleNamespace(enable_prefix_caching=False, publishes=False)

    def __init__(self):
        self.released = []

    def release(self, req):
        self.released.append(req.request_id)
        req.status = Status.FINISHED


def _book() -> RequestBook:
    return RequestBook(_Context())


def _req(book: RequestBook, rid: int, status: Status, num_tokens: int = 8) -> DynamicInferenceRequest:
    req = DynamicInferenceRequest(rid, [1, 2, 3], SamplingParams(num_tokens_to_generate=num_tokens), seed=rid)
    book.admit(req)
    req.status = status
    return req


def _row(book: RequestBook, status: Status, samples: bool = True, rid: int = 0) -> RowPlan:
    return RowPlan(_req(book, rid, status), start=3, num_tokens=1, samples=samples)


def _land(book: RequestBook, rows: list[RowPlan]):
    for r in rows:  # launched: every sampling row in flight
        r.request.num_inflight += r.samples
    pending = PendingLaunch(1, rows, True, len(rows), False, None, None, None, None, None)
    return book.land(pending, HostSamples([10 + i for i in range(len(rows))], None, None, None, None, None))


def _kept(rows: list[RowPlan]) -> list[int]:
    return [i for i, r in enumerate(rows) if r.request.generated_tokens]


def test_finished_rows_discarded_live_rows_kept():
    book = _book()
    rows = [_row(book, s, rid=i) for i, s in enumerate((Status.ACTIVE, Status.FINISHED, Status.ACTIVE, Status.FINISHED))]
    res = _land(book, rows)
    assert _kept(rows) == [0, 2] and res.num_discarded == 2
    assert [r.request_id for r in res.updated] == [0, 2] and rows[2].request.generated_tokens == [12]
    assert rows[1].request.num_inflight == 1  # a discarded row's request is not touched


def test_non_sampling_rows_are_ignored():
    book = _book()
    rows = [_row(book, Status.ACTIVE, samples=False), _row(book, Status.FINISHED, samples=False, rid=1),
            _row(book, Status.ACTIVE, rid=2)]
    res = _land(book, rows)
    assert _kept(rows) == [2] and res.num_discarded == 0


def test_paused_and_evicted_rows_are_kept():
    # paused keeps its blocks; an evicted (waiting) request still gets its last sample, which
    # becomes part of the prefix it recomputes
    book = _book()
    rows = [_row(book, s, rid=i) for i, s in enumerate((Status.PAUSED, Status.WAITING, Status.FINISHED))]
    res = _land(book, rows)
    assert _kept(rows) == [0, 1] and res.num_discarded == 1
    assert all(r.request.num_inflight == 0 and r.request.inflight_row == -1 for r in rows[:2])


def test_empty_launch_lands_nothing():
    res = _land(_book(), [])
    assert res.finished == res.updated == [] and res.num_discarded == 0


def test_length_limit_finishes_and_releases():
    book = _book()
    rows = [RowPlan(_req(book, 0, Status.ACTIVE, num_tokens=1), 3, 1, True), _row(book, Status.ACTIVE, rid=1)]
    res = _land(book, rows)
    assert [r.request_id for r in res.finished] == [0] and book.ctx.released == [0]
    assert rows[0].request.finish_reason == FinishReason.LENGTH and rows[0].request.status == Status.FINISHED
    assert rows[1].request.status == Status.ACTIVE and res.num_tokens == 2


def test_generation_limit_is_the_tighter_of_both_caps():
    book = _book()  # max_sequence_length 64, prompt of 3
    assert _req(book, 0, Status.WAITING, num_tokens=8).max_generated_tokens == 8
    assert _req(book, 1, Status.WAITING, num_tokens=100).max_generated_tokens == 61


def test_commit_counts_positions_and_in_flight_rows():
    book = _book()
    a, b = _req(book, 0, Status.ACTIVE), _req(book, 1, Status.ACTIVE)
    book.commit(StepPlan([RowPlan(a, 0, 3, samples=True), RowPlan(b, 0, 2, samples=False)]))
    assert (a.num_computed_tokens, a.num_inflight, a.inflight_row) == (3, 1, 0)
    assert (b.num_computed_tokens, b.num_inflight, b.inflight_row) == (2, 0, -1)
