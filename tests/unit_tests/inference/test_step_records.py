"""The ranks' records on the wire (engines/step_records.py): rank 0's news, uploads and
generate's outputs round-trip exactly; anything else is a WireError and runs nothing (every
decode runs under tests/helpers/wire_audit.py's audit hook)."""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_async.inference.communication import wire
from megatron_async.inference.engines import step_records as r
from megatron_async.inference.engines.request_validation import ValidRequest
from megatron_async.inference.request import RequestOutput, RequestUpdate, SamplingParams
from megatron_async.inference.structured.spec import StructuredOutputs
from tests.helpers.wire_audit import watched

tok = st.integers(-(2**63), 2**63 - 1)
text = st.one_of(st.none(), st.text(max_size=8))
lp = st.floats(allow_nan=False, width=64)
top = st.dictionaries(st.integers(0, 2**31), lp, max_size=3)


@st.composite
def updates(draw, max_n=12):
    out = []
    for _ in range(draw(st.integers(0, max_n))):
        toks = tuple(draw(st.lists(tok, max_size=4)))
        done, with_lp = draw(st.booleans()), draw(st.booleans())
        out.append(RequestUpdate(
            draw(tok), toks, draw(text), done, draw(st.sampled_from(["length", "stop", "abort"])) if done else None,
            tuple(draw(lp) for _ in toks) if with_lp else None,
            tuple(draw(top) for _ in toks) if with_lp and draw(st.booleans()) else None,
            tuple(draw(st.lists(lp, max_size=3))) if draw(st.booleans()) else None))
    return out


@st.composite
def outputs(draw):
    gen = draw(st.lists(tok, max_size=6))
    experts = np.array(draw(st.lists(st.integers(-1, 300), min_size=6, max_size=6)), np.int16).reshape(1, 3, 2)
    return RequestOutput(draw(tok), draw(st.lists(tok, max_size=6)), gen, draw(text),
                         draw(st.sampled_from(["length", "stop", "abort", "error"])),
                         [draw(lp) for _ in gen] if draw(st.booleans()) else None,
                         [draw(top) for _ in gen] if draw(st.booleans()) else None, draw(text),
                         [draw(st.integers(0, 9)) for _ in gen] if draw(st.booleans()) else None,
                         draw(st.lists(lp, max_size=3)) if draw(st.booleans()) else None, None,
                         experts if draw(st.booleans()) else None)


def _same_output(a: RequestOutput, b: RequestOutput) -> bool:
    ea, eb = a.routed_experts, b.routed_experts
    if (ea is None) != (eb is None) or (ea is not None and not np.array_equal(ea, eb)):
        return False
    return {**vars(a), "routed_experts": None} == {**vars(b), "routed_experts": None}


@st.composite
def sampling(draw):
    sp = SamplingParams(temperature=draw(st.floats(0, 2)), top_k=draw(st.integers(0, 50)),
                        num_tokens_to_generate=draw(st.integers(1, 64)), seed=draw(st.none() | st.integers(0, 2**62)),
                        stop_words=draw(st.none() | st.text(max_size=4) | st.lists(
                            st.text(max_size=3) | st.lists(st.integers(0, 100), max_size=3).map(tuple), max_size=3).map(tuple)),
                        ignore_eos=draw(st.booleans()), return_log_probs=draw(st.booleans()),
                        logit_bias=draw(st.none() | st.dictionaries(st.integers(0, 999), st.floats(-100, 100), max_size=3)),
                        allowed_token_ids=draw(st.none() | st.lists(st.integers(0, 999), max_size=3).map(tuple)),
                        bad_words=draw(st.none() | st.lists(st.text(max_size=3), max_size=2).map(tuple)))
    if draw(st.booleans()):
        sp.structured_outputs = draw(st.sampled_from([StructuredOutputs(choice=["a", "b"]), StructuredOutputs(regex="[0-9]+"),
                                                      StructuredOutputs(json={"type": "object"}, whitespace="flexible")]))
    return sp.frozen_copy()


@st.composite
def payloads(draw):
    news = []
    for _ in range(draw(st.integers(0, 3))):
        valid = ValidRequest(draw(st.lists(st.integers(0, 2**31), max_size=20)), draw(sampling()),
                             draw(st.lists(st.lists(st.integers(0, 99), min_size=1, max_size=3), max_size=2)),
                             draw(st.lists(st.text(max_size=4), max_size=2)), frozenset(draw(st.sets(st.integers(0, 99), max_size=3))),
                             tuple(draw(st.lists(st.integers(0, 99), max_size=3))))
        news.append(r.NewRequest(valid, draw(st.integers(0, 2**40)), draw(st.integers(0, 2**62)), draw(st.integers(0, 7))))
    return news, draw(st.lists(st.integers(0, 2**40), max_size=3)), draw(st.lists(st.integers(0, 9), max_size=3))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ups=updates(), fin=st.lists(outputs(), max_size=3))
def test_uploads_round_trip_exactly(ups, fin):
    got = watched(r.decode_upload, r.encode_upload(r.Upload(fin, ups)))
    assert got.updates == ups and all(type(u) is RequestUpdate and type(u.new_tokens) is tuple for u in got.updates)
    assert len(got.finished) == len(fin) and all(map(_same_output, got.finished, fin))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=payloads())
