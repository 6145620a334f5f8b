"""A server with admin endpoints keeps serving while the transfer group waits for a trainer: with
/init_weight_transfer pending against a loopback port nobody serves, and with
/update_weights_from_distributed pending on a group whose trainer sends nothing, a completion
completes, /pause_generation and /resume_generation answer, and a second refit call is refused
naming the one in progress; then the waiting call answers 409 naming the address, the port and
the timeout."""
import functools
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from megatron_async.serve.process import ServerProcess  # noqa: E402
from tests.functional_tests.server_client import json_request  # noqa: E402
from megatron_async.weight_transfer import init_transfer_group  # noqa: E402
from megatron_async.weight_transfer.group import free_port  # noqa: E402

FLAGS = ["--default-model", "tiny", "--device", "cpu", "--max-requests", "4", "--num-kv-blocks", "64",
         "--enable-admin-endpoints"]
TIMEOUT_S = 3.0
"""The transfer group's timeout in these tests: long enough for the calls made while it waits
(~0.1 s on an idle CPU) and for a trainer's set-up; each waiting call lasts all of it."""


_post = functools.partial(json_request, timeout=120)


class _Call(threading.Thread):
    """A POST answered on its own thread (``answered`` is set with ``outcome``)."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body, self.outcome, self.answered = url, body, None, threading.Event()
        self.start()

    def run(self):
        self.outcome = _post(self.url, self.body)
        self.answered.set()


def _serves_while(srv, call: _Call, probe: str, body: dict, in_progress: str) -> None:
    """Once ``call`` waits in the engine (the ``probe`` refit call, a 400 before, is refused
    naming it): a completion completes, pause and resume answer, all before ``call`` answers."""
    deadline = time.monotonic() + 60
    while True:
        status, reply = _post(srv.url + probe, body)
        if status == 409:
            break
        assert status == 400 and time.monotonic() < deadline, (status, reply)  # the call has not reached the engine yet
    assert f"{in_progress} is in progress" in reply["error"]["message"], reply
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model=srv.model_name, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length"
    for path, body in (("/pause_generation", {"mode": "keep"}), ("/resume_generation", {})):
        status, reply = _post(srv.url + path, body)
        assert status == 200 and reply["suspended"] == [], reply  # (under TP a pause shows after the next step)
    assert not call.answered.is_set(), call.outcome  # all of it happened while the call waited


def test_a_pending_set_up_and_a_pending_update_leave_the_server_serving():
    with ServerProcess(FLAGS) as srv:
        port = free_port()
        where = f"127.0.0.1:{port}"
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "timeout_s": TIMEOUT_S}
        call = _Call(srv.url + "/init_weight_transfer", init)
        _serves_while(srv, call, "/update_weights_from_distributed", {"manifest": {}},  # (400: no group)
                      f"a transfer group set-up to {where}")
        assert call.answered.wait(60)
        status, reply = call.outcome
        assert status == 409 and reply["error"]["code"] == 409, reply
        assert f"at {where} was not set up" in reply["error"]["message"]
        assert f"timeout {TIMEOUT_S:g} s" in reply["error"]["message"]

        trainer = []  # joins the group, then sends nothing
        joined = threading.Thread(target=lambda: trainer.append(init_transfer_group("127.0.0.1", port, 0, 2, "gloo",
                                                                                    timeout_s=60)))
        joined.start()
        try:
            assert _post(srv.url + "/init_weight_transfer", init) == (
                200, {"paused": False, "suspended": [], "weight_version": 0})
            joined.join(60)
            call = _Call(srv.url + "/update_weights_from_distributed", {"manifest": {}})
            _serves_while(srv, call, "/init_weight_transfer", init,  # (400: a group is set up)
                          f"a weight update from the transfer group at {where}")
            assert call.answered.wait(60)
            status, reply = call.outcome
            assert status == 409, reply
            assert f"at {where} within its timeout of {TIMEOUT_S:g} s" in reply["error"]["message"]
            status, reply = _post(srv.url + "/update_weights_from_distributed", {"manifest": {}})
            assert status == 400 and "no weight transfer group" in reply["error"]["message"]  # it was closed
        finally:
            joined.join(60)
            for group in trainer:
                group.close()
