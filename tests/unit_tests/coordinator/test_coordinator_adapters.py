"""The coordinator's table of LoRA adapters without sockets: requests naming an adapter go only to
its holders (least loaded first), one no engine holds is refused alone, an unload stops routing to
its engines as it is sent and an engine that refuses gives the adapter back, clients hear the
union whenever it changes, the register message carries the adapters an engine starts with."""
from __future__ import annotations

from megatron_async.config import DpRouting
from megatron_async.coordinator import messages
from megatron_async.coordinator.core import CoordinatorCore
from megatron_async.coordinator.engines import EngineInfo
from tests.unit_tests.coordinator.test_coordinator_core import Outbox, submits


def setup(holds: list[tuple[str, ...]]):
    box = Outbox()
    core = CoordinatorCore(box, DpRouting.LOAD_BALANCED)
    slots = [core.engine_registered(f"peer{i}", EngineInfo(f"e{i}", 4, 1000, 4, b"m", True, loras=loras))
             for i, loras in enumerate(holds)]
    core.client_joined("c")
    box.take()
    return core, box, slots


def infos(msgs):
    return [m[2]["loras"] for m in msgs if m[1] == "info"]


def test_requests_go_to_the_least_loaded_holder():
    core, box, _ = setup([("a",), (), ("a", "b")])
    for rid in range(4):
        core.submit("c", rid, [1, 2, 3], [{"lora": "a"}], stream=False)
    core.submit("c", 10, [1, 2, 3], [{"lora": "b"}], stream=False)
    core.submit("c", 11, [1, 2, 3], [{}], stream=False)
    sent, told = box.take()
    assert submits(sent) == [(0, 0), (2, 1), (0, 2), (2, 3), (2, 4), (1, 5)]
    assert not told


def test_an_adapter_nobody_holds_is_refused_alone():
    core, box, _ = setup([("a",), ()])
    core.submit("c", 0, [1, 2, 3], [{"lora": "zzz"}, {"lora": "a"}, {}], stream=False)  # one prompt, three adapters
    sent, told = box.take()
    assert submits(sent) == [(0, 1), (1, 2)]
    (rejected,) = [m for m in told if m[1] == "rejected"]
    assert rejected[2] == 0 and "'zzz'" in rejected[3] and "['a']" in rejected[3]
    assert core.counts["no_adapter"] == 1 and len(core.requests.open) == 2


def test_requests_wait_while_no_engine_takes_requests():
    core, box, _ = setup([])
    core.submit("c", 0, [1, 2, 3], [{"lora": "a"}], stream=False)
    assert len(core.requests.unrouted) == 1  # not refused: no engine has said what it holds yet
    core.engine_registered("late", EngineInfo("late", 4, 1000, 4, b"m", True, loras=("a",)))
    assert submits(box.take()[0]) == [(0, 0)]


def test_load_and_unload_follow_the_engines_answers():
    core, box, (e0, e1) = setup([(), ()])
    core.control("c", 7, "load_lora_adapter", {"lora_name": "a", "lora_path": "/p", "engines": [1]})
    sent, _ = box.take()
    assert [(m[0], m[3], m[4]) for m in sent] == [(1, "load_lora_adapter", {"lora_name": "a", "lora_path": "/p"})]
    core.engine_control_done(e1, sent[0][2], 200, {"loras": ["a"]})
    _, told = box.take()
    assert infos(told) == [["a"]] and told[-1][1] == "control_done"  # the table first, then the answer
    core.control("c", 8, "unload_lora_adapter", {"lora_name": "a"})  # its holders only
    sent, told = box.take()
    assert [m[0] for m in sent] == [1] and infos(told) == [[]]
    core.submit("c", 0, [1], [{"lora": "a"}], stream=False)  # while it unloads: not routed there
    assert [m[1] for m in box.take()[1]] == ["rejected"]
    core.engine_control_done(e1, sent[0][2], 409, {"error": {"message": "in use"}, "loras": ["a"]})
    _, told = box.take()
    assert infos(told) == [["a"]] and told[-1][3] == 409  # refused: it holds it again
    assert e1.loras == {"a"} and e0.loras == set()


def test_bad_engine_lists_are_refused_before_anything_runs():
    core, box, _ = setup([("a",), ()])
    for engines, status in (([5], 404), ([], 400), (["0"], 400)):
        core.control("c", 1, "load_lora_adapter", {"lora_name": "b", "lora_path": "/p", "engines": engines})
        sent, told = box.take()
        assert not sent and told[-1][3] == status
    core.control("c", 2, "unload_lora_adapter", {"lora_name": "b"})
    sent, told = box.take()
    assert not sent and told[-1][3] == 404 and "no engine holds" in told[-1][4]["error"]


def test_a_dead_engines_adapters_leave_the_union():
    core, box, (e0, e1) = setup([("a",), ("b",)])
    assert core.info()["loras"] == ["a", "b"]
    core.engine_lost(e1)
    assert infos(box.take()[1]) == [["a"]]


def test_register_carries_the_adapters():
    info = EngineInfo("e", 4, 100, 8, b"k", True, loras=("x", "y"))
    name, fields = messages.decode(messages.encode("register", info))
    assert name == "register" and fields[0] == info


def test_a_hand_off_goes_to_a_decode_engine_that_holds_the_adapter():
    box = Outbox()
    core = CoordinatorCore(box, DpRouting.LOAD_BALANCED)
    roles = (("prefill", ("a",)), ("decode", ()), ("decode", ("a",)))
    p, d0, d1 = [core.engine_registered(f"peer{i}", EngineInfo(f"e{i}", 4, 1000, 4, b"m", True, role,
                                                               "127.0.0.1:1" if role == "decode" else "", "gloo", loras))
                 for i, (role, loras) in enumerate(roles)]
    core.client_joined("c")
    box.take()
    for rid in range(2):
        core.submit("c", rid, [1, 2, 3], [{"lora": "a"}], stream=False)
        core.handoffs.kv_ready(p, rid, 1, 0)
    placed = [(m[0], m[1]) for m in box.take()[0] if m[1] == "kv_import"]
    assert placed == [(d1.index, "kv_import")] * 2  # d0 has more room, but not the adapter
    core.engine_lost(d1)
    imports = [m for m in box.take()[0] if m[1] == "kv_import"]
    assert [m[0] for m in imports] == [p.index] * 2 and imports[0][13][0] == "local"  # its prefill engine decodes


def test_weight_operations_may_go_to_some_engines_and_pauses_to_all():
    core, box, _ = setup([(), (), ()])
    core.control("c", 1, "init_weight_transfer", {"rank_offset": 2, "engines": [1]})
    sent, _ = box.take()
    assert [(m[0], m[3], m[4]) for m in sent] == [(1, "init_weight_transfer", {"rank_offset": 2})]
    core.control("c", 2, "pause_generation", {"mode": "keep", "engines": [1]})
    sent, told = box.take()
    assert not sent and told[-1][3] == 400 and "every engine" in told[-1][4]["error"]
    assert core.pause_mode is None
