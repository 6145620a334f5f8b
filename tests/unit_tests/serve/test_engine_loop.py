"""The engine thread of the server, without HTTP: submissions in, per-step events out; a bad
request, an unexpected admission error or a failing step ends only the requests concerned."""
import asyncio

import pytest

pytest.importorskip("prometheus_client")

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.inference.request import InvalidRequestError  # noqa: E402
from megatron_async.serve.engine_loop import EngineLoop  # noqa: E402
from megatron_async.serve.metrics import ServerMetrics  # noqa: E402
from megatron_async.serve.submission import Choice, Submission  # noqa: E402

CONFIG = InferenceConfig(max_sequence_length=64, num_kv_blocks=64, max_requests=8, max_tokens=64)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True)


async def run(loop: EngineLoop, choices: list[Choice]):
    """Submit and collect: (token ids per choice from the updates, final outputs, errors)."""
    sub = Submission(choices, asyncio.get_running_loop())
    loop.submit(sub)
    await sub.admitted
    tokens = [[] for _ in choices]
    outs, errors = [None] * len(choices), []
    while sum(o is not None for o in outs) + len(errors) < len(choices):
        ev = await asyncio.wait_for(sub.events.get(), 30)
        if ev.update is not None:
            tokens[ev.index] += ev.update.new_tokens
        if ev.output is not None:
            outs[ev.index] = ev.output
        if ev.error is not None:
            errors.append(ev.error)
    return tokens, outs, errors


def test_events_failures_and_recovery():
    llm = LLM(inference_config=CONFIG)
    want = [o.generated_tokens for o in llm.generate([[1, 2, 3], [7, 8]], [greedy(5), greedy(3)])]
    loop = EngineLoop(llm.engine, ServerMetrics("t"))
    loop.start()
    real_step, real_add = llm.engine.step, llm.engine.add_request
    try:
        async def main():
            tokens, outs, errors = await run(loop, [Choice([1, 2, 3], greedy(5)), Choice([7, 8], greedy(3))])
            assert tokens == want == [o.generated_tokens for o in outs] and not errors

            with pytest.raises(InvalidRequestError):  # too long: nothing is admitted
                await run(loop, [Choice([1, 2, 3], greedy(2)), Choice(list(range(1, 70)), greedy(2))])

            def add_fails(*a, **k):
                llm.engine.add_request = real_add
                raise TypeError("boom")
            llm.engine.add_request = add_fails
            with pytest.raises(RuntimeError, match="could not admit"):
                await run(loop, [Choice([1, 2, 3], greedy(2))])

            def step_fails():
                llm.engine.step = real_step
                raise RuntimeError("device lost")
            llm.engine.step = step_fails
            _, outs, errors = await run(loop, [Choice([1, 2, 3], greedy(5))])
            assert errors == ["engine step failed: RuntimeError: device lost"]
            for _ in range(100):  # the loop steps on until the engine has ended the failed request
                if not llm.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.05)
            assert not llm.engine.has_unfinished_requests()

            tokens, outs, errors = await run(loop, [Choice([1, 2, 3], greedy(5))])
            assert tokens[0] == want[0] and not errors  # the loop and the engine still serve

        asyncio.run(main())
        assert loop.is_alive()
    finally:
        loop.stop()
    assert not loop.is_alive()
    assert not llm.engine.has_unfinished_requests() and len(llm.context.active) == 0
    alloc = llm.context.allocator
    assert alloc.num_available == alloc.capacity  # the aborted request's blocks came back


def test_gauges_are_current_while_a_step_runs():
    """/metrics is scraped while the engine thread is inside a long step: the request the step
    runs counts as running (the gauges are read at scrape time, not after the step)."""
    import threading

    llm = LLM(inference_config=CONFIG)
    metrics = ServerMetrics("t")
    loop = EngineLoop(llm.engine, metrics)
    real_step, inside, release = llm.engine.step, threading.Event(), threading.Event()

    def long_step():
        res = real_step()  # schedules the request: it now holds KV blocks
        llm.engine.step = real_step
        inside.set()
        release.wait(30)
        return res

    def gauge(name: str) -> float:
        return metrics.registry.get_sample_value(f"megatron_async_{name}", {"model_name": "t"})

    llm.engine.step = long_step
    loop.start()
    try:
        async def main():
            sub = Submission([Choice([1, 2, 3], greedy(3))], asyncio.get_running_loop())
            loop.submit(sub)
            assert await asyncio.to_thread(inside.wait, 30)  # (admission is reported after the step)
            during = gauge("num_requests_running"), gauge("num_requests_waiting"), gauge("kv_cache_usage_perc")
            release.set()
            await sub.admitted
            while (await asyncio.wait_for(sub.events.get(), 30)).output is None:
                pass
            return during

        running, waiting, kv = asyncio.run(main())
        assert (running, waiting) == (1, 0) and kv > 0
        assert gauge("num_requests_running") == 0 and gauge("kv_cache_usage_perc") == 0
    finally:
        release.set()
        loop.stop()
