"""engine.abort_request in every state a request can be in: waiting, prefilling (chunked),
decoding, paused, evicted, and with a launch-ahead row in flight. The request ends with
finish_reason "abort" in the next step's outputs, its blocks / state slot come back, the
others finish with unchanged tokens, and the counters agree."""
import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.request import Status
from tests.helpers.hf_hybrid_models import HYBRID_ARCHS, make_tiny_hybrid_checkpoint
from tests.unit_tests.inference.engine_driver import drive

# 13 usable blocks of 4 tokens for 4 requests that grow to ~20-46 tokens: pauses and evictions;
# max_tokens 8 chunks the 30-token prompt; max_requests 3 keeps the 4th waiting at first.
CFG = dict(block_size_tokens=4, num_kv_blocks=14, max_requests=3, max_tokens=8, max_sequence_length=64)
PROMPTS = [list(range(40, 70)), [5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18], [19, 20, 21, 22]]
PARAMS = [SamplingParams(temperature=0.8, seed=i, num_tokens_to_generate=16, ignore_eos=True) for i in range(4)]


def _in_flight(eng, req) -> bool:
    return req.num_inflight > 0 and eng._pending is not None and req.request_id in eng._pending.request_ids


STATES = {
    "waiting": lambda eng, req: req.status == Status.WAITING and not req.generated_tokens and req.num_computed_tokens == 0,
    "prefilling": lambda eng, req: req.status == Status.ACTIVE and 0 < req.num_computed_tokens < len(req.prompt_tokens),
    "decoding": lambda eng, req: req.status == Status.ACTIVE and len(req.generated_tokens) >= 2 and req.num_inflight == 0,
    "in_flight": lambda eng, req: req.status == Status.ACTIVE and len(req.generated_tokens) >= 2 and _in_flight(eng, req),
    "paused": lambda eng, req: req.status == Status.PAUSED,
    "evicted": lambda eng, req: req.status == Status.WAITING and req.generated_tokens,
}


@pytest.fixture(scope="module")
def reference():
    llm = LLM(inference_config=InferenceConfig(**CFG))
    return [o.generated_tokens for o in llm.generate(PROMPTS, PARAMS)]


def _run_with_abort(llm, state, prompts=PROMPTS):
    eng = llm.engine
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, PARAMS)]
    check = STATES[state]
    for _ in range(200):
        if not eng.has_unfinished_requests():
            pytest.fail(f"no request was ever {state}")
        victim = next((r for r in eng._requests.values() if check(eng, r)), None)
        if victim is not None:
            break
        eng.step()
    discarded = eng.stats.discarded_rows
    assert eng.abort_request(victim.request_id) and not eng.abort_request(victim.request_id)
    res = eng.step()  # the abort lands in this step's outputs
    assert [o.finish_reason for o in res.finished if o.request_id == victim.request_id] == ["abort"]
    ups = [u for u in res.updates if u.request_id == victim.request_id]
    assert len(ups) == 1 and ups[0].finished and ups[0].finish_reason == "abort"
    if state == "in_flight":
        assert eng.stats.discarded_rows == discarded + 1  # its launch-ahead row was dropped
    outs, _ = drive(eng)
    return rids, rids.index(victim.request_id), outs


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_abort_in_every_state(reference, async_scheduling, state):
    if state == "in_flight" and not async_scheduling:
        pytest.skip("nothing is in flight between serial steps")
    llm = LLM(inference_config=InferenceConfig(**CFG, async_scheduling=async_scheduling))
    eng = llm.engine
    rids, victim, outs = _run_with_abort(llm, state)
    for i, rid in enumerate(rids):
        if i != victim:
            assert outs[rid].generated_tokens == reference[i] and outs[rid].finish_reason == "length"
    assert eng.abort_request(rids[victim]) is False  # finished: a no-op
    assert eng.abort_request(12345) is False and eng.abort_request([1]) is False  # unknown: a no-op
    alloc = eng.context.allocator
    assert alloc.num_available == alloc.capacity and not eng.context.active and not eng.scheduler.waiting
    st = eng.stats
    assert st.aborted_requests == 1 and st.finished_requests == len(PROMPTS) - 1
    assert st.paused > 0 and st.evicted > 0  # the workload really has memory pressure


@pytest.fixture(scope="module")
def hybrid_ckpt(tmp_path_factory):
    return make_tiny_hybrid_checkpoint(HYBRID_ARCHS[0], tmp_path_factory.mktemp("hybrid_abort"))


@pytest.mark.parametrize("state", ["prefilling", "decoding", "in_flight", "paused"])
def test_abort_frees_the_mamba_slot(hybrid_ckpt, state):
    llm = LLM(str(hybrid_ckpt), inference_config=InferenceConfig(**CFG))
    vocab = llm.model.vocab_size
    _run_with_abort(llm, state, [[t % vocab for t in p] for p in PROMPTS])
    mamba = llm.context.mamba
    assert len(mamba._free) == mamba.num_slots and len(set(mamba._free)) == mamba.num_slots
    assert llm.context.allocator.num_available == llm.context.allocator.capacity
    assert llm.engine.stats.aborted_requests == 1
