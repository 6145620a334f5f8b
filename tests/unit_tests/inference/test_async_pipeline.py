"""reconcile(): which rows of a landed launch-ahead step are kept (pure function)."""
from megatron_async import SamplingParams
from megatron_async.inference.engines.async_pipeline import reconcile, row_is_live
from megatron_async.inference.engines.step_plan import RowPlan
from megatron_async.inference.request import DynamicInferenceRequest, Status


def _req(rid: int, status: Status) -> DynamicInferenceRequest:
    req = DynamicInferenceRequest(rid, [1, 2, 3], SamplingParams(), seed=rid)
    req.status = status
    return req


def _row(status: Status, samples: bool = True, rid: int = 0) -> RowPlan:
    return RowPlan(_req(rid, status), start=3, num_tokens=1, samples=samples)


def test_finished_rows_discarded_live_rows_kept():
    rows = [_row(Status.ACTIVE), _row(Status.FINISHED), _row(Status.ACTIVE), _row(Status.FINISHED)]
    rec = reconcile(rows)
    assert rec.keep == [0, 2] and rec.discard == [1, 3]


def test_non_sampling_rows_are_ignored():
    rows = [_row(Status.ACTIVE, samples=False), _row(Status.FINISHED, samples=False), _row(Status.ACTIVE)]
    rec = reconcile(rows)
    assert rec.keep == [2] and rec.discard == []


def test_paused_and_evicted_rows_are_kept():
    # paused keeps its blocks; an evicted (waiting) request still gets its last sample, which
    # becomes part of the prefix it recomputes
    rows = [_row(Status.PAUSED), _row(Status.WAITING), _row(Status.FINISHED)]
    rec = reconcile(rows)
    assert rec.keep == [0, 1] and rec.discard == [2]


def test_empty_and_pure():
    assert reconcile([]).keep == [] and reconcile([]).discard == []
    rows = [_row(Status.ACTIVE), _row(Status.FINISHED)]
    statuses = [r.request.status for r in rows]
    assert reconcile(rows) == reconcile(rows)
    assert [r.request.status for r in rows] == statuses
    assert all(r.request.num_inflight == 0 and r.request.generated_tokens == [] for r in rows)


def test_row_is_live():
    assert row_is_live(_req(0, Status.ACTIVE)) and row_is_live(_req(0, Status.PAUSED))
    assert row_is_live(_req(0, Status.WAITING)) and not row_is_live(_req(0, Status.FINISHED))
