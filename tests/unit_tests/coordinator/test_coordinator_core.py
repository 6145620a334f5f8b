"""The coordinator's logic without sockets: routing and hand-back, an engine's death (requests
that produced nothing are routed again, the others end with "error" and their partial output,
each exactly once), a client's departure (its requests aborted on their engines), drain and
leave, late engines, control operations collated, stale client keys."""
from __future__ import annotations

import pytest

from megatron_async.config import DpRouting
from megatron_async.coordinator.core import CoordinatorCore
from megatron_async.coordinator.engines import EngineInfo, RegistrationError
from megatron_async.inference.contexts.kv_block_allocator import prefix_digests
from megatron_async.inference.dp_routing import routing_keys
from megatron_async.inference.request import RequestOutput, RequestUpdate


class Outbox:
    def __init__(self):
        self.engine: list[tuple] = []
        self.client: list[tuple] = []

    def to_engine(self, slot, kind, *fields):
        self.engine.append((slot.index, kind, *fields))

    def to_client(self, client, kind, *fields):
        self.client.append((client, kind, *fields))

    def take(self):
        e, c, self.engine, self.client = self.engine, self.client, [], []
        return e, c


def info(name="e", max_requests=4, block_size=4, key=b"m", caching=True):
    return EngineInfo(name, max_requests, 1000, block_size, key, caching)


def setup(num_engines=2, policy=DpRouting.LONGEST_PREFIX, **kw):
    box = Outbox()
    core = CoordinatorCore(box, policy, **kw)
    slots = [core.engine_registered(f"peer{i}", info(f"e{i}")) for i in range(num_engines)]
    core.client_joined("c")
    box.take()
    return core, box, slots


def submits(msgs):
    """(engine index, rid) of each submit."""
    return [(m[0], m[2]) for m in msgs if m[1] == "route"]


def output(rid, tokens, reason="length"):
    return RequestOutput(rid, [], list(tokens), None, reason)


def finished_of(msgs):
    return [(o.request_id, o.finish_reason, tuple(o.generated_tokens), o.error) for m in msgs if m[1] == "finished"
            for o in m[2]]


def test_requests_go_by_prefix_and_come_back_with_the_clients_ids():
    core, box, (e0, e1) = setup()
    prompt = list(range(20))
    core.submit("c", 100, prompt, ["sp"], stream=True)
    core.submit("c", 101, list(range(50, 70)), ["sp"], stream=False)
    (sent, _) = box.take()
    assert submits(sent) == [(0, 0), (1, 1)]  # load spreads the two prompts
    core.submit("c", 102, prompt + [7, 7, 7, 7], ["sp"], stream=False)  # the first prompt's continuation
    assert submits(box.take()[0]) == [(0, 2)]
    core.engine_outputs(e0, 3, [RequestUpdate(0, (5, 6), "ab", False, None)], [])
    core.engine_outputs(e1, 2, [RequestUpdate(1, (9,), None, False, None)], [])  # not streamed: kept here only
    _, told = box.take()
    assert told == [("c", "stream", [RequestUpdate(100, (5, 6), "ab", False, None)])]
    core.engine_outputs(e0, 3, [], [output(0, (5, 6, 7))])
    assert finished_of(box.take()[1]) == [(100, "length", (5, 6, 7), None)]
    assert e0.pending == 1 and len(core.requests) == 2


def test_a_dead_engines_requests_are_rerouted_or_end_with_their_partial_output_exactly_once():
    core, box, (e0, e1) = setup()
    for i in range(4):
        core.submit("c", i, [i] * 9, ["sp"], stream=False)
    assert submits(box.take()[0]) == [(0, 0), (1, 1), (0, 2), (1, 3)]  # nothing cached: by load
    core.engine_outputs(e0, 4, [RequestUpdate(0, (11, 12), None, False, None)], [])
    core.engine_lost(e0)
    sent, told = box.take()
    assert finished_of(told) == [(0, "error", (11, 12), "engine 0 (e0) died while this request ran")]
    assert submits(sent) == [(1, 2)]  # rid 2 had produced nothing: routed again, same id
    assert core.counts["rerouted"] == 1 and core.counts["failed_by_death"] == 1
    core.engine_outputs(e0, 4, [], [output(0, (11, 12, 13)), output(2, (1,))])  # late frames of the dead engine
    assert box.take() == ([], [])
    core.engine_outputs(e1, 9, [], [output(2, (4,))])
    assert finished_of(box.take()[1]) == [(2, "length", (4,), None)]
    core.engine_lost(e1)  # the last engine: what is left waits for one
    assert finished_of(box.take()[1]) == [] and len(core.requests.unrouted) == 2
    e2 = core.engine_registered("peer2", info("e2"))
    assert sorted(rid for _, rid in submits(box.take()[0])) == [1, 3] and e2.pending == 2


