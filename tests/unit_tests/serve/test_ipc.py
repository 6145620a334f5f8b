"""The messages between the engine's process and its front-ends (serve/ipc.py), on the project's
wire: a step's entries come back equal and in order, whatever their mix; a submission's choices
come back equal, a prompt shared by several choices travelling once; any frame that is not a
valid message of its socket (garbage, an unknown or another socket's type, an oversized one,
positions out of order, a pickle) is a WireError with its reason, and decoding it runs nothing
(tests/helpers/wire_audit.py). What a step costs: python -m benchmarks ipc-encode."""
import os
import pickle

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("zmq")

from megatron_async.inference.communication import wire  # noqa: E402
from megatron_async.inference.request import InvalidRequestError, RequestOutput, RequestUpdate  # noqa: E402
from megatron_async.inference.request import SamplingParams  # noqa: E402
from megatron_async.inference.structured.spec import StructuredOutputs  # noqa: E402
from megatron_async.serve import ipc  # noqa: E402
from megatron_async.serve.submission import Choice, ChoiceEvent, GenerationBlockedError  # noqa: E402
from tests.helpers.wire_audit import watched  # noqa: E402
from tests.unit_tests.inference.test_step_records import _same_output, outputs, updates  # noqa: E402

UPDATE = RequestUpdate(7, (5, 6), " hi", False, None, (-0.5, -1.0), ({5: -0.5}, {6: -1.0}), (-2.0,), ({3: -2.0},))
OUTPUT = RequestOutput(7, [1, 2], [5, 6], " hi", "length", generated_log_probs=[-0.5, -1.0])


def same(back: list, entries: list) -> bool:
    """Equal entries (an exception: the same class and message)."""
    if [(s, k) for s, k, _ in back] != [(s, k) for s, k, _ in entries]:
        return False
    for (_, kind, got), (_, _, want) in zip(back, entries):
        if kind == "rejected":
            if type(got) is not type(want) or str(got) != str(want):
                return False
        elif kind == "event" and want.output is not None:
            if got._replace(output=None) != want._replace(output=None) or not _same_output(got.output, want.output):
                return False
        elif got != want:
            return False
    return True


def test_every_kind_of_entry_comes_back_equal_and_in_order():
    entries = [(3, "admitted", [7, 8, -1]), (3, "event", ChoiceEvent(1, UPDATE)), (3, "event", ChoiceEvent(1, output=OUTPUT)),
               (4, "event", ChoiceEvent(0, error="engine step failed")), (5, "rejected", InvalidRequestError("too long")),
               (9, "rejected", GenerationBlockedError("suspended")), (10, "rejected", RuntimeError("could not admit")),
               (6, "admin", (409, {"error": {"message": "x", "code": 409}})),
               (3, "event", ChoiceEvent(0, RequestUpdate(8, (), "", True, "stop"))), (3, "event", ChoiceEvent(2, UPDATE))]
    back = watched(ipc.decode_entries, ipc.encode_entries(entries))
    assert same(back, entries)
    assert type(back[1][2]) is ChoiceEvent and type(back[1][2].update) is RequestUpdate
    assert type(back[8][2].update) is RequestUpdate and back[8][2].update.finish_reason == "stop"


@st.composite
def steps(draw):
    """A step's entries: updates of every shape among the other kinds, in any order."""
    ups = draw(updates(max_n=8))
    others = draw(st.lists(st.one_of(
        st.builds(lambda o: ("event", ChoiceEvent(0, output=o)), outputs()),
        st.builds(lambda m: ("event", ChoiceEvent(1, error=m)), st.text(max_size=5)),
        st.builds(lambda ids: ("admitted", ids), st.lists(st.integers(-1, 2**40), max_size=4)),
        st.builds(lambda m: ("rejected", InvalidRequestError(m)), st.text(max_size=5))), max_size=4))
    entries = [(draw(st.integers(0, 2**40)), "event", ChoiceEvent(draw(st.integers(0, 9)), u)) for u in ups]
    for kind, payload in others:
        entries.insert(draw(st.integers(0, len(entries))), (draw(st.integers(0, 99)), kind, payload))
    return entries


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_any_step_round_trips_in_order(entries):
    assert same(watched(ipc.decode_entries, ipc.encode_entries(entries)), entries)


def test_a_decode_step_travels_as_columns():
    """Every entry an update alone: no per-entry record in ``others``."""
    entries = [(i, "event", ChoiceEvent(0, RequestUpdate(i, (1234,), " word", False, None))) for i in range(256)]
    mtype, fields = wire.decode(ipc.encode_entries(entries), 1 << 20)
    assert mtype is ipc.STEP and fields[3] == [] and fields[2][0] == 256
    assert ipc.decode_entries(ipc.encode_entries(entries)) == entries


