"""The engine -> front-end step message (serve/ipc.py): every kind of entry comes back equal and
in order; updates travel as flat tuples, smaller than the entries pickled as they are (what they
cost per step: python -m benchmarks ipc-encode)."""
import pickle

import pytest

pytest.importorskip("zmq")

from megatron_async.inference.request import InvalidRequestError, RequestOutput, RequestUpdate  # noqa: E402
from megatron_async.serve import ipc  # noqa: E402
from megatron_async.serve.engine_loop import ChoiceEvent  # noqa: E402


def test_step_entries_round_trip_in_order():
    update = RequestUpdate(7, (5, 6), " hi", False, None, (-0.5, -1.0), ({5: -0.5}, {6: -1.0}), (-2.0,), ({3: -2.0},))
    out = RequestOutput(7, [1, 2], [5, 6], " hi", "length", generated_log_probs=[-0.5, -1.0])
    entries = [(3, "admitted", [7, 8]), (3, "event", ChoiceEvent(1, update)), (3, "event", ChoiceEvent(1, output=out)),
               (4, "event", ChoiceEvent(0, error="engine step failed")), (5, "rejected", InvalidRequestError("too long")),
               (6, "admin", (409, {"error": {"message": "x"}})), (3, "event", ChoiceEvent(0, RequestUpdate(8, (), "", True, "stop")))]
    back = ipc.decode_entries(ipc.encode_entries(entries))
    assert [(s, k) for s, k, _ in back] == [(s, k) for s, k, _ in entries]
    for (_, kind, got), (_, _, want) in zip(back, entries):
        if kind == "rejected":
            assert type(got) is InvalidRequestError and str(got) == "too long"
        else:
            assert got == want
    assert type(back[1][2].update) is RequestUpdate


def test_a_step_of_256_updates_travels_flat():
    entries = [(i, "event", ChoiceEvent(0, RequestUpdate(i, (1234,), " word", False, None))) for i in range(256)]
    message = ipc.encode_entries(entries)
    assert len(message) < 0.7 * len(pickle.dumps(entries))  # flat tuples, not pickled NamedTuples
    assert ipc.decode_entries(message) == entries


def test_the_front_ends_sockets_live_in_a_directory_only_this_user_enters():
    """The front-end <-> engine messages are pickled: only this user's processes may reach them."""
    import os
    import stat

    from megatron_async.inference.communication.rendezvous import private_dir_ok

    ends = ipc.Endpoints.create()
    try:
        st = os.stat(ends.directory)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid() and private_dir_ok(ends.directory)
        for ep in (ends.bridge, ends.events(3)):
            assert ep.startswith("ipc://") and os.path.dirname(ep[len("ipc://"):]) == ends.directory
    finally:
        ends.remove()
    assert not os.path.exists(ends.directory)
