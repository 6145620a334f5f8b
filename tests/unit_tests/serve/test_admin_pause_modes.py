"""POST /pause_generation with each mode through the server's routes, each told apart by what
the running requests do: "abort" ends them (finish_reason "abort"); "wait" lets them run to
their end while a request sent during the pause waits for /resume_generation; "keep" stops
them (no token while paused) and they finish after resuming with the tokens of a run never
paused."""
import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.serve.submission import Choice, Submission  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402
from tests.unit_tests.serve.test_admin_routes import CONFIG, _server, post  # noqa: E402

PROMPTS = [[3, 4, 5, 6, 7], [9, 8, 7]]
PARAMS = SamplingParams(top_k=1, num_tokens_to_generate=40, ignore_eos=True)
QUIET_S = 1.0
"""A paused request gains no token for this long (unpaused, all 40 take well under it)."""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("pause") / "qwen3", seed=0)


@pytest.fixture(scope="module")
def served(ckpt):
    want = [o.generated_tokens for o in LLM(str(ckpt), inference_config=InferenceConfig(**CONFIG)).generate(PROMPTS, PARAMS)]
    llm, state, app = _server(ckpt, "--enable-admin-endpoints")
    state.engine_loop.start()
    yield llm, state.engine_loop, app, want
    state.engine_loop.stop()


class Running:
    """One submission's events, read as they come."""

    def __init__(self, loop, prompt):
        self.sub = Submission([Choice(prompt, PARAMS)], asyncio.get_running_loop())
        loop.submit(self.sub)
        self.tokens: list[int] = []
        self.output = None

    async def next(self, timeout: float):
        """The next event (None: nothing for ``timeout`` seconds)."""
        try:
            ev = await asyncio.wait_for(self.sub.events.get(), timeout)
        except asyncio.TimeoutError:
            return None
        assert ev.error is None, ev.error
        self.tokens += ev.update.new_tokens if ev.update is not None else []
        self.output = ev.output or self.output
        return ev

    async def started(self):
        await self.sub.admitted
        while not self.tokens:
            assert await self.next(30) is not None

    async def finish(self, timeout: float = 30):
        while self.output is None:
            assert await self.next(timeout) is not None, "no event"
        return self.output


async def _pause(app, mode: str) -> None:
    status, body = await post(app, "/pause_generation", {"mode": mode})
    assert status == 200 and body["paused"], body


async def _resume(app) -> None:
    status, body = await post(app, "/resume_generation")
    assert status == 200 and not body["paused"], body


def test_abort_ends_the_running_requests(served):
    llm, loop, app, want = served

    async def main():
        runs = [Running(loop, p) for p in PROMPTS]
        for r in runs:
            await r.started()
        await _pause(app, "abort")
        outs = [await r.finish() for r in runs]
        assert [o.finish_reason for o in outs] == ["abort", "abort"]
        assert all(len(o.generated_tokens) < 40 for o in outs)
        await _resume(app)
        after = Running(loop, PROMPTS[0])
        assert (await after.finish()).generated_tokens == want[0]

    asyncio.run(main())


def test_wait_finishes_the_running_and_holds_the_new(served):
    llm, loop, app, want = served

    async def main():
        first = Running(loop, PROMPTS[0])
        await first.started()
        await _pause(app, "wait")
        late = Running(loop, PROMPTS[1])  # sent while paused: admitted only after the resume
        out = await first.finish()
        assert out.finish_reason == "length" and out.generated_tokens == want[0]
        assert await late.next(QUIET_S) is None and not late.tokens
        assert llm.engine.is_paused and not llm.engine.context.active
        await _resume(app)
        assert (await late.finish()).generated_tokens == want[1]

    asyncio.run(main())


def test_keep_stops_the_running_until_resumed(served):
    llm, loop, app, want = served

    async def main():
        runs = [Running(loop, p) for p in PROMPTS]
        for r in runs:
            await r.started()
        await _pause(app, "keep")
        for r in runs:  # the launch in flight lands; then nothing comes
            while await r.next(QUIET_S) is not None:
                pass
            assert r.output is None and len(r.tokens) < 40
        assert llm.engine.is_paused and len(llm.engine.context.active) == 2
        await _resume(app)
        outs = [await r.finish() for r in runs]
        assert [o.generated_tokens for o in outs] == want
        assert [o.finish_reason for o in outs] == ["length", "length"]

    asyncio.run(main())
