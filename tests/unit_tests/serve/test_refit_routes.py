"""The refit admin routes through the ASGI app in process: bad bodies are 400s (never 5xx),
/abort_requests with no ids ends every running request, /update_weights_from_ipc takes a
shared-memory payload, and /init_weight_transfer + /update_weights_from_distributed take a
trainer's broadcast, while a body that is not even JSON still fails the trainer's send at once."""
import asyncio
import threading

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from megatron_async import LLM, SamplingParams  # noqa: E402
from megatron_async.cli.flags import inference_config_from_args  # noqa: E402
from megatron_async.serve.__main__ import build_parser, build_state  # noqa: E402
from megatron_async.serve.app import create_app  # noqa: E402
from megatron_async.serve.submission import Choice, Submission  # noqa: E402
from megatron_async.weight_transfer import TransferFailed, build_manifest, init_transfer_group, ipc, send  # noqa: E402
from tests.helpers.multiprocess import free_port  # noqa: E402
from tests.helpers.refit_engine import trainer_items  # noqa: E402
from tests.unit_tests.serve.test_admin_routes import post  # noqa: E402


def _server():
    args = build_parser().parse_args(["--default-model", "tiny", "--max-sequence-length", "64", "--num-kv-blocks",
                                      "64", "--max-requests", "4", "--max-tokens", "32", "--enable-admin-endpoints"])
    llm = LLM(default_model="tiny", inference_config=inference_config_from_args(args))
    state = build_state(llm, args)
    return llm, state, create_app(state)


def _items(llm):
    m = llm.model
    return trainer_items(m.hf_shapes(), 3, 2, m.megatron_dims(), m.spec.name)


BAD = [("/init_weight_transfer", {"master_port": 1, "rank_offset": 1, "world_size": 2}, "master_address"),
       ("/init_weight_transfer", {"master_address": "x", "master_port": 0, "rank_offset": 1, "world_size": 2}, "master_port"),
       ("/init_weight_transfer", {"master_address": "x", "master_port": 9, "rank_offset": -1, "world_size": 2}, "rank_offset"),
       ("/init_weight_transfer", {"master_address": "x", "master_port": 9, "rank_offset": 1, "world_size": 2,
                                  "backend": "mpi"}, "backend"),
       ("/init_weight_transfer", {"master_address": "x", "master_port": 9, "rank_offset": 5, "world_size": 2}, "outside"),
       ("/update_weights_from_ipc", {}, "handles"),
       ("/update_weights_from_ipc", {"handles": {"storages": [], "tensors": []}, "recompute_kv": 1}, "recompute_kv"),
       ("/update_weights_from_ipc", {"handles": {"storages": [{"kind": "x"}], "tensors": []}}, "storage"),
       ("/update_weights_from_ipc", {"handles": "{not json"}, "not valid JSON"),
       ("/update_weights_from_distributed", {"manifest": {}}, "no weight transfer group"),
       ("/abort_requests", {"request_ids": "all"}, "request_ids"),
       ("/destroy_weight_transfer", b"[1, 2]", "JSON object"),
       ("/destroy_weight_transfer", {"engines": "all"}, "engines must be"),
       ("/destroy_weight_transfer", {"engines": [True]}, "engines must be"),
       # engines names a coordinator's engines: a server with its own engine refuses it
       ("/destroy_weight_transfer", {"engines": [0]}, "coordinator"),
       ("/update_weights", {"path": "/", "engines": [0]}, "coordinator"),
       ("/update_weights_from_ipc", {"handles": {"storages": [], "tensors": []}, "engines": [0]}, "coordinator"),
       ("/init_weight_transfer", {"master_address": "x", "master_port": 9, "rank_offset": 1, "world_size": 2,
                                  "engines": [0]}, "coordinator"),
       ("/update_lora_from_ipc", {"lora_name": "a", "handles": {"storages": []}, "engines": [0]}, "coordinator"),
       ("/pause_generation", {"engines": [0]}, "unknown field")]


def test_bad_bodies_are_400s():
    _, state, app = _server()
    state.engine_loop.start()
    try:
        for path, body, message in BAD:
            status, reply = asyncio.run(post(app, path, body))
            assert status == 400 and message in reply["error"]["message"], (path, status, reply)
    finally:
        state.engine_loop.stop()


def test_abort_requests_without_ids_ends_every_running_request():
    llm, state, app = _server()
    loop = state.engine_loop
    loop.start()
    params = SamplingParams(top_k=1, num_tokens_to_generate=30, ignore_eos=True)
    try:
        async def main():
            subs = [Submission([Choice([3, 4, 5], params)], asyncio.get_running_loop()) for _ in range(2)]
            for sub in subs:
                loop.submit(sub)
                await sub.admitted
            status, body = await post(app, "/abort_requests", {})
            assert status == 200, body
            reasons = []
            for sub in subs:
                while True:
                    ev = await asyncio.wait_for(sub.events.get(), 30)
                    if ev.output is not None:
                        reasons.append(ev.output.finish_reason)
                        break
            return reasons

        assert asyncio.run(main()) == ["abort", "abort"]
    finally:
        loop.stop()


