"""Bodies share the engine's places (fair_feed.py ``share``) through the engine loop: a body alone
runs on every place it holds; a short request sent behind it runs in launches that carry the
big body's share (max_requests // 2) and no more, the big body's other places held with their
KV; every token equals the engine's alone, and the holds end with the short request."""
import asyncio

import pytest

pytest.importorskip("prometheus_client")

from megatron_async import LLM, InferenceConfig  # noqa: E402
from megatron_async.serve.engine_loop import EngineLoop  # noqa: E402
from megatron_async.serve.metrics import ServerMetrics  # noqa: E402
from megatron_async.serve.submission import Choice, Submission  # noqa: E402
from tests.unit_tests.serve.test_engine_loop import greedy  # noqa: E402

CONFIG = InferenceConfig(max_sequence_length=64, num_kv_blocks=64, max_requests=8, max_tokens=64)
BIG = [[1 + i % 50, 2 + i % 7, 3] for i in range(24)]
SHORT = [7, 8, 9]


async def collect(sub: Submission) -> dict[int, list[int]]:
    out = {}
    while len(out) < len(sub.choices):
        ev = await asyncio.wait_for(sub.events.get(), 60)
        assert ev.error is None
        if ev.output is not None:
            out[ev.index] = ev.output.generated_tokens
    return out


def test_a_short_body_runs_beside_the_big_bodys_share_with_equal_tokens():
    want = [o.generated_tokens for o in LLM(inference_config=CONFIG).generate(BIG + [SHORT], greedy(12))]
    llm = LLM(inference_config=CONFIG)
    launches = []  # (rows, whether the short request has one)
    launch_plan = llm.engine.launch_plan

    def recording(plan, *args, **kw):
        launches.append((len(plan.rows), any(r.request.prompt_tokens == SHORT for r in plan.rows)))
        return launch_plan(plan, *args, **kw)

    llm.engine.launch_plan = recording
    loop = EngineLoop(llm.engine, ServerMetrics("t"), share=True)
    loop.start()
    try:
        async def main():
            ev_loop = asyncio.get_running_loop()
            alone = Submission([Choice(p, greedy(12)) for p in BIG], ev_loop)
            loop.submit(alone)
            assert [v for _, v in sorted((await collect(alone)).items())] == want[:-1]
            assert llm.engine.stats.held_steps == 0 and max(n for n, _ in launches) == 7  # alone: its cap
            big = Submission([Choice(p, greedy(12)) for p in BIG], ev_loop)
            loop.submit(big)
            await asyncio.wait_for(big.events.get(), 30)  # the big body runs
            short = Submission([Choice(SHORT, greedy(12))], ev_loop)
            loop.submit(short)
            return await collect(short), await collect(big)

        short_out, big_out = asyncio.run(main())
    finally:
        loop.stop()
    assert short_out[0] == want[-1] and [v for _, v in sorted(big_out.items())] == want[:-1]
    beside = [n for n, has_short in launches if has_short]
    assert len(beside) >= 12 and max(beside) <= 8 // 2 + 1  # the big body's share and the short request
    assert llm.engine.stats.held_steps >= 3 and not llm.engine.scheduler.held  # (none once its places fell to 4)