def test_a_client_that_leaves_has_its_requests_aborted_and_hears_nothing_more():
    core, box, (e0, e1) = setup()
    core.submit("c", 1, [1] * 9, ["sp"], stream=True)
    core.client_joined("d")
    core.submit("d", 1, [2] * 9, ["sp"], stream=True)
    box.take()
    core.client_lost("c")
    sent, _ = box.take()
    assert [(m[0], m[1], m[2]) for m in sent] == [(0, "abort", 0)]
    core.engine_outputs(e0, 2, [RequestUpdate(0, (3,), None, True, "abort")], [output(0, (3,), "abort")])
    core.engine_outputs(e1, 2, [], [output(1, (4,))])
    _, told = box.take()
    assert [m[0] for m in told] == ["d"] and len(core.requests) == 0 and e0.pending == 0


def test_drain_routes_nothing_more_and_answers_once_the_engine_left():
    core, box, (e0, e1) = setup()
    core.submit("c", 1, [1] * 9, ["sp"], stream=False)
    core.drain("c", 77, 0)
    sent, _ = box.take()
    assert sent[-1][:2] == (0, "drain")
    core.submit("c", 2, [1] * 9, ["sp"], stream=False)
    assert submits(box.take()[0]) == [(1, 1)]
    core.engine_outputs(e0, 1, [], [output(0, (1,))])
    core.engine_left(e0)
    _, told = box.take()
    assert told[-1] == ("c", "control_done", 77, 200, {"index": 0, "left": True, "died": False})
    core.drain("c", 78, 0)
    assert box.take()[1][-1][3] == 404


def test_controls_are_collated_and_a_late_engine_is_told_the_pause_and_epoch():
    core, box, (e0, e1) = setup()
    core.control("c", 5, "pause_generation", {"mode": "keep"})
    core.control("c", 6, "set_generation_epoch", {"epoch": 3})
    sent, _ = box.take()
    ids = {m[3]: m[2] for m in sent if m[0] == 0}
    core.engine_control_done(e0, ids["pause_generation"], 200, {"paused": True})
    assert box.take()[1] == []
    core.engine_control_done(e1, ids["pause_generation"], 409, {"error": "x"})
    _, told = box.take()
    assert told == [("c", "control_done", 5, 409, {"engines": {"0": {"paused": True}, "1": {"error": "x"}}})]
    core.engine_lost(e1)  # the epoch waited for it too: answered without it
    core.engine_control_done(e0, ids["set_generation_epoch"], 200, {})
    assert box.take()[1][-1][:4] == ("c", "control_done", 6, 200)
    e2 = core.engine_registered("peer2", info("e2"))
    sent, _ = box.take()
    assert [(m[0], m[3], m[4]) for m in sent] == [(2, "set_generation_epoch", {"epoch": 3}),
                                                  (2, "pause_generation", {"mode": "keep"})]
    assert e2.index == 2
    core.control("c", 7, "no_such_op", {})
    assert box.take()[1][-1][3] == 400


def test_digests_from_a_stale_epoch_are_recomputed_and_new_weights_reset_the_view():
    core, box, (e0, e1) = setup()
    prompt = list(range(21))
    digests = b"".join(prefix_digests(prompt, 4, b"m"))  # as the client hashes a token-id prompt
    keys = routing_keys(prompt, 4, b"m")
    core.submit("c", 1, prompt, ["sp"], stream=False, digests=digests, key_epoch=core.engines.key_epoch)
    assert core.counts["hashed_here"] == 0 and core.view.depths(keys, 0b11) == {0: 5}
    to_engines, _ = box.take()
    assert [m[7] for m in to_engines if m[1] == "route"] == [digests]  # the engine reads them, not hashing again
    core.engine_outputs(e0, 1, [], [], hash_key=b"m\0weights:1")
    _, told = box.take()
    assert [m[1] for m in told] == ["info"] and told[0][2]["hash_key"] == b"m\0weights:1"
    assert core.view.holders == {} and not e1.affinity and e0.affinity
    core.submit("c", 2, prompt, ["sp"], stream=False, digests=digests, key_epoch=1)  # hashed with the old key
    assert core.counts["hashed_here"] == 1
    assert core.requests.get(1).keys == routing_keys(prompt, 4, b"m\0weights:1")
    fresh = b"".join(prefix_digests(prompt, 4, b"m\0weights:1"))
    assert [m[7] for m in box.take()[0] if m[1] == "route"] == [fresh]


