"""The launch path's stream helpers (``device.current_stream`` / ``set_stream``) agree with
torch.cuda's, under stream contexts too, and the staged snapshot copy leaves the caller's
stream current and its copy ordered on that stream."""
import pytest
import torch

from megatron_async.inference.contexts.bookkeeping_layout import BookkeepingLayout, FieldSpec
from megatron_async.inference.contexts.gpu_view import ContextGPUView
from megatron_async.inference.device import DeviceFacade, current_stream, set_stream

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_current_and_set_stream_match_torch():
    dev = torch.cuda.current_device()
    assert current_stream(dev) == torch.cuda.current_stream(dev)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current_stream(dev) == side == torch.cuda.current_stream(dev)
    assert current_stream(dev) == torch.cuda.default_stream(dev)
    set_stream(side)
    try:
        assert torch.cuda.current_stream(dev) == side
    finally:
        set_stream(torch.cuda.default_stream(dev))
    assert torch.cuda.current_stream(dev) == torch.cuda.default_stream(dev)


def test_staged_copy_and_event_follow_the_callers_stream():
    """Launched from a non-default stream: the views are written in that stream's order (a long
    sleep on it comes first), the stream stays current, and an event the facade records there
    passes only after the copy."""
    layout = BookkeepingLayout([FieldSpec("x", torch.int32, (1024,))])
    view = ContextGPUView(layout, torch.device("cuda"))
    facade = DeviceFacade("cuda")
    host = torch.full((layout.nbytes,), 7, dtype=torch.uint8).pin_memory()
    user = torch.cuda.Stream()
    with torch.cuda.stream(user):
        view.buffer.zero_()
        torch.cuda._sleep(20_000_000)  # ~10 ms: the copy must wait behind it
        view.copy_from(host)
        assert torch.cuda.current_stream() == user
        ev = facade.event()
        facade.record(ev)
        snapshot = view.buffer.clone()  # on ``user``, after the copy
    assert not ev.query()  # the sleep is still running on ``user``
    ev.synchronize()
    torch.cuda.synchronize()
    assert int(snapshot.min()) == int(snapshot.max()) == 7
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


@pytest.mark.parametrize("blocking", [False, True])
def test_launch_events_come_from_a_ring_and_still_order(blocking):
    """``DeviceFacade.event`` hands each kind's events out in turn (the same object every
    ``EVENT_RING`` calls, never the other kind's), and an event handed out again waits for its
    newest record: behind a long sleep, not an earlier record that has passed."""
    from megatron_async.inference.device import EVENT_RING

    facade = DeviceFacade("cuda")
    first = [facade.event(blocking) for _ in range(EVENT_RING)]
    assert len({id(e) for e in first}) == EVENT_RING and facade.event(blocking) is first[0]
    assert all(e is not o for e in first for o in (facade.event(not blocking) for _ in range(2)))
    again = first[1]
    assert facade.event(blocking) is again
    facade.record(again)
    again.synchronize()
    torch.cuda._sleep(50_000_000)  # ~25 ms
    facade.record(again)
    assert not again.query()
    again.synchronize()
    assert again.query()
