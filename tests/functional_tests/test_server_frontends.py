"""HTTP front-end processes (--api-server-count): two of them on one port answer many concurrent
streams, each exactly once, /metrics (asked of either) counts them all (and each front-end's) and
every KV block comes back; connections opened together split about evenly between them; admin
operations answer as in process; a front-end killed mid-stream has its requests aborted while
the other keeps serving; SIGTERM lets a stream in flight finish; a stranger on the
engine process's front-end socket (garbage, an unknown type, an oversized frame, a pickle, a
submission without the handshake, a wrong proof) is dropped and counted on /metrics and changes
nothing; and --api-server-count 0 (the event loop in the engine's process) still serves."""
import asyncio
import http.client
import json
import os
import pickle
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")
import zmq  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks.commands.frontend_split import connections  # noqa: E402
from benchmarks.server_load import LoadShape, run_load_test  # noqa: E402
from benchmarks.server_metrics import kv_leaked  # noqa: E402
from megatron_async.inference.communication import handshake, wire  # noqa: E402
from megatron_async.inference.request import SamplingParams  # noqa: E402
from megatron_async.serve import ipc  # noqa: E402
from megatron_async.serve.process import ServerProcess  # noqa: E402
from megatron_async.serve.submission import Choice  # noqa: E402
from tests.functional_tests.server_client import json_request  # noqa: E402

FLAGS = ["--default-model", "tiny", "--device", "cpu", "--max-requests", "16", "--num-kv-blocks", "128"]
ABORTED = ("megatron_async_request_success_total", "abort")


