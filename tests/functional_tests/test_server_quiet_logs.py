"""Clients that break their own requests (the real server process, raw sockets on loopback): one
that closes mid-upload, sends a malformed or truncated chunked body, or a request line that is not
HTTP costs at most one INFO line each, never a traceback, an ERROR or a 500 written to a closed
socket; a body that stalls longer than --body-timeout-s gets a 408 and the connection closes. The
server serves normally afterwards."""
import json
import socket
import time
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from megatron_async.serve.process import ServerProcess  # noqa: E402

FLAGS = ["--default-model", "tiny", "--device", "cpu", "--max-requests", "4", "--num-kv-blocks", "64",
         "--body-timeout-s", "1", "--enable-admin-endpoints"]
HEAD = "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
BROKEN = {
    "closes mid-upload": HEAD + "Content-Length: 100\r\n\r\n{\"pro",
    "malformed chunk size": HEAD + "Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "truncated chunked body": HEAD + "Transfer-Encoding: chunked\r\n\r\n40\r\n{\"prompt\": ",
    "not HTTP": "\x16\x03\x01 hello {path}\r\n\r\n",
}


def raw(srv, data: bytes, read: bool) -> bytes:
    u = urlparse(srv.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(data)
        if not read:
            time.sleep(0.2)
            return b""
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_broken_requests_cost_one_info_line_each():
    with ServerProcess([*FLAGS, "--log-level", "info"]) as srv:
        before = len(srv.output().splitlines())
        for path in ("/v1/completions", "/update_weights"):
            for name, text in BROKEN.items():
                raw(srv, text.replace("{path}", path).encode(), read=False)
        time.sleep(1.5)  # anything logged late (a timeout, an error handler) shows up
        lines = srv.output().splitlines()[before:]
        answer = raw(srv, (HEAD.replace("{path}", "/v1/completions") + "Content-Length: 100\r\n\r\n{\"pro").encode(),
                     read=True)  # stays open: 408 after --body-timeout-s, then the server closes
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert answer.startswith(b"HTTP/1.1 408") and body["error"]["code"] == 408
        out = srv.output()
    assert len(lines) <= 2 * len(BROKEN), lines  # one at most per broken request
    assert all(line.startswith("INFO:") or " INFO " in line for line in lines), lines  # uvicorn's or ours
    assert "Traceback" not in out and " ERROR " not in out and " WARNING " not in out


def test_default_log_level_is_silent_and_the_server_serves_after():
    import openai

    with ServerProcess(FLAGS) as srv:
        before = srv.output()
        for name, text in BROKEN.items():
            raw(srv, text.replace("{path}", "/v1/completions").encode(), read=False)
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model=srv.model_name, prompt=[1, 2, 3], max_tokens=3, temperature=0.0)
        assert out.usage.completion_tokens == 3
        assert srv.output() == before