def test_rank0_news_round_trip_exactly_and_stay_frozen(payload):
    news, aborts, quiet = watched(r.decode_payload, r.encode_payload(payload))
    assert (news, aborts, quiet) == payload  # NewRequest, ValidRequest and SamplingParams equality
    for a, b in zip(news, payload[0]):
        assert a.valid.sampling_params.stop_words == b.valid.sampling_params.stop_words  # tuples, as admitted
        with pytest.raises(Exception, match="frozen"):
            a.valid.sampling_params.top_k = 3  # admitted requests hold frozen params, as before


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outs=st.lists(outputs(), max_size=4), ids=st.lists(st.integers(0, 2**40), max_size=4))
def test_generate_slots_and_outputs_round_trip(outs, ids):
    slots = [*ids, *outs]
    got = watched(r.decode_slots, r.encode_slots(slots))
    assert got[:len(ids)] == ids and all(map(_same_output, got[len(ids):], outs))
    done = {o.request_id: o for o in outs}
    back = watched(r.decode_outputs, r.encode_outputs(done))
    assert back.keys() == done.keys() and all(_same_output(back[k], done[k]) for k in done)


EVERY_FIELD = dict(temperature=0.5, top_k=3, top_p=0.9, num_tokens_to_generate=7, termination_id=2, ignore_eos=True,
                   seed=5, return_log_probs=True, top_n_logprobs=2, return_prompt_log_probs=True,
                   stop_words=("a", (1, 2)), skip_special_tokens=False, include_stop_str_in_output=True,
                   min_tokens=1, min_p=0.1, presence_penalty=0.2, frequency_penalty=0.3, repetition_penalty=1.1,
                   return_routed_experts=True, logit_bias={3: -1.5}, allowed_token_ids=(1, 2, 3), bad_words=("x",),
                   priority=-3, structured_outputs=StructuredOutputs(choice=["a", "b"]))


def test_every_field_of_the_records_travels():
    """A field added to SamplingParams, ValidRequest, RequestOutput or RequestUpdate fails here
    until the records carry it."""
    import dataclasses

    assert set(EVERY_FIELD) == {fl.name for fl in dataclasses.fields(SamplingParams)}
    sp = SamplingParams(**EVERY_FIELD).frozen_copy()
    assert watched(r.decode_sampling, r.encode_sampling(sp)) == sp
    assert len(dataclasses.fields(ValidRequest)) + 3 == len(r._new_request(r.NewRequest(
        ValidRequest([1], sp, [], [], frozenset()), 1, 2)))
    valid = ValidRequest([1], sp, [[4, 5]], ["a"], frozenset([2]), (7,), ((8, 9), (10, 11, 12)))
    assert r._read_new_request(r._new_request(r.NewRequest(valid, 1, 2))).valid == valid
    assert len(dataclasses.fields(RequestOutput)) == len(r.encode_output(RequestOutput(1, [], [], None, "stop")))
    assert len(RequestUpdate._fields) == 9  # encode_updates unpacks exactly these columns


def test_decode_steps_with_log_probs_on_some_requests_only():
    ups = [RequestUpdate(1, (5,), None, False, None, (-0.5,)), RequestUpdate(2, (6,), "x", False, None),
           RequestUpdate(3, (7,), None, True, "stop", (-1.5,), ({7: -1.5},))]
    assert watched(r.decode_upload, r.encode_upload(r.Upload([], ups))).updates == ups


def test_unknown_sampling_fields_and_objects_are_refused():
    ok = r._new_request(r.NewRequest(ValidRequest([1, 2], SamplingParams(), [], [], frozenset()), 1, 2))
    for bad_sp in ({"not_a_field": 1}, {"top_k": 1.5}, {"top_k": True}, {"stop_words": [[[[["deep"]]]]]},
                   {"stop_words": wire.Array("int8", (1,), memoryview(b"x"))}, ["top_k", 1],
                   {"structured_outputs": {"regex": "a", "choice": ["b"]}}, {"structured_outputs": {"code": "x"}}):
        data = wire.pack([[ok[:1] + [bad_sp] + ok[2:]], b"", b""])
        assert watched(r.decode_payload, data) == "bad field", bad_sp


@settings(max_examples=600, deadline=None)
@given(ups=updates(max_n=4), cut=st.integers(0, 10_000),
       flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4))
def test_truncated_or_corrupted_records_are_refused_not_raised(ups, cut, flips):
    data = bytearray(r.encode_upload(r.Upload([], ups)))
    for at, byte in flips:
        data[at % len(data)] = byte
    for decode in (r.decode_upload, r.decode_payload, r.decode_slots, r.decode_outputs):
        watched(decode, bytes(data[:cut % (len(data) + 1)]))  # a record or a reason; nothing else


def test_a_malicious_pickle_is_refused_and_runs_nothing(tmp_path):
    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {canary}",)

    for data in (pickle.dumps(Evil()), b"MAP1" + pickle.dumps(Evil()), wire.pack([pickle.dumps(Evil()), []])):
        for decode in (r.decode_upload, r.decode_payload, r.decode_slots, r.decode_outputs):
            assert isinstance(watched(decode, data), str)
    assert not canary.exists()