def test_a_submitted_prompt_travels_on_packed_and_is_unpacked_where_read():
    """The listener reads a submission's token ids as they travelled (int64 bin, checked) and the
    route passes them on unconverted; hashing here and a dead engine's partial output read them."""
    from megatron_async.coordinator import messages
    from megatron_async.inference.communication import wire
    from megatron_async.inference.communication.wire import WireError

    core, box, _ = setup(policy=DpRouting.LOAD_BALANCED)
    prompt = list(range(1000, 1021))
    frame = messages.encode("submit", 5, prompt, [{"seed": 1}], False, None, -1)  # no digests: hashed here
    _, fields = messages.decode(frame)
    assert type(fields[1]) is bytes
    core.client_message("c", "submit", fields)
    (route,) = [m for m in box.take()[0] if m[1] == "route"]
    assert type(route[4]) is bytes and core.counts["hashed_here"] == 1
    _, routed = messages.decode(messages.encode(*route[1:]))  # as the engine reads it
    assert routed[2] == prompt and routed[5] == b"".join(prefix_digests(prompt, 4, b"m"))
    slot = core.engines.slots[route[0]]
    core.engine_outputs(slot, 1, [RequestUpdate(route[2], (7,), None, False, None)], [])
    core.engine_lost(slot)  # it produced a token: its partial output ends it
    (out,) = [o for m in box.take()[1] if m[1] == "finished" for o in m[2]]
    assert out.prompt_tokens == prompt and out.generated_tokens == [7] and out.finish_reason == "error"
    with pytest.raises(WireError, match="prompt"):  # not whole int64s: dropped at reading
        messages.decode(wire.encode(messages.TYPES["submit"], 5, b"\1" * 7, [{"seed": 1}], False, None, -1))


def test_engines_of_another_block_size_are_refused_and_unrouted_requests_time_out():
    box = Outbox()
    core = CoordinatorCore(box, "scored", alpha=0.3, unrouted_timeout_s=5)
    core.client_joined("c")
    core.submit("c", 1, [1, 2, 3], ["sp"], stream=False)  # no engine yet: it waits
    core.tick(now=core.requests.get(0).queued_at + 6)
    assert finished_of(box.take()[1])[0][1] == "error"
    core.engine_registered("p", info(block_size=4))
    with pytest.raises(RegistrationError):
        core.engine_registered("q", info(block_size=8))
    with pytest.raises(ValueError):
        CoordinatorCore(box, "scored", alpha=1.5)


def test_requests_without_a_seed_get_one_from_the_coordinator():
    core, box, _ = setup(policy=DpRouting.LOAD_BALANCED)
    core.submit("c", 1, [1, 2, 3], [{"top_k": 5}, {"top_k": 5}, {"seed": 7}], stream=False)
    maps = [m[5] for m in box.take()[0] if m[1] == "route"]
    assert maps[0]["seed"] != maps[1]["seed"] and maps[2] == {"seed": 7} and maps[0]["top_k"] == 5
    again, box2, _ = setup(policy=DpRouting.LOAD_BALANCED)
    again.submit("c", 1, [1, 2, 3], [{"top_k": 5}, {"top_k": 5}, {"seed": 7}], stream=False)
    assert [m[5] for m in box2.take()[0] if m[1] == "route"] == maps  # the same arrivals draw the same seeds


def test_shutdown_stops_every_engine_then_answers():
    core, box, (e0, e1) = setup()
    core.shutdown("c", 9)
    sent, _ = box.take()
    assert {(m[0], m[3]) for m in sent} == {(0, "stop"), (1, "stop")}
    core.engine_left(e0)
    assert not core.done
    core.engine_lost(e1)
    assert core.done and box.take()[1][-1] == ("c", "control_done", 9, 200, {"stopped": True})


def test_the_coordinator_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, megatron_async.coordinator.core; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
