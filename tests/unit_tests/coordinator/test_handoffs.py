"""The coordinator's side of the prefill / decode hand-off without sockets (disaggregation/
handoffs.py): new requests go to prefill engines, a transfer's messages in order, the decode
engine by load, a client's abort in transfer, a dead decode engine's transfers placed again, a
dead prefill engine's cancelled; each request ends exactly once. And the hand-off's messages
through the wire's checked readers."""
from __future__ import annotations

from megatron_async.config import DpRouting
from megatron_async.coordinator import messages
from megatron_async.coordinator.core import CoordinatorCore
from megatron_async.coordinator.engines import EngineInfo
from megatron_async.inference.request import RequestOutput, RequestUpdate
from tests.unit_tests.coordinator.test_coordinator_core import Outbox, finished_of


def info(name, role):
    return EngineInfo(name, 4, 1000, 4, b"m", True, role, "127.0.0.1:1" if role == "decode" else "", "gloo")


def setup(roles=("prefill", "decode")):
    box = Outbox()
    core = CoordinatorCore(box, DpRouting.LOAD_BALANCED)
    slots = [core.engine_registered(f"peer{i}", info(f"e{i}", role)) for i, role in enumerate(roles)]
    core.client_joined("c")
    box.take()
    return core, box, slots


def kinds(msgs):
    return [(m[0], m[1]) for m in msgs]


def first_token(core, slot, rid, token=7):
    core.engine_outputs(slot, 1, [RequestUpdate(rid, (token,), None, False, None)], [])


def hand_off(core, box, prefill, decode, rid=0, blocks=3):
    """Through every step of one transfer; returns the engine messages of each step."""
    core.handoffs.kv_ready(prefill, rid, blocks, 0)
    placed, _ = box.take()
    core.engine_message(decode, "kv_accepted", [rid, 0])
    sent, _ = box.take()
    core.engine_message(decode, "kv_imported", [rid, blocks])
    released, _ = box.take()
    return placed, sent, released


def test_a_request_goes_prefill_then_decode_and_ends_once():
    core, box, (p, d) = setup()
    core.submit("c", 5, [1, 2, 3, 4, 5], [{"top_k": 1}], stream=True)
    (msg,), _ = box.take()
    assert msg[:2] == (p.index, "prefill")
    first_token(core, p, 0)
    _, client = box.take()
    assert client[0][1] == "stream"
    placed, sent, released = hand_off(core, box, p, d)
    assert kinds(placed) == [(d.index, "kv_import")]
    imp = placed[0]
    assert imp[2] == 0 and imp[9] == [7] and imp[12] == 3  # rid, the first token, blocks
    key, address, rank, backend = imp[13]
    assert (address, rank, backend) == ("127.0.0.1:1", 1, "gloo")
    assert kinds(sent) == [(p.index, "kv_send")] and sent[0][3:] == ((key, address, 0, "gloo"), 0)
    assert kinds(released) == [(p.index, "kv_release")]
    assert (p.pending, d.pending) == (0, 1) and (p.kv_sent_blocks, d.kv_received_blocks) == (3, 3)
    described = {e["role"]: e for e in core.engines.describe()}
    assert described["decode"]["kv_received_blocks"] == 3 and described["prefill"]["kv_sent_blocks"] == 3
    core.engine_outputs(d, 1, [], [RequestOutput(0, [1, 2, 3, 4, 5], [7, 8], None, "length")])
    _, client = box.take()
    assert finished_of(client) == [(5, "length", (7, 8), None)]
    assert d.pending == 0 and not core.requests.open and not core.handoffs.transfers


def test_without_a_decode_engine_a_prefill_engine_serves_the_whole_request():
    core, box, (p,) = setup(("prefill",))
    core.submit("c", 0, [1, 2, 3], [{}], stream=False)
    (msg,), _ = box.take()
    assert msg[1] == "route"


def test_with_no_decode_engine_left_the_prefill_engine_decodes_its_transfers():
    core, box, (p, d) = setup()
    core.submit("c", 0, [1, 2, 3], [{}], stream=True)
    box.take()
    first_token(core, p, 0)
    core.handoffs.kv_ready(p, 0, 1, 0)
    core.engine_message(d, "kv_accepted", [0, 0])
    box.take()
    core.engine_lost(d)
    engine, client = box.take()
    assert kinds(engine) == [(p.index, "kv_import")] and engine[0][13] == ("local", "", 1, "local") and client == []
    core.engine_message(p, "kv_imported", [0, 0])
    engine, _ = box.take()
    assert kinds(engine) == [(p.index, "kv_release")] and core.requests.get(0).engine is p and p.pending == 1
    core.engine_outputs(p, 1, [], [RequestOutput(0, [1, 2, 3], [7, 8], None, "length")])
    _, client = box.take()
    assert finished_of(client) == [(0, "length", (7, 8), None)] and p.pending == 0


