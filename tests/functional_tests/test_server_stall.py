"""Big prompts stall nobody: while the server refuses a 5 MB prompt (too long before tokenizing)
and tokenizes a 600 KB one (then refused as too long for the model), /health keeps answering
and a running stream keeps streaming."""
import http.client
import json
import threading
import time
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from megatron_async.serve.process import ServerProcess  # noqa: E402
from tests.helpers.chat_templates import save_chat_template  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402

# max_model_len 16,384: a 600 KB prompt is under the character bound and gets tokenized (seconds)
SERVER_FLAGS = ["--num-kv-blocks", "1100", "--block-size", "16", "--max-requests", "4",
                "--max-sequence-length", "16384"]
HEALTH_BOUND_S = 0.5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("served") / "tiny-chat",
                                with_tokenizer=True, vocab_size=512, max_position_embeddings=16384)
    save_chat_template(path)
    with ServerProcess(["--model", str(path), *SERVER_FLAGS]) as srv:
        srv.host_port = urlparse(srv.url).hostname, urlparse(srv.url).port
        yield srv


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*server.host_port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _stream_gaps(server, stop: threading.Event, gaps: list[float]) -> None:
    """Stream completions until ``stop``; the time between successive SSE chunks."""
    body = json.dumps({"prompt": "hi", "max_tokens": 400, "stream": True, "ignore_eos": True}).encode()
    while not stop.is_set():
        conn = http.client.HTTPConnection(*server.host_port, timeout=120)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r, last = conn.getresponse(), None
        for line in r:
            if line.startswith(b"data: "):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
            if stop.is_set():
                break
        conn.close()


def test_big_prompts_stall_neither_health_nor_streams(server):
    big = [("/v1/completions", {"prompt": "word " * 1_000_000}, "characters"),  # over the bound: untokenized
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 1_000_000}]}, "characters"),
           ("/v1/completions", {"prompt": "word " * 120_000}, "exceeds")]  # under it: tokenized off the loop
    stop, gaps, results = threading.Event(), [], []
    streamer = threading.Thread(target=_stream_gaps, args=(server, stop, gaps), daemon=True)
    streamer.start()
    while len(gaps) < 5:
        time.sleep(0.05)
    worker = threading.Thread(target=lambda: results.extend(_post(server, p, b) + (w,) for p, b, w in big))
    worker.start()
    health = []
    while worker.is_alive():
        conn = http.client.HTTPConnection(*server.host_port, timeout=30)
        t = time.perf_counter()
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        health.append(time.perf_counter() - t)
        conn.close()
        time.sleep(0.01)
    worker.join()
    during = len(gaps)
    stop.set()
    streamer.join(120)
    assert len(health) >= 3 and max(health) < HEALTH_BOUND_S, sorted(health)[-5:]
    assert during > 5 and max(gaps) < 2 * HEALTH_BOUND_S, sorted(gaps)[-5:]  # the stream kept streaming
    for status, body, word in results:
        assert status == 400 and word in body["error"]["message"], body
