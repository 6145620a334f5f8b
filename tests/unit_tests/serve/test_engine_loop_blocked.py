"""The engine thread while generation is blocked (weights left incomplete by a failed transfer,
memory suspended without a pause): a new submission is refused with ``GenerationBlockedError``
(HTTP 503) and nothing joins the engine; a request already running waits, with no error and no
token, and ends with the tokens of an undisturbed run once the engine can generate again."""
import asyncio

import pytest

pytest.importorskip("prometheus_client")

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.serve.engine_loop import EngineLoop  # noqa: E402
from megatron_async.serve.metrics import ServerMetrics  # noqa: E402
from megatron_async.serve.submission import Choice, GenerationBlockedError, Submission  # noqa: E402

PROMPT, PARAMS = [1, 2, 3], SamplingParams(top_k=1, num_tokens_to_generate=24, ignore_eos=True)


def test_blocked_generation_refuses_new_requests_and_holds_running_ones():
    llm = LLM(inference_config=InferenceConfig(max_sequence_length=64, num_kv_blocks=64, max_requests=4, max_tokens=64))
    want = llm.generate([PROMPT], PARAMS)[0].generated_tokens
    loop = EngineLoop(llm.engine, ServerMetrics("t"))
    memory = llm.engine.memory

    def on_engine_thread(action) -> None:  # between two steps, as an admin operation would run
        loop._inbox.put(("call", action))

    loop.start()
    try:
        async def main():
            sub = Submission([Choice(PROMPT, PARAMS)], asyncio.get_running_loop())
            loop.submit(sub)
            await sub.admitted
            first = await asyncio.wait_for(sub.events.get(), 30)
            tokens = list(first.update.new_tokens)
            on_engine_thread(lambda: setattr(memory, "weights_missing", True))  # as a failed transfer leaves it
            await asyncio.sleep(0.3)
            while not sub.events.empty():  # what landed before the flag
                ev = sub.events.get_nowait()
                assert ev.error is None and ev.output is None
                tokens += ev.update.new_tokens
            late = Submission([Choice([4, 5], PARAMS)], asyncio.get_running_loop())
            loop.submit(late)
            with pytest.raises(GenerationBlockedError, match="the engine cannot generate now: the weights were"):
                await asyncio.wait_for(late.admitted, 30)
            await asyncio.sleep(0.5)
            assert sub.events.empty() and len(tokens) < len(want)  # held: no token, no error
            on_engine_thread(lambda: setattr(memory, "weights_missing", False))  # an update completed
            while True:
                ev = await asyncio.wait_for(sub.events.get(), 30)
                assert ev.error is None, ev.error
                tokens += ev.update.new_tokens if ev.update is not None else ()
                if ev.output is not None:
                    return tokens, ev.output

        tokens, out = asyncio.run(main())
        assert tokens == want == out.generated_tokens and out.finish_reason == "length"
        assert not llm.engine.has_unfinished_requests()
    finally:
        loop.stop()
