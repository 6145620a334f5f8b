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
from megatron_async.inference.dp_routing import keys_from_bytes
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
        digests = draw(st.binary(min_size=32, max_size=32)) * draw(st.integers(0, len(valid.prompt_tokens)))
        news.append(r.NewRequest(valid, draw(st.integers(0, 2**40)), draw(st.integers(0, 2**62)), draw(st.integers(0, 7)),
                                 digests))
    return news, draw(st.lists(st.integers(0, 2**40), max_size=3)), draw(st.lists(st.integers(0, 9), max_size=3))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ups=updates(), fin=st.lists(outputs(), max_size=3), rank=st.integers(0, 7), received=st.integers(0, 2**40),
       evicted=st.lists(tok, max_size=5))
def test_uploads_round_trip_exactly(ups, fin, rank, received, evicted):
    packed = b"".join(k.to_bytes(8, "little", signed=True) for k in evicted)
    got = watched(r.decode_upload, r.encode_upload(r.Upload(fin, ups, rank, received, packed)))
    assert got.updates == ups and all(type(u) is RequestUpdate and type(u.new_tokens) is tuple for u in got.updates)
    assert len(got.finished) == len(fin) and all(map(_same_output, got.finished, fin))
    assert (got.dp_rank, got.received, keys_from_bytes(got.evicted)) == (rank, received, evicted)


def test_routing_fields_that_do_not_fit_are_refused():
    """Evicted keys come in whole 8-byte keys; a request's prompt digests in whole 32-byte
    digests, at most one per prompt token; ranks and counts are non-negative."""
    up = r.encode_upload(r.Upload([], [], 1, 2, b"k" * 8))
    assert watched(r.decode_upload, up).evicted == b"k" * 8
    for bad_up in ([[0, b"", b"", None, None, None, None, None], [], 1, 2, b"k" * 7],
                   [[0, b"", b"", None, None, None, None, None], [], -1, 2, b""],
                   [[0, b"", b"", None, None, None, None, None], [], 1, -2, b""],
                   [[0, b"", b"", None, None, None, None, None], [], 1, 2, "keys"]):
        assert watched(r.decode_upload, wire.pack(bad_up)) == "bad field", bad_up
    new = r._new_request(r.NewRequest(ValidRequest([1, 2], SamplingParams(), [], [], frozenset()), 1, 2, 0, b"d" * 64))
    assert watched(r.decode_payload, wire.pack([[new], b"", b""]))[0][0].digests == b"d" * 64
    for digests in (b"d" * 31, b"d" * 96, [b"d" * 32]):
        assert watched(r.decode_payload, wire.pack([[new[:-1] + [digests]], b"", b""])) == "bad field", digests


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
                   priority=-3, structured_outputs=StructuredOutputs(choice=["a", "b"]), lora="adapter")


def test_every_field_of_the_records_travels():
    """A field added to SamplingParams, ValidRequest, RequestOutput or RequestUpdate fails here
    until the records carry it."""
    import dataclasses

    assert set(EVERY_FIELD) == {fl.name for fl in dataclasses.fields(SamplingParams)}
    sp = SamplingParams(**EVERY_FIELD).frozen_copy()
    assert watched(r.decode_sampling, r.encode_sampling(sp)) == sp
    assert len(dataclasses.fields(ValidRequest)) + len(dataclasses.fields(r.NewRequest)) - 1 == len(
        r._new_request(r.NewRequest(ValidRequest([1], sp, [], [], frozenset()), 1, 2)))
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


@settings(max_examples=300, deadline=None)
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


def _reference_updates(v) -> list[RequestUpdate]:
    """records.decode_updates written plainly from its layout, one update at a time: what the
    column-wise reader must equal on every input (the same updates, or a WireError)."""
    from megatron_async.inference import records
    from megatron_async.inference.communication import wire_fields as f

    n, packed, done, texts, reasons, lps, tops, prompts = f.arity(v, 8, "updates")
    n, packed = f.int_(n, "n", 0, 1 << 24), f.ints(packed, "packed")
    ids, counts, tokens = packed[:n], packed[n:2 * n], packed[2 * n:]
    if len(counts) != n or any(c < 0 for c in counts) or sum(counts) != len(tokens):
        raise f.bad("counts")
    if type(done) is not bytes or len(done) != n:
        raise f.bad("done")
    if texts is None:
        texts = [None] * n
    elif type(texts) is not list or len(texts) != n:
        raise f.bad("texts")
    lp_of = [None] * n
    if lps is not None:
        flags, floats = f.arity(lps, 2, "lps")
        floats = f.floats(floats, "lps")
        if type(flags) is not bytes or len(flags) != n:
            raise f.bad("lps")
        at = 0
        for i in range(n):
            if flags[i]:
                lp_of[i] = tuple(floats[at:at + counts[i]])
                at += counts[i]
        if at != len(floats):
            raise f.bad("lps")
    out, at = [], 0
    for i in range(n):
        out.append(RequestUpdate(ids[i], tuple(tokens[at:at + counts[i]]), f.opt_str(texts[i], "text"), done[i] != 0,
                                 None, lp_of[i]))
        at += counts[i]
    records._read_rare(out, n, reasons, tops, prompts)
    return out


_junk = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**40), st.floats(allow_nan=False), st.text(max_size=3),
                  st.binary(max_size=40), st.lists(st.none() | st.text(max_size=2) | st.integers(0, 3), max_size=5),
                  st.just([]))


