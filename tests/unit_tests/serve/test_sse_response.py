"""SSEResponse: one ASGI send per yielded string, and on_close once however the response ends."""
import asyncio

from megatron_async.serve.sse_response import SSEResponse


async def _serve(events, disconnect_after: float | None, closed: list | None = None):
    sent, closed = [], [] if closed is None else closed

    async def receive():
        if disconnect_after is None:
            await asyncio.Event().wait()  # the client stays until the response ends
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await SSEResponse(events, on_close=lambda: closed.append(True))(None, receive, send)
    return sent, closed


async def _events(count: int, wait_s: float = 0.0):
    for i in range(count):
        if wait_s:
            await asyncio.sleep(wait_s)
        yield f"data: {i}\n\n"


def test_every_yielded_string_is_one_send_then_the_end():
    sent, closed = asyncio.run(_serve(_events(3), None))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert [m["more_body"] for m in sent[1:]] == [True, True, True, False]
    assert closed == [True]


def test_a_disconnect_closes_at_once_and_ends_a_waiting_stream():
    async def run():
        return await asyncio.wait_for(_serve(_events(1000, wait_s=0.01), 0.05), timeout=5)

    sent, closed = asyncio.run(run())
    assert closed == [True]  # once, though both the watcher and the end saw it
    assert 1 < len(sent) < 100 and sent[-1]["more_body"] is True  # cut short, no final empty body


def test_outside_cancellation_still_closes_and_propagates():
    closed = []

    async def run():
        task = asyncio.ensure_future(_serve(_events(1000, wait_s=0.01), None, closed))
        await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(run()) and closed == [True]
