"""Fair admission between bodies (serve/fair_feed.py): a body with nothing in the engine goes
first, the others take turns one choice each, one body never fills the engine, a class passed
over ages as the engine's queue does, bodies in the engine share its places; through the
engine loop, a short request sent behind a body of 60 prompts on an engine of 8 places finishes
while most of the big body still waits, and aborting the big body ends every choice, including
those that never reached the engine."""
import asyncio

import pytest

pytest.importorskip("prometheus_client")

from megatron_async import LLM, InferenceConfig  # noqa: E402
from megatron_async.serve.engine_loop import EngineLoop  # noqa: E402
from megatron_async.serve.fair_feed import FairFeed, body_cap  # noqa: E402
from megatron_async.serve.metrics import ServerMetrics  # noqa: E402
from megatron_async.serve.submission import Choice, Submission  # noqa: E402
from tests.unit_tests.serve.test_engine_loop import greedy  # noqa: E402


class Body:
    def __init__(self, name: str, n: int):
        self.name, self.choices = name, [None] * n


def names(taken) -> str:
    return "".join(f"{sub.name}{i}" for sub, i in taken)


def test_reserve_turns_and_newcomers_first():
    assert [body_cap(m) for m in (1, 2, 8, 16, 64, 128)] == [1, 1, 7, 15, 60, 120]
    feed = FairFeed(max_requests=8)
    a, b, c = Body("a", 100), Body("b", 3), Body("c", 1)
    feed.add(a)
    assert names(feed.take()) == "a0a1a2a3a4a5a6"  # at its cap: one place stays free
    feed.add(b)
    assert names(feed.take()) == "b0"  # the newcomer takes it at once
    assert feed.placed == 8 and feed.take() == []
    feed.add(c)
    for i in range(3):
        feed.ended(a, i)
    assert names(feed.take()) == "c0b1a7"  # c has nothing running: first; then b and a take turns
    feed.ended(b, 0)
    feed.ended(b, 1)
    assert names(feed.take()) == "b2a8"
    assert feed.pending == 91
    assert list(feed.drop(a)) == list(range(9, 100)) and feed.pending == 0
    for sub, indices in ((a, range(3, 9)), (b, [2]), (c, [0])):
        for i in indices:
            feed.ended(sub, i)
    assert feed.placed == 0 and not feed._bodies and feed.take() == []


def test_lower_priority_classes_first():
    """A body of a lower class passes every body of higher ones, whatever their turns; within a
    class the turns go on as before; a class left empty does not linger."""
    feed = FairFeed(max_requests=4)
    low, mid, high, mid2 = Body("l", 5), Body("m", 5), Body("h", 2), Body("n", 1)
    feed.add(low, priority=5)
    assert names(feed.take()) == "l0l1l2"  # at its cap
    feed.add(mid, priority=1)
    feed.add(high, priority=-3)
    assert names(feed.take()) == "h0"
    for i in range(2):
        feed.ended(low, i)
    feed.add(mid2, priority=1)
    assert names(feed.take()) == "h1m0"  # class -3, then class 1 (the low body waits)
    feed.ended(high, 0)
    feed.ended(high, 1)
    assert names(feed.take()) == "n0m1"  # a body with nothing in the engine first, within its class
    assert sorted(feed._classes) == [1, 5]
    assert list(feed.drop(mid)) == [2, 3, 4] and list(feed.drop(low)) == [3, 4] and feed.pending == 0


def test_a_class_passed_over_ages_as_the_engines_queue_does():
    """With aging 2, a body of class 1 behind class-0 bodies that keep coming gets one turn after
    every 2 choices handed to the engine (strict priority would never serve it while class 0
    waits); each turn starts its wait again."""
    feed = FairFeed(max_requests=1, aging=2)
    low, high = Body("L", 3), Body("H", 100)
    feed.add(low, priority=1)
    feed.add(high, priority=0)
    order = []
    for _ in range(8):
        (sub, i), = feed.take()
        order.append(f"{sub.name}{i}")
        feed.ended(sub, i)
    assert "".join(order) == "H0H1L0H2H3L1H4H5"