def bad_steps(canary: str) -> list[tuple[bytes, str]]:
    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {canary}",)

    ok = ipc.encode_entries([(1, "event", ChoiceEvent(0, UPDATE)), (2, "admitted", [3])])
    _, fields = wire.decode(ok, 1 << 20)
    at = lambda pos: wire.encode(ipc.STEP, *fields[:3], [[pos, 2, "admitted", b""]])  # noqa: E731
    return [
        (b"\xc1garbage", "undecodable"), (os.urandom(3), None), (msgpack.packb([127, 1]), "unknown type"),
        (wire.encode(ipc.ADD, 1, 0.0, [], []), "wrong role"),  # a type the engine sends no front-end
        (ok, "oversized"),  # (read with a limit below its size)
        (wire.encode(ipc.STEP, *fields[:2]), "malformed"), (at(3), "bad field"),  # position past the end
        (wire.encode(ipc.STEP, *fields[:3], [[1, 2, "admitted", b""], [1, 2, "admitted", b""]]), "bad field"),
        (wire.encode(ipc.STEP, *fields[:3], [[0, 2, "rejected", "pickle", "x"]]), "bad field"),  # unknown exception
        (wire.encode(ipc.STEP, b"\0" * 16, *fields[1:]), "bad field"),  # 2 sids for 1 update
        (wire.encode(ipc.STEP, *fields[:3], [[0, 2, "event", 0, pickle.dumps(Evil()), None, None]]), "malformed"),
        (pickle.dumps(Evil()), None), (pickle.dumps([(1, "event", Evil())]), None),
    ]


def test_a_bad_step_message_is_a_wire_error_and_runs_nothing(tmp_path):
    canary = tmp_path / "canary"
    for frame, reason in bad_steps(str(canary)):
        limit = 16 if reason == "oversized" else 1 << 20
        got = watched(ipc.decode_entries, frame, limit)
        assert got == reason if reason else got in ("undecodable", "malformed", "unknown type"), (frame, got)
    assert not canary.exists()


def test_a_submission_round_trips_sending_a_shared_prompt_once():
    shared, other = [1, 2, 3] * 50, [9]
    spec = StructuredOutputs(json={"type": "object"})
    params = [SamplingParams(temperature=0.5, num_tokens_to_generate=4, stop_words=("a", (1, 2))),
              SamplingParams(seed=3, logit_bias={5: -1.5}, structured_outputs=spec), SamplingParams()]
    choices = [Choice(shared, params[0]), Choice(shared, params[1]), Choice(other, params[2])]
    frame = ipc.encode_add(4, choices, 12.5)
    mtype, fields = watched(wire.decode, frame, 1 << 20)
    assert mtype is ipc.ADD and len(fields[2]) == 2  # two prompts for three choices
    sid, arrival, back = mtype.read(fields)
    assert (sid, arrival) == (4, 12.5) and [c.prompt_tokens for c in back] == [shared, shared, other]
    assert [c.params for c in back] == params
    assert back[1].params.structured_outputs == spec and back[1].params.logit_bias == {5: -1.5}


@pytest.mark.parametrize("fields", [
    [1, 0.0, [b"\0" * 7], [[0, {}]]],  # prompt bytes not a multiple of 8
    [1, 0.0, [b""], [[1, {}]]],  # a prompt index past the prompts
    [1, 0.0, [b""], []],  # no choice
    [1, 0.0, [b""], [[0, {"no_such_field": 1}]]],
    [1, 0.0, [b""], [[0, {"temperature": "hot"}]]],
    ["1", 0.0, [b""], [[0, {}]]],
])
def test_a_bad_submission_is_a_bad_field(fields):
    mtype, raw = wire.decode(wire.encode(ipc.ADD, *fields), 1 << 20)
    with pytest.raises(wire.WireError) as e:
        mtype.read(raw)
    assert e.value.reason == "bad field"


def test_the_front_ends_sockets_live_in_a_directory_only_this_user_enters():
    """Beside the handshake: only this user's processes may reach the sockets at all."""
    import stat

    from megatron_async.inference.communication.rendezvous import private_dir_ok

    ends = ipc.Endpoints.create()
    try:
        st_ = os.stat(ends.directory)
        assert stat.S_IMODE(st_.st_mode) == 0o700 and st_.st_uid == os.getuid() and private_dir_ok(ends.directory)
        for ep in (ends.bridge, ends.events(3)):
            assert ep.startswith("ipc://") and os.path.dirname(ep[len("ipc://"):]) == ends.directory
    finally:
        ends.remove()
    assert not os.path.exists(ends.directory)