def metrics(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            label = next((s.labels[k] for k in ("finished_reason", "reason", "frontend") if k in s.labels), None)
            values[(s.name, label)] = s.value
    return values


def frontend_pids(server: ServerProcess) -> list[int]:
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        return [int(p) for p in f.read().split()]


def open_sockets(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except FileNotFoundError:  # closed since the listing (the process keeps serving)
            pass
    return count


def stream(url: str, prompt: list[int], max_tokens: int, result: dict) -> None:
    """One streamed completion over http.client; ``result``: tokens seen and how it ended."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "return_token_ids": True}
    result.update(tokens=0, end=None)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        for line in resp:
            if line.startswith(b"data: [DONE]"):
                result["end"] = "done"
                return
            if line.startswith(b"data: "):
                result["tokens"] += sum(len(c.get("token_ids") or []) for c in json.loads(line[6:])["choices"])
        result["end"] = "cut"
    except (OSError, http.client.HTTPException):
        result["end"] = "cut"
    finally:
        conn.close()


def wait_for(check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def post(url: str, path: str, body: bytes = b"{}") -> tuple[int, dict]:
    return json_request(url + path, body, timeout=30)


def test_two_frontends_serve_every_stream_once_and_survive_one_killed():
    with ServerProcess([*FLAGS, "--api-server-count", "2", "--enable-admin-endpoints"]) as srv:
        pids = frontend_pids(srv)
        assert len(pids) == 2
        with open(f"/proc/{pids[0]}/maps") as f:
            assert "libtorch" not in f.read()  # a front-end starts without importing torch
        shape = LoadShape(max_tokens=8, prompt_words=12, token_prompts=True)
        report = asyncio.run(run_load_test(srv.url, srv.model_name, clients=24, requests=72, work=shape))
        report.kv_leaked = kv_leaked(srv.url, settle_s=10)
        assert report.ok and report.completed == 72 and report.output_tokens == 72 * 8, report.format()
        m = metrics(srv.url)
        assert m[("megatron_async_request_success_total", "length")] == 72
        assert m[("megatron_async_generation_tokens_total", None)] == 72 * 8
        per_frontend = [m[("megatron_async_frontend_requests_total", str(i))] for i in range(2)]
        assert sum(per_frontend) == 72 and min(per_frontend) > 0, per_frontend

        # a listening socket per front-end: the kernel deals connections opened together about
        # evenly (32 +- 4 of 64 each; all of them dealt to one front-end fails)
        port = urlparse(srv.url).port
        held = [socket.socket() for _ in range(64)]
        for conn in held:  # all at once, as a load test's clients start
            conn.setblocking(False)
            conn.connect_ex(("127.0.0.1", port))
        try:
            split = wait_for(lambda: (lambda c: sum(c) == 64 and c)([connections(p, port) for p in pids]))
            assert split and min(split) >= 16, split
        finally:
            for conn in held:
                conn.close()

        # admin operations: bodies checked in the front-end, run on the engine thread, same answers
        assert post(srv.url, "/pause_generation", b'{"mode": "keep"}') == (
            200, {"paused": True, "suspended": [], "weight_version": 0})
        assert post(srv.url, "/resume_generation")[1]["paused"] is False
        for path, body, code in [("/pause_generation", b'{"mode": "stop"}', 400), ("/update_weights", b"{}", 400),
                                 ("/resume", b"{not json", 400), ("/suspend", b"{}", 409)]:
            status, answer = post(srv.url, path, body)
            assert status == code and answer["error"]["code"] == code, (path, answer)

        # long streams over both front-ends; the one holding more connections is killed
        before = {p: open_sockets(p) for p in pids}
        results = [{} for _ in range(8)]
        threads = [threading.Thread(target=stream, args=(srv.url, [1 + i, 2, 3], 200, r)) for i, r in enumerate(results)]
        for t in threads:
            t.start()
        assert wait_for(lambda: metrics(srv.url)[("megatron_async_num_requests_running", None)] == 8)
        victim = max(pids, key=lambda p: open_sockets(p) - before[p])
        os.kill(victim, signal.SIGKILL)
        for t in threads:
            t.join(120)
        cut = [r for r in results if r["end"] == "cut"]
        done = [r for r in results if r["end"] == "done"]
        assert cut and len(cut) + len(done) == 8, results
        assert all(r["tokens"] == 200 for r in done) and all(r["tokens"] < 200 for r in cut)
        # the engine ended the killed front-end's requests and freed their blocks
        assert wait_for(lambda: metrics(srv.url).get(ABORTED, 0) == len(cut)), metrics(srv.url)
        assert not kv_leaked(srv.url, settle_s=10)
        again = {}
        stream(srv.url, [9, 9, 9], 5, again)  # served by the front-end left
        assert again == {"tokens": 5, "end": "done"}
        with urllib.request.urlopen(f"{srv.url}/health", timeout=10) as r:
            assert r.status == 200
        # SIGTERM: the stream in flight still runs to its end, then every process exits
        late = {}
        thread = threading.Thread(target=stream, args=(srv.url, [4, 5, 6], 80, late))
        thread.start()
        assert wait_for(lambda: metrics(srv.url)[("megatron_async_num_requests_running", None)] == 1)
        srv.proc.send_signal(signal.SIGTERM)
        thread.join(60)
        assert late == {"tokens": 80, "end": "done"}
        assert srv.proc.wait(30) == 0
    assert "HTTP front-end" in srv.output() and "exited; aborting" in srv.output()


def test_api_server_count_0_serves_from_the_engine_process():
    with ServerProcess([*FLAGS, "--api-server-count", "0"]) as srv:
        assert frontend_pids(srv) == []
        result = {}
        stream(srv.url, [1, 2, 3], 6, result)
        assert result == {"tokens": 6, "end": "done"}
        assert metrics(srv.url)[("megatron_async_generation_tokens_total", None)] == 6


def bridge_address(pid: int) -> str:
    """The ipc:// address of the front-ends' socket that process ``pid`` (the engine's) listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    with open("/proc/net/unix") as f:
        for line in f.read().splitlines()[1:]:
            cols = line.split()
            if len(cols) >= 8 and cols[6] in inodes and cols[7].endswith("/bridge"):
                return f"ipc://{cols[7]}"
    raise AssertionError("no front-end socket found")


def test_a_stranger_on_the_engine_side_socket_is_dropped_counted_and_changes_nothing(tmp_path):
    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {canary}",)

    def add(prompt) -> bytes:
        return ipc.encode_add(0, [Choice(list(prompt), SamplingParams(num_tokens_to_generate=50))], 0.0)

    with ServerProcess([*FLAGS, "--api-server-count", "1"]) as srv:
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.connect(bridge_address(srv.proc.pid))
            for frame in (os.urandom(64), b"\x92\x7f\x01", pickle.dumps(Evil()), add(range(200)), add([1, 2, 3])):
                sock.send(frame)  # garbage, an unknown type, a pickle, oversized (for a handshake), no handshake
            sock.send(wire.encode(handshake.HELLO, handshake.VERSION, ipc.ROLE, "0", os.urandom(32)))
            assert sock.poll(10_000)  # the challenge: answered with a proof made without the secret
            sock.send(wire.encode(handshake.PROOF, os.urandom(32)))
            sock.close(0)
        finally:
            ctx.term()
        result = {}
        stream(srv.url, [1, 2, 3], 6, result)
        assert result == {"tokens": 6, "end": "done"}
        dropped = "megatron_async_frontend_ipc_dropped_frames_total"
        assert wait_for(lambda: metrics(srv.url).get((dropped, "auth failed")) == 1)
        m = metrics(srv.url)
        assert {r: m.get((dropped, r)) for r in ("malformed", "oversized", "unauthenticated")} == {
            "malformed": 3, "oversized": 1, "unauthenticated": 1}
        assert m[("megatron_async_request_success_total", "length")] == 1  # only the real request ran
        assert m[("megatron_async_generation_tokens_total", None)] == 6
    assert not canary.exists()
