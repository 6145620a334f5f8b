"""The engine-level API: streaming updates, frozen parameters, unique ids, generate() next to
add_request, a request whose step preparation raises, and bad inputs that cannot escape."""
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_async import LLM, InferenceConfig, InvalidRequestError, SamplingParams
from tests.unit_tests.inference.engine_driver import drive

CFG = dict(block_size_tokens=4, num_kv_blocks=64, max_requests=4, max_tokens=16, max_sequence_length=64)
PROMPTS = ["The quick brown fox", "Hello world! How are you", "Rivers flow to the sea", "def add(a, b):"]


def _llm(async_scheduling: bool = True, **overrides) -> LLM:
    return LLM(inference_config=InferenceConfig(**{**CFG, "async_scheduling": async_scheduling, **overrides}))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_updates_concatenate_to_the_outputs(async_scheduling):
    llm = _llm(async_scheduling)
    eng = llm.engine
    params = [SamplingParams(temperature=0.8, seed=i, num_tokens_to_generate=12 + i, ignore_eos=True) for i in range(4)]
    rids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    outs, updates = drive(eng)
    assert sorted(outs) == sorted(rids)
    for rid in rids:
        ups, out = updates[rid], outs[rid]
        assert [t for u in ups for t in u.new_tokens] == out.generated_tokens
        assert "".join(u.new_text for u in ups) == out.generated_text
        assert out.generated_text == llm.tokenizer.decode(out.generated_tokens, skip_special_tokens=True)
        assert [u.finished for u in ups] == [False] * (len(ups) - 1) + [True]
        assert ups[-1].finish_reason == out.finish_reason == "length"
        assert all(len(u.new_tokens) == 1 for u in ups)  # one token per step: really streamed


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_update_log_probs_concatenate_to_the_outputs(async_scheduling):
    """Updates carry the log-probs (and top-n) of their tokens, only when the request asks."""
    eng = _llm(async_scheduling).engine
    kinds = [dict(return_log_probs=True, top_n_logprobs=3), dict(return_log_probs=True), dict(), dict(top_n_logprobs=2)]
    rids = [eng.add_request(p, SamplingParams(temperature=0.8, seed=i, num_tokens_to_generate=9 + i, ignore_eos=True,
                                              **kw)) for i, (p, kw) in enumerate(zip(PROMPTS, kinds))]
    outs, updates = drive(eng)
    for rid in rids:
        ups, out = updates[rid], outs[rid]
        if out.generated_log_probs is None:
            assert all(u.new_log_probs is None for u in ups)
        else:
            assert [lp for u in ups for lp in u.new_log_probs] == out.generated_log_probs
            assert all(len(u.new_log_probs) == len(u.new_tokens) for u in ups)
        if out.generated_top_n_logprobs is None:
            assert all(u.new_top_n_logprobs is None for u in ups)
        else:
            assert [t for u in ups for t in u.new_top_n_logprobs] == out.generated_top_n_logprobs
    assert outs[rids[0]].generated_log_probs and len(outs[rids[0]].generated_top_n_logprobs[0]) == 3


def test_sampling_params_are_copied_and_frozen_at_admission():
    llm = _llm()
    eng = llm.engine
    stops = [[1023]]
    sp = SamplingParams(top_k=1, num_tokens_to_generate=5, stop_words=stops)
    rid = eng.add_request([5, 6, 7], sp)
    sp.num_tokens_to_generate = 40  # the caller's object is theirs to change
    stops[0][0] = 5
    held = eng._requests[rid].sampling_params
    assert held is not sp and held.num_tokens_to_generate == 5 and held.stop_words == ((1023,),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        held.top_k = 7
    outs, _ = drive(eng)
    assert len(outs[rid].generated_tokens) == 5


def test_request_ids_are_unique():
    llm = _llm()
    eng = llm.engine
    a = eng.add_request([1, 2], SamplingParams(top_k=1, num_tokens_to_generate=2))
    b = eng.add_request([1, 2], SamplingParams(top_k=1, num_tokens_to_generate=2), request_id=10)
    c = eng.add_request([1, 2], SamplingParams(top_k=1, num_tokens_to_generate=2))
    assert (a, b, c) == (0, 10, 11)
    for bad in (10, 3, -1, True, 12.0, "13"):
        with pytest.raises(InvalidRequestError, match="request"):
            eng.add_request([1, 2], SamplingParams(), request_id=bad)
    drive(eng)
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request([1, 2], SamplingParams(), request_id=a)  # finished ids are not reused either
    assert llm.generate([[1, 2]], SamplingParams(top_k=1, num_tokens_to_generate=2))[0].request_id == 12


def test_generate_leaves_other_requests_to_step():
    llm = _llm()
    eng = llm.engine
    mine = eng.add_request("The quick brown fox", SamplingParams(top_k=1, num_tokens_to_generate=30, ignore_eos=True))
    quick = eng.add_request([3, 4], SamplingParams(top_k=1, num_tokens_to_generate=2))
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(top_k=1, num_tokens_to_generate=4))
    assert [len(o.prompt_tokens) for o in outs] == [len(llm.tokenizer.encode("Hello")), 3]
    assert {o.request_id for o in outs}.isdisjoint({mine, quick})
    assert eng.has_unfinished_requests()  # `quick` finished inside generate: held for step()
    rest, updates = drive(eng)
    assert sorted(rest) == [mine, quick]
    assert len(rest[mine].generated_tokens) == 30 and len(rest[quick].generated_tokens) == 2
    for rid, out in rest.items():  # no update was lost either
        assert [t for u in updates[rid] for t in u.new_tokens] == out.generated_tokens
        assert "".join(u.new_text for u in updates[rid]) == out.generated_text


