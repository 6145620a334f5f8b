"""The server over a coordinator (client_loop.py) sends choices in the fair order of fair_feed.py:
at most the engines' places are out at once (read from the coordinator's engine listing), a
short request sent behind a huge body goes out at once, the big body's next choices as places
free up (groups of one prompt kept whole), and an abort ends the choices that never went out.
Driven with a stand-in client: no coordinator, no engine."""
import asyncio
import itertools

import pytest

pytest.importorskip("prometheus_client")

from megatron_async.inference.request import RequestOutput, SamplingParams  # noqa: E402
from megatron_async.serve.client_loop import ClientEngineLoop  # noqa: E402
from megatron_async.serve.metrics import ServerMetrics  # noqa: E402
from megatron_async.serve.submission import Choice, Submission  # noqa: E402


class StandInClient:
    """What ClientEngineLoop uses of an InferenceClient; records each group sent."""

    def __init__(self, places_per_engine: list[int]):
        self.lost = None
        self.sent: list[tuple[list[int], list]] = []  # (prompt, sinks) per group
        self.aborted: list[int] = []
        self._ids = itertools.count()
        self._listing = {"engines": [{"state": "active", "max_requests": n} for n in places_per_engine]}

    def bind_running_loop(self):
        pass

    async def engines(self):
        return self._listing

    def add_group_streaming(self, prompt, params, sinks):
        for sink in sinks:
            sink.request_id = next(self._ids)
        self.sent.append((prompt, sinks))

    def abort_request(self, rid):
        self.aborted.append(rid)

    def out(self) -> int:
        return sum(len(sinks) for _, sinks in self.sent)


def finish(sink, n_tokens: int = 1) -> None:
    sink.put(RequestOutput(sink.request_id, [], [1] * n_tokens, "", "length"))


def test_a_short_request_goes_out_before_a_huge_bodys_rest():
    async def main():
        client = StandInClient([4, 4])
        loop = ClientEngineLoop(client, ServerMetrics("t"), places=2)
        assert await loop.healthy() and loop.feed.max_requests == 8  # the engines' places, summed
        ev = asyncio.get_running_loop()
        params = SamplingParams(num_tokens_to_generate=4)
        big = Submission([Choice([1 + i], params) for i in range(100)], ev)
        loop.submit(big)
        assert client.out() == 7  # its cap of the 8 places; 93 wait here, not in an engine's queue
        short = Submission([Choice([7, 7], params)], ev)
        loop.submit(short)
        assert client.sent[-1][0] == [7, 7] and client.out() == 8
        for _, sinks in list(client.sent[:3]):
            finish(sinks[0])
        await asyncio.sleep(0)
        assert client.out() == 11 and [p for p, _ in client.sent[-3:]] == [[8], [9], [10]]
        loop.abort(big)
        ended = [big.events.get_nowait().output.finish_reason for _ in range(big.events.qsize())]
        assert ended == ["length"] * 3 + ["abort"] * 90  # the 90 that never went out end here
        assert client.aborted == [r for r in big.request_ids if r >= 0] and len(client.aborted) == 10
        samples = Submission([Choice([5], params)] * 3, ev)  # n = 3 of one prompt: no place free
        loop.submit(samples)
        assert client.out() == 11
        for _, sinks in client.sent[3:5]:  # two of the big body's aborts come back in one message
            finish(sinks[0])
        await asyncio.sleep(0)
        assert client.sent[-1][0] == [5] and len(client.sent[-1][1]) == 2  # places freed together: one group
        finish(short_sink := client.sent[7][1][0])
        await asyncio.sleep(0)
        assert client.sent[-1][0] == [5] and len(client.sent[-1][1]) == 1 and client.out() == 14
        assert (await short.admitted) == [short_sink.request_id] and loop.feed.pending == 0

    asyncio.run(main())


def test_a_lost_coordinator_fails_the_request_and_frees_its_places():
    async def main():
        client = StandInClient([4])
        loop = ClientEngineLoop(client, ServerMetrics("t"), places=4)

        def gone(*args):
            raise ConnectionError("the coordinator left")

        client.add_group_streaming = gone
        sub = Submission([Choice([1], SamplingParams()), Choice([2], SamplingParams())], asyncio.get_running_loop())
        loop.submit(sub)
        with pytest.raises(RuntimeError, match="cannot be reached"):
            await sub.admitted
        assert loop.feed.placed == 0 and not loop.feed._bodies

    asyncio.run(main())