def test_the_decode_engine_with_more_free_slots_takes_the_transfer():
    core, box, (p, d0, d1) = setup(("prefill", "decode", "decode"))
    d0.pending = 2
    core.submit("c", 0, [1, 2, 3], [{}], stream=True)
    box.take()
    first_token(core, p, 0)
    core.handoffs.kv_ready(p, 0, 1, 0)
    engine, _ = box.take()
    assert kinds(engine) == [(d1.index, "kv_import")]


def test_the_decode_engine_that_caches_the_prefix_takes_the_transfer():
    from megatron_async.inference.contexts.kv_block_allocator import prefix_digests

    core, box, (p, d0, d1) = setup(("prefill", "decode", "decode"))
    prompt = list(range(1, 18))
    digests = b"".join(prefix_digests(prompt, 4, b"m"))
    for rid, decode in ((0, d1), (1, d0)):  # the first goes to d1 by hand; the second follows its prefix
        core.submit("c", rid, prompt + [50 + rid], [{}], stream=True, digests=digests, key_epoch=core.engines.key_epoch)
        box.take()
        first_token(core, p, rid)
        if rid == 0:
            d0.pending = 2  # (d1 the freer one)
        core.handoffs.kv_ready(p, rid, 5, 0)
        engine, _ = box.take()
        assert kinds(engine) == [(d1.index, "kv_import")]
        d0.pending = 0  # now d0 is freer, but d1 holds the prefix
    core.engine_message(d1, "kv_accepted", [1, 4])
    engine, _ = box.take()
    assert engine[0][1] == "kv_send" and engine[0][4] == 4 and core.counts["kv_cached_blocks"] == 4


def test_a_full_decode_side_keeps_the_transfer_waiting_until_room():  # (a decode engine is live: no fallback)
    core, box, (p, d) = setup()
    d.pending = d.max_requests
    core.submit("c", 0, [1, 2, 3], [{}], stream=True)
    box.take()
    first_token(core, p, 0)
    core.handoffs.kv_ready(p, 0, 1, 0)
    assert box.take()[0] == [] and core.handoffs.describe() == {"placing": 1}
    d.pending = 0
    core.tick()
    assert kinds(box.take()[0]) == [(d.index, "kv_import")]


def test_an_abort_in_transfer_ends_the_request_and_undoes_the_import():
    core, box, (p, d) = setup()
    core.submit("c", 3, [1, 2, 3], [{}], stream=True)
    box.take()
    first_token(core, p, 0)
    core.handoffs.kv_ready(p, 0, 2, 0)
    core.engine_message(d, "kv_accepted", [0, 0])
    box.take()
    core.abort("c", 3)
    _, client = box.take()
    assert finished_of(client) == [(3, "abort", (7,), None)]
    core.engine_message(d, "kv_imported", [0, 2])
    engine, client = box.take()
    assert sorted(kinds(engine)) == [(p.index, "kv_release"), (d.index, "abort")] and client == []
    core.engine_outputs(d, 1, [], [RequestOutput(0, [1, 2, 3], [7], None, "abort")])  # its end: nobody's
    assert box.take() == ([], []) and d.pending == 0 and p.pending == 0


def test_a_dead_decode_engine_transfer_goes_to_another():
    core, box, (p, d0, d1) = setup(("prefill", "decode", "decode"))
    core.submit("c", 0, [1, 2, 3], [{}], stream=True)
    box.take()
    first_token(core, p, 0)
    core.handoffs.kv_ready(p, 0, 2, 0)
    core.engine_message(d0, "kv_accepted", [0, 0])
    box.take()
    core.engine_lost(d0)
    engine, client = box.take()
    assert kinds(engine) == [(d1.index, "kv_import")] and client == []
    assert core.counts["kv_replaced"] == 1
    core.engine_message(d0, "kv_imported", [0, 2])  # (a dead engine's late word changes nothing)
    assert core.handoffs.transfers[0].decode is d1
    core.engine_message(d1, "kv_accepted", [0, 0])
    core.engine_message(d1, "kv_imported", [0, 2])
    engine, _ = box.take()
    assert (p.index, "kv_send") in kinds(engine) and (p.index, "kv_release") in kinds(engine)
    assert core.requests.get(0).engine is d1


