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
