"""engine.pause_generation / resume_generation: "keep" resumes token-identically (async and
serial, greedy and seeded), "abort" ends everything and frees the KV, "wait" finishes the running
requests and admits none; a paused step does no work (EngineStats.paused_steps, steps unchanged)."""
import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.request import Status
from tests.unit_tests.inference.engine_driver import drive

# max_tokens 8 chunks the 14-token prompt; max_requests 2 keeps the third waiting at first.
CFG = dict(block_size_tokens=4, num_kv_blocks=40, max_requests=2, max_tokens=8, max_sequence_length=64)
PROMPTS = [list(range(40, 54)), [5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]


def _params(sampled: bool):
    if sampled:
        return [SamplingParams(temperature=0.8, top_k=20, seed=i, num_tokens_to_generate=10, ignore_eos=True)
                for i in range(3)]
    return [SamplingParams(top_k=1, num_tokens_to_generate=10, ignore_eos=True) for _ in range(3)]


def _llm(async_scheduling: bool) -> LLM:
    return LLM(inference_config=InferenceConfig(**CFG, async_scheduling=async_scheduling))


def _tokens(outs):
    return [outs[rid].generated_tokens for rid in sorted(outs)]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
def test_keep_resumes_token_identically(async_scheduling, sampled):
    params = _params(sampled)
    llm = _llm(async_scheduling)
    eng = llm.engine
    for p, sp in zip(PROMPTS, params):
        eng.add_request(p, sp)
    reference, _ = drive(eng)
    if async_scheduling:
        assert eng.stats.overlapped_steps > 0
    for pause_at in (1, 3, 6):
        llm = _llm(async_scheduling)
        eng = llm.engine
        for p, sp in zip(PROMPTS, params):
            eng.add_request(p, sp)
        outs = {}
        for _ in range(pause_at):
            outs.update((o.request_id, o) for o in eng.step().finished)
        in_flight = eng._pending is not None
        assert in_flight == async_scheduling
        eng.pause_generation("keep")
        landed = eng.step()  # the in-flight launch lands, nothing launches
        outs.update((o.request_id, o) for o in landed.finished)
        assert (landed.step_id != -1) == in_flight and eng._pending is None
        steps, paused, generated = eng.stats.steps, eng.stats.paused_steps, eng.stats.generated_tokens
        for _ in range(3):
            res = eng.step()
            assert res.step_id == -1 and not res.finished and not res.updates
        assert eng.stats.steps == steps and eng.stats.generated_tokens == generated
        assert eng.stats.paused_steps == paused + 3
        assert all(r.block_ids for r in eng.context.active.values())  # they kept their KV
        eng.resume_generation()
        rest, _ = drive(eng)
        outs.update(rest)
        assert _tokens(outs) == _tokens(reference), f"pause at step {pause_at}"
        if async_scheduling:
            assert eng.stats.overlapped_steps > 0


def test_abort_ends_everything_and_frees_the_kv():
    llm = _llm(True)
    eng = llm.engine
    rids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, _params(False))]
    for _ in range(3):
        eng.step()
    assert eng.context.active
    eng.pause_generation("abort")
    late = eng.add_request([1, 2, 3], SamplingParams(num_tokens_to_generate=3, ignore_eos=True))
    res = eng.step()
    assert sorted(o.request_id for o in res.finished) == rids
    assert {o.finish_reason for o in res.finished} == {"abort"}
    assert eng.stats.aborted_requests == 3 and eng._pending is None
    assert not eng.context.active
    assert eng.context.allocator.num_available == eng.context.allocator.capacity
    assert eng._requests[late].status == Status.WAITING  # queued while paused, not run
    assert eng.step().step_id == -1 and eng._requests[late].status == Status.WAITING
    eng.resume_generation()
    outs, _ = drive(eng)
    assert outs[late].finish_reason == "length" and len(outs[late].generated_tokens) == 3


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
def test_wait_finishes_running_requests_and_admits_none(async_scheduling):
    llm = _llm(async_scheduling)
    eng = llm.engine
    rids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, _params(False))]
    while len(eng.context.active) < 2:
        eng.step()
    running = set(eng.context.active)
    assert running == set(rids[:2]) and eng._requests[rids[2]].status == Status.WAITING
    eng.pause_generation("wait")
    outs = {}
    for _ in range(50):
        res = eng.step()
        outs.update((o.request_id, o) for o in res.finished)
        if res.step_id == -1:
            break
    assert set(outs) == running and {o.finish_reason for o in outs.values()} == {"length"}
    waiting = eng._requests[rids[2]]
    assert waiting.status == Status.WAITING and not waiting.generated_tokens
    paused = eng.stats.paused_steps
    assert paused >= 1 and eng.step().step_id == -1 and eng.stats.paused_steps == paused + 1
    with pytest.raises(RuntimeError, match="paused"):  # would wait forever
        eng.run_until_done()
    with pytest.raises(RuntimeError, match="paused"):
        llm.generate([1, 2, 3])
    eng.resume_generation()
    rest, _ = drive(eng)
    assert set(rest) == {rids[2], rids[2] + 1}  # the waiting one and generate's, queued while paused
    assert len(rest[rids[2]].generated_tokens) == 10


def test_bad_mode_refused():
    eng = _llm(True).engine
    with pytest.raises(ValueError, match="unknown pause mode"):
        eng.pause_generation("stop")
    assert not eng.is_paused