def test_generate_prompt_forms():
    llm = _llm()
    g = SamplingParams(top_k=1, num_tokens_to_generate=3)
    one = llm.generate("Hello", g)
    assert len(one) == 1 and one[0].prompt_tokens == llm.tokenizer.encode("Hello")
    ids = llm.generate([1, 2, 3], g)
    assert len(ids) == 1 and ids[0].prompt_tokens == [1, 2, 3] and len(ids[0].generated_tokens) == 3
    mixed = llm.generate([[1, 2], None, "hi", 7, [1, "x"]], g)
    assert [o.finish_reason for o in mixed] == ["length", "error", "length", "error", "error"]
    assert "NoneType" in mixed[1].error and "int" in mixed[3].error and mixed[4].prompt_tokens == []
    assert llm.generate([], g) == []
    with pytest.raises(InvalidRequestError, match="prompts must be"):
        llm.generate(None, g)


def test_huge_top_k_is_clamped_to_the_vocab():
    llm = _llm()
    sp = dict(temperature=1.0, seed=3, num_tokens_to_generate=6)
    huge, off = llm.generate([[5, 6], [5, 6]], [SamplingParams(top_k=2**63, **sp), SamplingParams(top_k=0, **sp)])
    assert huge.finish_reason != "error" and huge.generated_tokens == off.generated_tokens


@pytest.mark.parametrize("where", ["row", "values"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_a_step_that_raises_for_one_request_fails_only_it(async_scheduling, where):
    params = [SamplingParams(temperature=0.9, seed=i, num_tokens_to_generate=10, ignore_eos=True) for i in range(3)]
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15]]
    reference = [o.generated_tokens for o in _llm(async_scheduling).generate(prompts, params)]
    # no block hashing at admission (prompt sharing reads the tokens there): the fault hits the row
    llm = _llm(async_scheduling, share_prompt_prefill=False)
    eng = llm.engine
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    victim = eng._requests[rids[1]]
    if where == "row":  # a bug tied to one request while its prefill row is assembled
        victim.token_at = victim.tokens_between = lambda *positions: 1 // 0
    else:  # a value that slipped past validation breaks the host buffer while it decodes
        for _ in range(3):
            eng.step()
        victim.seed = 2**64
        # the decode-only fast path copied the seed at admission (contexts/decode_rows.py):
        # drop that copy so its steps read the request again, as a bug in a live value would
        eng.context._decode_rows.free(victim)
    outs, _ = drive(eng)
    bad = outs[rids[1]]
    assert bad.finish_reason == "error" and ("ZeroDivisionError" in bad.error or "OverflowError" in bad.error)
    assert [outs[rids[0]].generated_tokens, outs[rids[2]].generated_tokens] == [reference[0], reference[2]]
    st = eng.stats
    assert st.failed_requests == 1 and st.finished_requests == 2
    if async_scheduling and where == "values":  # failed in launch-ahead: its in-flight row was dropped
        assert st.discarded_rows == 1 and st.overlapped_steps > 5
    assert eng.context.allocator.num_available == eng.context.allocator.capacity and not eng.context.active
    later = llm.generate([[1, 2, 3]], SamplingParams(top_k=1, num_tokens_to_generate=3))[0]
    assert later.finish_reason == "length" and len(later.generated_tokens) == 3  # still serving


_ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4), st.lists(st.one_of(st.integers(-3, 1100), st.text(max_size=3), st.none()), max_size=3),
    st.lists(st.lists(st.integers(-3, 1100), max_size=3), max_size=2),
)
_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.one_of(_ANY, st.lists(st.integers(0, 1023), min_size=1, max_size=20)),
       fields=st.dictionaries(st.sampled_from(_FIELDS), _ANY, max_size=3))
def test_fuzz_only_invalid_request_error_leaves_add_request(fuzz_llm, prompt, fields):
    sp = SamplingParams(num_tokens_to_generate=3)
    for k, v in fields.items():
        setattr(sp, k, v)
    try:
        fuzz_llm.engine.add_request(prompt, sp)
    except InvalidRequestError:
        return
    drive(fuzz_llm.engine)  # whatever was accepted runs without raising


@pytest.fixture(scope="module")
def fuzz_llm():
    return _llm(max_sequence_length=48)


def test_stream_text_off_decodes_once_at_the_end():
    params = [SamplingParams(temperature=0.8, seed=i, num_tokens_to_generate=10, ignore_eos=True,
                             stop_words=["zq"] if i == 2 else None) for i in range(3)]
    texts = {}
    for stream in (True, False):
        llm = _llm(stream_text=stream)
        rids = [llm.engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
        outs, updates = drive(llm.engine)
        texts[stream] = [outs[r].generated_text for r in rids]
        assert all((u.new_text is not None) == stream for r in rids for u in updates[r])
    assert texts[True] == texts[False] and all(texts[True])