def test_a_dead_prefill_engine_cancels_the_import_and_ends_the_request_once():
    core, box, (p, d) = setup()
    core.submit("c", 4, [1, 2, 3], [{}], stream=True)
    core.submit("c", 5, [4, 5, 6], [{}], stream=True)
    box.take()
    first_token(core, p, 0)
    core.handoffs.kv_ready(p, 0, 2, 0)
    box.take()
    core.engine_lost(p)  # request 4 (rid 0) in transfer; request 5 (rid 1) produced nothing: waits for an engine
    engine, client = box.take()
    assert kinds(engine) == [(d.index, "kv_cancel")] and d.pending == 0
    ends = finished_of(client)
    assert len(ends) == 1 and ends[0][:3] == (4, "error", (7,)) and "engine 0" in ends[0][3]
    assert core.requests.unrouted and not core.handoffs.transfers
    core.engine_message(d, "kv_failed", [0, "the group broke"])  # after the cancel: nothing more ends
    assert box.take() == ([], [])


def test_a_failed_transfer_ends_the_request_with_both_engines_named():
    core, box, (p, d) = setup()
    core.submit("c", 1, [1, 2, 3], [{}], stream=True)
    box.take()
    first_token(core, p, 0)
    core.handoffs.kv_ready(p, 0, 2, 0)
    (imported,), _ = box.take()
    core.engine_message(d, "kv_accepted", [0, 0])
    box.take()
    core.engine_message(d, "kv_failed", [0, "reset"])
    engine, client = box.take()
    assert kinds(engine) == [(p.index, "kv_release")]
    assert finished_of(client) == [(1, "error", (7,), "KV transfer from engine 0 to engine 1 failed: reset")]
    assert p.pending == 0 and d.pending == 0
    core.submit("c", 2, [1, 2, 3], [{}], stream=True)  # the pair's next transfer: a new key (the old one's
    box.take()                                         # connection was dropped, its store prefix spent)
    first_token(core, p, 1)
    placed, _, _ = hand_off(core, box, p, d, rid=1, blocks=2)
    assert placed[0][13][0] != imported[13][0] and placed[0][13][1:] == imported[13][1:]


def test_a_transfer_sent_for_after_its_pairs_key_changed_keeps_the_key_of_its_import():
    """Two imports on one key; the first one's connection fails, the pair gets a new key (a third
    import carries it); the second's kv_send still names the key its receive waits on, and its own
    failure on that old key leaves the pair's new key alone."""
    core, box, (p, d) = setup()
    imports = []
    for rid in range(3):
        if rid == 2:
            core.engine_message(d, "kv_failed", [0, "refused"])
            box.take()
        core.submit("c", rid, [1, 2, 3], [{}], stream=True)
        box.take()
        first_token(core, p, rid)
        core.handoffs.kv_ready(p, rid, 1, 0)
        (imp,), _ = box.take()
        imports.append(imp[13][0])
    old, new = imports[0], imports[2]
    assert imports[1] == old != new
    core.engine_message(d, "kv_accepted", [1, 0])
    (sent,), _ = box.take()
    assert sent[1] == "kv_send" and sent[3][0] == old
    core.engine_message(d, "kv_failed", [1, "refused"])
    box.take()
    core.engine_message(d, "kv_accepted", [2, 0])
    (sent,), _ = box.take()
    assert sent[3][0] == new and core.counts["kv_failed"] == 2


def test_the_hand_off_messages_travel_through_the_checked_readers():
    pair = ("kv-0-1-ab", "127.0.0.1:5", 1, "gloo")
    frames = {
        "prefill": (3, 1, [1, 2], {"top_k": 1}, True, b"", None),
        "kv_ready": (3, 2, 0),
        "kv_import": (3, 1, [1, 2], {"seed": 4}, False, b"", ("ipc:///x", 9), [7], [-0.5], 0, 2, pair),
        "kv_accepted": (3, 1), "kv_send": (3, pair, 1), "kv_imported": (3, 2), "kv_release": (3,), "kv_cancel": (3,),
        "kv_failed": (3, "reset"),
    }
    for name, fields in frames.items():
        got_name, got = messages.decode(messages.encode(name, *fields))
        assert got_name == name
        if name == "kv_import":
            assert got[7] == [7] and got[8] == [-0.5] and got[11] == pair and got[6] == ("ipc:///x", 9)
        elif name == "kv_send":
            assert got == [3, pair, 1]
    bad = messages.encode("kv_send", 3, ("k", "a:1", 1, "carrier-pigeon"), 0)
    try:
        messages.decode(bad)
    except Exception as e:  # noqa: BLE001
        assert type(e).__name__ == "WireError"
    else:
        raise AssertionError("an unknown backend was read")
    assert {"kv_ready", "kv_imported"} <= messages.ENGINE_SENDS and "kv_import" in messages.COORDINATOR_SENDS