def test_ipc_and_distributed_updates_over_http():
    torch.multiprocessing.set_sharing_strategy("file_system")
    llm, state, app = _server()
    items = _items(llm)
    for _, t, _ in items:
        t.share_memory_()
    state.engine_loop.start()
    port = free_port()
    manifest = build_manifest(items, 64 << 10, version=9)
    sent = []

    def trainer():
        group = init_transfer_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=60)
        send(group, manifest, items)
        for _ in range(2):  # the engine's body is broken, then names engines: refused in the begin frame
            try:
                send(group, manifest, items)
            except TransferFailed as e:
                sent.append(str(e))

    try:
        status, body = asyncio.run(post(app, "/update_weights_from_ipc", {"handles": ipc.share(items), "version": 4}))
        assert status == 200 and body["weight_version"] == 4, body
        thread = threading.Thread(target=trainer)
        thread.start()
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
        assert asyncio.run(post(app, "/init_weight_transfer", init))[0] == 200
        status, body = asyncio.run(post(app, "/update_weights_from_distributed", {"manifest": manifest.to_json()}))
        assert status == 200 and body["weight_version"] == 9, body
        status, body = asyncio.run(post(app, "/update_weights_from_distributed", b"{broken"))
        assert status == 400 and "not valid JSON" in body["error"]["message"]
        status, body = asyncio.run(post(app, "/update_weights_from_distributed",
                                        {"manifest": manifest.to_json(), "engines": [0]}))
        assert status == 400 and "coordinator" in body["error"]["message"], body
        thread.join(30)
        assert len(sent) == 2 and all("refused before any bucket moved" in m for m in sent), sent
        assert llm.engine.weight_version == 9
        assert asyncio.run(post(app, "/destroy_weight_transfer", {}))[0] == 200
    finally:
        state.engine_loop.stop()


def test_a_coordinators_update_weights_by_transfer_method_reaches_the_engine():
    """A coordinator's refit operation (client.update_weights(method=...)) runs the engine's method."""
    from megatron_async.dp_engine.engine_ops import run_engine_op

    torch.multiprocessing.set_sharing_strategy("file_system")
    llm = LLM(default_model="tiny")
    items = _items(llm)
    for _, t, _ in items:
        t.share_memory_()
    args = {"handles": ipc.share(items), "version": 6}
    status, body = run_engine_op(llm.engine, "update_weights_from_ipc", args, llm.update_weights)
    assert status == 200 and body["weight_version"] == 6, body
    status, body = run_engine_op(llm.engine, "generate", {}, None)
    assert status == 400


def test_routes_hand_engines_to_a_coordinators_front_end():
    """Over a coordinator (the front-end's ``admin`` is a control operation: client_loop.py) the
    weight-update, transfer and adapter routes hand ``engines`` on as the client API does."""
    from fastapi import FastAPI

    from megatron_async.serve.admin_routes import add_admin_routes, add_lora_routes, add_refit_routes

    class Recording:
        def __init__(self):
            self.ops = []

        async def admin(self, op, args):
            self.ops.append((op, args))
            return 200, {"engines": {str(i): {} for i in args.get("engines", [0, 1])}}

    front, app = Recording(), FastAPI()
    add_admin_routes(app, front)
    add_refit_routes(app, front)
    add_lora_routes(app, front)
    init = {"master_address": "h", "master_port": 9, "rank_offset": 2, "world_size": 3}
    bodies = {"update_weights": {"path": "/"}, "init_weight_transfer": init, "destroy_weight_transfer": {},
              "update_weights_from_ipc": {"handles": "{}"}, "update_weights_from_distributed": {"manifest": {}},
              "update_lora_from_ipc": {"lora_name": "a", "handles": "{}"},
              "update_lora_from_distributed": {"lora_name": "a", "manifest": {}},
              "v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/"}, "v1/unload_lora_adapter": {"lora_name": "a"}}
    for route, body in bodies.items():
        status, reply = asyncio.run(post(app, "/" + route, {**body, "engines": [1]}))
        assert status == 200 and list(reply["engines"]) == ["1"], (route, reply)
        op, args = front.ops[-1]
        assert op == route.split("/")[-1] and args["engines"] == [1] and "body_error" not in args, (route, args)
    assert front.ops[1][1] == {**init, "backend": None, "timeout_s": None, "engines": [1]}
    status, reply = asyncio.run(post(app, "/update_weights", {"path": "/"}))
    assert status == 200 and "engines" not in front.ops[-1][1]  # every engine
    count = len(front.ops)
    status, reply = asyncio.run(post(app, "/update_weights", {"path": "/", "engines": []}))
    assert status == 400 and "engines must be" in reply["error"]["message"] and len(front.ops) == count
