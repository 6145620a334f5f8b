"""The wire codec: frames round-trip exactly; anything else raises WireError and executes
nothing (every decode runs under tests/helpers/wire_audit.py's audit hook)."""
from __future__ import annotations

import os
import pickle

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_async.inference.communication import wire
from megatron_async.inference.communication import wire_fields as f
from megatron_async.inference.communication.handshake import HELLO
from tests.helpers.wire_audit import watched

MAX = 1 << 16


def _read_pair(fields):
    a, b = f.arity(fields, 2, "pair")
    return f.int_(a, "a", 0, 1000), f.ints(b, "b")


PAIR = wire.message_type("test pair", 120, arity=2, reader=_read_pair)
ANY = wire.message_type("test any", 121)


def _decode_read(frame, allowed, max_bytes):
    mtype, fields = wire.decode(frame, max_bytes, allowed)
    return mtype.read(fields)


def decode_watched(frame, allowed=None, max_bytes=MAX):
    """decode + read under the audit hook: the record or the WireError's reason."""
    return watched(_decode_read, frame, allowed, max_bytes)


def test_round_trip_and_typed_read():
    frame = wire.encode(PAIR, 7, f.pack_ints([1, -2, 2**62]))
    assert decode_watched(frame) == (7, [1, -2, 2**62])
    assert wire.decode(wire.encode(ANY, None, True, 1.5, "s", b"b", [1, [2]], {"k": {"x": 1}}), MAX) == (
        ANY, [None, True, 1.5, "s", b"b", [1, [2]], {"k": {"x": 1}}])


def test_registry_refuses_collisions_and_bad_values():
    with pytest.raises(ValueError, match="collides"):
        wire.message_type("test other", 120)
    with pytest.raises(ValueError, match="collides"):
        wire.message_type("test pair", 122)
    with pytest.raises(ValueError, match="1-127"):
        wire.message_type("test big", 200)
    assert wire.registered("test pair") is PAIR


def test_arrays_round_trip_every_dtype_without_copy():
    for dtype in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"):
        a = (np.arange(24) % 3).astype(dtype).reshape(2, 3, 4)
        got = decode_watched(wire.encode(ANY, wire.Array.of(a)))[0]
        assert got.dtype == dtype and np.array_equal(got.numpy(), a) and not got.numpy().flags.writeable
    t = torch.randn(3, 5).to(torch.bfloat16)
    assert torch.equal(decode_watched(wire.encode(ANY, wire.Array.of(t)))[0].torch(), t)


@pytest.mark.parametrize("frame, reason", [
    (b"\x00" * (MAX + 1), "oversized"),
    (b"\xc1", "undecodable"),
    (msgpack.packb({"a": 1}), "malformed"),
    (msgpack.packb([]), "malformed"),
    (msgpack.packb([127, 1]), "unknown type"),  # (no concern registers 112-127)
    (msgpack.packb([True, 1]), "unknown type"),
    (msgpack.packb([120, 1]), "malformed"),  # wrong arity
    (msgpack.packb([120, "x", b""]), "bad field"),
    (msgpack.packb([120, 1, b"123"]), "bad field"),  # not whole int64s
    (msgpack.packb([120, 2000, b""]), "bad field"),  # out of range
    (msgpack.packb([121, {1: 2}]), "undecodable"),  # int map keys refused
    (msgpack.packb([121, msgpack.ExtType(5, b"x")]), "undecodable"),
    (msgpack.packb([121, msgpack.ExtType(1, bytes([5, 1]) + (4).to_bytes(8, "little") + b"abc")]), "undecodable"),
    (msgpack.packb([121, msgpack.ExtType(1, bytes([99, 0]))]), "undecodable"),
    (b"\xdd\xff\xff\xff\xff", "undecodable"),  # an array of 4G elements in 5 bytes
])
def test_bad_frames_raise_wire_error_with_their_reason(frame, reason):
    assert decode_watched(frame) == reason


def test_a_malicious_pickle_is_dropped_and_runs_nothing(tmp_path):
    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {canary}",)

    for frame in (pickle.dumps(Evil()), pickle.dumps((1, "exchange", Evil())), wire.encode(ANY, pickle.dumps(Evil()))):
        got = decode_watched(frame)
        assert got in ("undecodable", "malformed", "unknown type") or got == [pickle.dumps(Evil())]
    assert not canary.exists()


def test_allowed_types_are_peeked_before_the_body_is_parsed():
    other = wire.encode(ANY, b"x" * 100)
    assert decode_watched(other, frozenset({PAIR})) == "unauthenticated"
    assert decode_watched(b"\x92\xcc\x78", frozenset({PAIR})) == "malformed"  # a type that is not a fixint
    assert decode_watched(wire.encode(PAIR, 1, b""), frozenset({PAIR})) == (1, [])
    assert decode_watched(wire.encode(PAIR, 1, b"\0" * 800), frozenset({PAIR}), max_bytes=512) == "oversized"


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_random_bytes_only_ever_raise_wire_error(data):
    got = decode_watched(data)
    assert isinstance(got, str) or isinstance(got, (list, tuple))


plain = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=5)
                     | st.binary(max_size=9), lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=12)


# 400 examples: ~65 field lists for each of the six types (the time is Hypothesis building them)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([120, 121, HELLO.value, 2, 3, 4]), st.lists(plain, max_size=5))
def test_well_formed_msgpack_with_wrong_fields_is_dropped_not_raised(value, fields):
    got = decode_watched(msgpack.packb([value, *fields], use_bin_type=True))
    assert got is not None or value != 120


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 1000), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20), st.data())
def test_truncated_or_flipped_frames_are_dropped_not_raised(a, b, data):
    frame = bytearray(wire.encode(PAIR, a, f.pack_ints(b)))
    assert decode_watched(bytes(frame)) == (a, b)
    cut = data.draw(st.integers(0, len(frame) - 1))
    decode_watched(bytes(frame[:cut]))
    at = data.draw(st.integers(0, len(frame) - 1))
    frame[at] ^= data.draw(st.integers(1, 255))
    decode_watched(bytes(frame))


def test_plain_values_only():
    with pytest.raises(TypeError, match="no wire encoding"):
        wire.encode(ANY, object())
    assert f.plain({"a": [1, {"b": None}]}, "x") == {"a": [1, {"b": None}]}
    with pytest.raises(wire.WireError):
        f.plain([[[[[1]]]]], "x")


def test_packed_ints_and_floats_round_trip_and_refuse_what_they_cannot_hold():
    """Senders rely on the errors (a client's prompt that is not token ids: TypeError / OverflowError)."""
    for xs in ([], [0], [-(2**63), 2**63 - 1, 5], range(3), {7: 1}.keys(), (True, 2)):
        assert f.ints(f.pack_ints(xs), "x") == [int(x) for x in xs]
    assert f.floats(f.pack_floats([1, 2.5, -0.0, float("inf")]), "x") == [1.0, 2.5, -0.0, float("inf")]
    for big in ([2**63], [-(2**63) - 1]):
        with pytest.raises(OverflowError):
            f.pack_ints(big)
    for bad in (["1"], [1.5], [None]):
        with pytest.raises(TypeError):
            f.pack_ints(bad)
    with pytest.raises(TypeError):
        f.pack_floats(["x"])
