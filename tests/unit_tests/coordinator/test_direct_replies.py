"""Engines answer a same-host client's non-streaming requests directly (dp_engine/direct_replies.py,
client/replies.py): over real sockets, a coordinator on a thread, a null engine's link on
another, a client on this test's event loop. Each request ends exactly once whichever way its
output came; the coordinator hears of the ends off the path; a stranger on the client's reply
socket changes nothing; an engine whose link to a client is gone answers through the
coordinator and never blocks."""
from __future__ import annotations

import asyncio
import threading
from collections import Counter

import zmq

from megatron_async import SamplingParams
from megatron_async.client import InferenceClient
from megatron_async.coordinator import messages
from megatron_async.coordinator.transport import AuthError, PeerSocket
from megatron_async.coordinator.trust import peer_secret
from megatron_async.inference.request import RequestOutput
from megatron_async.dp_engine.join import CoordinatorChannel
from megatron_async.dp_engine.link import EngineLink

ONE = SamplingParams(num_tokens_to_generate=1)


class Counting(InferenceClient):
    """Counts every final output that reaches it, by request id, whichever way it came."""

    def receive(self, kind, fields):
        if kind == "finished":
            self.ends.update(o.request_id for o in fields[0])
        super().receive(kind, fields)


async def counting_client(address: str) -> Counting:
    client = Counting(address)
    client.ends = Counter()
    return await client.start()


def serve_null_engine(address: str):
    from benchmarks.null_engine import NullEngine

    channel = CoordinatorChannel(address, "null")
    link = EngineLink(NullEngine(), channel, 64, "null")
    channel.register(link.info())
    stop = threading.Event()
    t = threading.Thread(target=link.run, args=(stop,), daemon=True)
    t.start()

    def close():
        stop.set()
        t.join(10)
        channel.close()
    return link, channel, close


def test_non_streaming_outputs_come_from_the_engine_and_end_once(server):
    link, channel, close = serve_null_engine(server.address)
    try:
        async def run():
            client = await counting_client(server.address)
            outs = [await asyncio.wait_for(client.add_request([1, 2, 3, 0], ONE), 10)]
            for _ in range(1000):  # the engine's link to this client comes up on its own thread (a handshake)
                if channel.replies._links:
                    break
                await asyncio.sleep(0.01)
            outs += [await asyncio.wait_for(client.add_request([1, 2, 3, i], ONE), 10) for i in range(1, 20)]
            stream = client.add_request_streaming([4, 5], ONE)  # streams keep the coordinator's way
            async for _ in stream:
                pass
            for _ in range(1000):  # the last ends reach the coordinator within DELIVERED_FLUSH_S (a loaded host: later)
                if not server.core.requests.open:
                    break
                await asyncio.sleep(0.01)
            direct = client._channel.replies.received
            client.close()
            return outs, stream.output, client.ends, direct
        outs, streamed, ends, direct = asyncio.run(run())
    finally:
        close()
    assert [o.request_id for o in outs] == list(range(20)) and all(o.finish_reason == "length" for o in outs)
    assert streamed.finish_reason == "length" and sorted(ends.values()) == [1] * 21
    # the first request's output went the coordinator's way while the engine's link came up
    assert direct >= 18 and server.core.counts["delivered_directly"] == direct == channel.replies.sent
    assert not server.core.requests.open and all(s.pending == 0 for s in server.core.engines.slots.values())


def test_a_stranger_on_the_reply_socket_changes_nothing(server):
    async def run():
        client = await InferenceClient(server.address).start()
        endpoint, key = client._channel.replies.endpoint, peer_secret(server.address)
        forged = RequestOutput(0, [1], [666], None, "length")
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(endpoint)
        raw.send(messages.encode("finished", [forged]))  # no handshake
        loop = asyncio.get_running_loop()  # (handshakes off the loop: the client answers on it)
        try:
            await loop.run_in_executor(None, PeerSocket, endpoint, key, "client", "not an engine", 2)  # no such role here
            refused = False
        except AuthError:
            refused = True
        engine_like = await loop.run_in_executor(None, PeerSocket, endpoint, key, "engine", "e", 5)
        engine_like.send("stream", [])  # engines send only "finished" here
        fut = client.add_request([1, 2, 3], ONE)  # no engine: waits, untouched by the forgery
        await asyncio.sleep(0.3)
        stats = client._channel.replies.stats
        pending = not fut.done()
        engine_like.close()
        raw.close()
        client.close()
        return refused, pending, dict(stats.dropped), stats.authenticated
    refused, pending, dropped, authenticated = asyncio.run(run())
    assert refused and pending and authenticated == 1
    assert dropped == {"unauthenticated": 1, "bad hello": 1, "wrong role": 1}


def test_an_engine_answers_through_the_coordinator_once_its_client_link_is_gone(server):
    link, channel, close = serve_null_engine(server.address)
    try:
        async def run():
            client = await counting_client(server.address)
            for i in range(3):
                await asyncio.wait_for(client.add_request([1, i], ONE), 10)
            replies = client._channel.replies
            replies.close(client.loop)  # the client's reply socket goes; its coordinator link stays
            await asyncio.sleep(0.3)
            outs = [await asyncio.wait_for(client.add_request([2, i], ONE), 10) for i in range(5)]
            client.close()
            return outs, client.ends, replies.received
        outs, ends, direct = asyncio.run(run())
    finally:
        close()
    assert all(o.finish_reason == "length" for o in outs) and sorted(ends.values()) == [1] * 8
    assert direct == channel.replies.sent and channel.replies.fallbacks >= 5


def test_links_beyond_the_cap_are_closed_by_the_loop_only(monkeypatch):
    """A link that comes up past ``MAX_LINKS`` does not close the oldest on its connecting thread
    (the loop may be sending on it); the loop's next sweep closes the oldest down to the cap."""
    import zmq

    from megatron_async.dp_engine import direct_replies

    class Link:
        def __init__(self):
            self.closed = False

        def gone(self):
            return False

        def close(self):
            self.closed = True

    monkeypatch.setattr(direct_replies, "MAX_LINKS", 2)
    replies = direct_replies.DirectReplies("ipc:///tmp/x/coordinator", b"k" * 32, "e0", zmq.Context.instance())
    links = {f"ipc:///tmp/x/c{i}": Link() for i in range(4)}
    replies._links = dict(links)
    replies.sweep()
    assert list(replies._links) == ["ipc:///tmp/x/c2", "ipc:///tmp/x/c3"]
    assert [link.closed for link in links.values()] == [True, True, False, False]
