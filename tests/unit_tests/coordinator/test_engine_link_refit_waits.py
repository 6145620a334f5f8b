"""An engine serving a coordinator (dp_engine/link.py) keeps stepping while a transfer group's
set-up waits for ranks that never join (a loopback port nobody serves): requests routed meanwhile
finish, a second set-up is refused naming the one in progress, and the set-up answers 409 naming
the address, the port and the timeout once its timeout ran out."""
from __future__ import annotations

import time

from megatron_async import SamplingParams
from megatron_async.dp_engine.link import EngineLink
from megatron_async.weight_transfer import free_port
from tests.unit_tests.coordinator.test_engine_link import Pipe, tiny

GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=4, ignore_eos=True)


def test_a_pending_set_up_answers_409_after_its_timeout_while_requests_finish():
    llm = tiny()
    pipe = Pipe()
    link = EngineLink(llm.engine, pipe, llm.config.max_requests, "e0", llm.update_weights)
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "timeout_s": 1.0}
    pipe.inbox += [("control", (1, "init_weight_transfer", init)), ("control", (2, "init_weight_transfer", init))]
    finished, rid, answers, deadline = [], 0, {}, time.monotonic() + 60
    while 1 not in answers:
        assert time.monotonic() < deadline, "the set-up never answered"
        if not link.busy():
            rid += 1
            pipe.inbox.append(("route", (rid, rid, [3, 4, 5], GREEDY, False)))
        assert link.turn(wait=False) is None
        for kind, fields in pipe.sent:
            if kind == "outputs":
                finished += [o.request_id for o in fields[2]]
            elif kind == "control_done":
                answers[fields[0]] = fields[1:]
                if fields[0] == 1:
                    finished_before = list(finished)
        pipe.sent.clear()
    assert finished_before, "no request finished while the set-up waited"
    status, body = answers[2]
    assert status == 409 and f"a transfer group set-up to 127.0.0.1:{port} is in progress" in body["error"]["message"]
    status, body = answers[1]
    assert status == 409, body
    assert f"at 127.0.0.1:{port} was not set up" in body["error"]["message"] and "timeout 1 s" in body["error"]["message"]
    assert llm.engine.weights.group is None and llm.engine.weights.pending is None