def _mutate(data, v: list) -> None:
    """One column of an encoded updates record made subtly wrong (or left right): lengths off by
    one, a negative or shifted token count, a text of another kind, log-prob flags or values
    that do not add up, or a field replaced by a value of another kind."""
    from megatron_async.inference.communication import wire_fields as f

    n = v[0] if type(v[0]) is int and 0 <= v[0] < 64 else 0
    d = data.draw(st.integers(-1, 1))
    what = data.draw(st.sampled_from(["junk", "texts", "lps", "counts", "done", "none"]))
    if what in ("lps", "counts") and (type(v[1]) is not bytes or len(v[1]) % 8 or len(v[1]) < 16 * n):
        what = "junk"
    if what == "junk":
        v[data.draw(st.integers(0, 7))] = data.draw(_junk)
    elif what == "texts":
        v[3] = data.draw(st.lists(st.none() | st.text(max_size=2) | st.integers(0, 3) | st.binary(max_size=2),
                                  min_size=max(0, n + d), max_size=max(0, n + d)))
    elif what == "lps":
        counts = f.ints(v[1], "x")[n:2 * n]
        flags = data.draw(st.binary(min_size=max(0, n + d), max_size=max(0, n + d)))
        k = sum(c for c, w in zip(counts, flags) if w) + data.draw(st.integers(-1, 1))
        v[5] = [flags, f.pack_floats([0.5] * max(0, k))]
    elif what == "counts" and n:
        packed = f.ints(v[1], "x")
        i, new = data.draw(st.integers(n, 2 * n - 1)), data.draw(st.integers(-2, 3))
        extra = new - packed[i] if data.draw(st.booleans()) else 0  # keep the total right, or not
        packed[i] = new
        tokens = packed[2 * n:] + [7] * max(0, extra) if extra >= 0 else packed[2 * n:extra or None]
        v[1] = f.pack_ints(packed[:2 * n] + tokens)
    elif what == "done":
        v[2] = data.draw(st.binary(min_size=max(0, n + d), max_size=max(0, n + d)))


# 500 examples: each kind of damage of _mutate is drawn 50-100 times (the time is Hypothesis
# drawing the examples, not the readers)
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ups=updates(max_n=6), data=st.data())
def test_update_columns_read_as_the_plain_reader_reads_them(ups, data):
    """Valid columns, and columns made subtly wrong: the column-wise reader returns exactly what
    the one-update-at-a-time reader returns, or both refuse."""
    from megatron_async.inference import records

    sent = wire.pack(records.encode_updates(ups))
    v = wire.unpack(sent, 1 << 20)
    for _ in range(data.draw(st.integers(0, 2))):
        _mutate(data, v)
    want = watched(_reference_updates, v)
    got = watched(records.decode_updates, v)
    if isinstance(want, str):
        assert isinstance(got, str), (got, want)  # refused (its reason may name another field)
    else:
        assert got == want and all(type(u) is RequestUpdate and type(u.new_tokens) is tuple for u in got)
        assert all(u.new_log_probs is None or type(u.new_log_probs) is tuple for u in got)
    if wire.pack(v) == sent:
        assert got == ups


def _mutate_output(data, v: list) -> None:
    """One field of an encoded output made wrong (or left right): a value of another kind, a bin
    that is not whole 8-byte values, a top-n entry whose ids and log-probs differ in count or that
    is not a pair, an unknown finish reason, expert ids of a float dtype."""
    i = data.draw(st.integers(0, 11))
    what = data.draw(st.sampled_from(["junk", "bin", "top", "reason", "experts", "none"]))
    if what == "junk":
        v[i] = data.draw(_junk)
    elif what == "bin" and type(v[i]) is bytes:
        v[i] = v[i] + b"\0" * data.draw(st.integers(1, 9)) if data.draw(st.booleans()) else v[i][:-1]
    elif what == "top":
        pair = [b"\0" * 8 * data.draw(st.integers(0, 2)), b"\0" * 8 * data.draw(st.integers(0, 2))]
        v[data.draw(st.sampled_from([6, 10]))] = [pair] if data.draw(st.booleans()) else [pair + [b""]]
    elif what == "reason":
        v[4] = data.draw(st.sampled_from(["stop", "finished", "", "LENGTH"]))
    elif what == "experts":
        dtype = data.draw(st.sampled_from(["int32", "float32", "bool"]))
        v[11] = wire.Array(dtype, (1,), memoryview(bytes(wire.ITEMSIZE[dtype])))


# 400 examples: each kind of damage of _mutate_output is drawn 25-100 times
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(o=outputs(), data=st.data())
def test_a_relayed_output_is_checked_as_decoding_checks_it(o, data):
    """What a relay reads without building it (``check_output``) is refused exactly when
    ``decode_output`` refuses it, and passed on renumbered it decodes to the same output."""
    from megatron_async.inference import records

    sent = wire.pack(records.encode_output(o))
    v = wire.unpack(sent, 1 << 20)
    for _ in range(data.draw(st.integers(0, 2))):
        _mutate_output(data, v)
    want = watched(wire.reader(records.decode_output), list(v))  # (as message readers call them)
    got = watched(wire.reader(records.check_output), list(v))
    if isinstance(want, str):
        assert isinstance(got, str), (got, want)
        return
    assert type(got) is records.CheckedOutput and got.request_id == want.request_id
    got.request_id = want.request_id = 42
    relayed = watched(records.decode_output, wire.unpack(wire.pack(records.encode_output(got)), 1 << 20))
    assert _same_output(relayed, want)
    if wire.pack(v) == sent:
        o.request_id = 42
        assert _same_output(relayed, o)