def test_bodies_in_the_engine_share_its_places():
    """With share, a body alone holds up to its cap; a second body in the engine halves its
    share: it takes no new place and its newest places are held, until the other leaves."""
    feed = FairFeed(max_requests=8, share=True)
    a, b = Body("a", 100), Body("b", 1)
    feed.add(a)
    assert names(feed.take()) == "a0a1a2a3a4a5a6" and feed.held() == []  # alone: every place runs
    feed.add(b)
    assert names(feed.take()) == "b0"
    assert names(feed.held()) == "a4a5a6"  # 8 // 2 bodies = 4 places each
    feed.ended(a, 0)
    assert feed.take() == [] and names(feed.held()) == "a5a6"  # over its share: no new place
    feed.ended(b, 0)
    assert feed.held() == [] and names(feed.take()) == "a7"  # alone again: up to its cap
    assert not FairFeed(max_requests=8).held() and FairFeed(8, share=True).fits(7)


def test_whole_bodies_go_straight_to_the_engine_while_they_fit():
    feed = FairFeed(max_requests=8)
    assert feed.fits(7) and not feed.fits(8)  # one body: at most its cap
    feed.place(Body("a", 5), 5)
    assert feed.fits(3) and not feed.fits(4)
    feed.add(Body("b", 20))
    assert not feed.fits(1)  # others wait: a new body queues behind in turn


def test_short_request_behind_a_big_body_through_the_engine_loop():
    llm = LLM(inference_config=InferenceConfig(max_sequence_length=64, num_kv_blocks=64, max_requests=8, max_tokens=64))
    loop = EngineLoop(llm.engine, ServerMetrics("t"))
    loop.start()
    try:
        async def main():
            ev_loop = asyncio.get_running_loop()
            big = Submission([Choice([1 + i % 50, 2, 3], greedy(16)) for i in range(60)], ev_loop)
            loop.submit(big)
            await big.admitted
            first = await asyncio.wait_for(big.events.get(), 30)  # the big body runs
            assert first.update is not None
            short = Submission([Choice([7, 8], greedy(2))], ev_loop)
            loop.submit(short)
            await short.admitted
            done_big = 0
            while True:
                ev = await asyncio.wait_for(short.events.get(), 30)
                if ev.output is not None:
                    break
            while not big.events.empty():
                done_big += big.events.get_nowait().output is not None
            assert ev.output.finish_reason == "length" and len(ev.output.generated_tokens) == 2
            assert done_big <= 8  # it did not wait for the 60 prompts ahead of it
            assert len(llm.engine.scheduler.waiting) <= 1  # the engine's own queue stays short
            loop.abort(big)
            ended = set()
            while len(ended) < 60:
                ev = await asyncio.wait_for(big.events.get(), 30)
                if ev.output is not None:
                    ended.add(ev.index)
            return ended

        assert asyncio.run(main()) == set(range(60))
        assert loop.feed.placed == 0 and loop.feed.pending == 0 and not loop.feed._bodies
    finally:
        loop.stop()
    assert not llm.engine.has_unfinished_requests()


def test_a_body_larger_than_its_cap_runs_to_its_end():
    """n = max_requests choices: one waits for a place of its own body, and gets it once the
    others end, with nothing else to wake the loop."""
    llm = LLM(inference_config=InferenceConfig(max_sequence_length=64, num_kv_blocks=64, max_requests=4, max_tokens=64,
                                               priority_aging=5))
    loop = EngineLoop(llm.engine, ServerMetrics("t"))
    assert loop.feed.aging == 5  # the engine's own setting
    loop.start()
    try:
        async def main():
            sub = Submission([Choice([1, 2, 3], greedy(2)) for _ in range(4)], asyncio.get_running_loop())
            loop.submit(sub)
            await sub.admitted
            ended = 0
            while ended < 4:
                ev = await asyncio.wait_for(sub.events.get(), 30)
                ended += ev.output is not None
                assert ev.error is None

        asyncio.run(main())
    finally:
        loop.stop()
