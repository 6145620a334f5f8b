"""Held requests (``Scheduler.hold``): no row and no admission while held, blocks and place kept,
admissions not blocked (as a paused request would), a held decode with a sample in flight goes
on from its landed token once released, and holds never leave a step empty."""
from megatron_async.inference.request import Status
from tests.unit_tests.inference.test_scheduler import Driver, model, rows  # noqa: F401 -- the fixture


def test_held_rows_wait_with_their_blocks_and_admissions_go_on(model):  # noqa: F811
    d = Driver(model, max_requests=4, max_tokens=16)
    a, b = d.add(3, num_tokens=6), d.add(2, num_tokens=6)
    first = d.step()
    d.sched.hold([a.request_id])
    w = d.add(2)
    plan = d.step(has_inflight=True)  # a's sample is in flight: it gets no row, w is admitted
    assert rows(plan) == [(1, 2, 1), (2, 0, 2)]
    blocks = list(a.block_ids)
    d.land(first)
    d.land(plan)
    plan = d.serial()
    assert a.request_id not in {r.request.request_id for r in plan.rows}
    assert a.status == Status.ACTIVE and a.block_ids == blocks and len(a.generated_tokens) == 1
    d.sched.hold([])
    plan = d.serial()  # released: its landed token is its next row's input, read on the host
    assert rows(plan)[0] == (0, 3, 1) and plan.rows[0].prev_row == -1
    assert len(a.generated_tokens) == 2


def test_held_waiting_requests_are_passed_over(model):  # noqa: F811
    d = Driver(model, max_requests=4, max_tokens=16)
    a, b = d.add(2), d.add(2)
    d.sched.hold([a.request_id])
    assert [r.request for r in d.serial().rows] == [b] and list(d.sched.waiting) == [a]


def test_holds_never_leave_a_step_empty(model):  # noqa: F811
    d = Driver(model, max_requests=4, max_tokens=16)
    a, b = d.add(2), d.add(2)
    d.serial()
    d.sched.hold([a.request_id, b.request_id])
    assert rows(d.serial()) == [(0, 2, 1), (1, 2, 1)]  # nothing else could run: the holds give way
    assert d.sched.num_evicted_events == 0
