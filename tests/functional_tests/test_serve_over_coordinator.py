"""The OpenAI server in its own process over the engines behind a coordinator
(``python -m megatron_async.serve --engine ADDR``): completions (whole and streamed) equal one
engine's tokens, a bad request is a 400, the admin routes pause and resume every engine (the refit routes those
their body's ``engines`` names), and a
short request sent behind a body of 250 prompts is not queued in an engine behind them."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from tests.helpers.coordinator_procs import ROOT, Cluster, _env, _wait_line

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 99], [300, 301, 302]]


@pytest.fixture(scope="module")
def url():
    c = Cluster("longest_prefix")
    server = None
    try:
        for i in range(2):
            c.start_engine(f"e{i}", "--prefix-caching", "--block-size", "4")
        for i in range(2):
            c.wait_engine(f"e{i}")
        server = subprocess.Popen([sys.executable, "-m", "megatron_async.serve", "--engine", c.address, "--default-model",
                                   "tiny", "--device", "cpu", "--port", "0", "--enable-admin-endpoints"],
                                  stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
        served = _wait_line(server, "megatron_async.serve: serving tiny on ", 120).split()[0]
        with open(f"/proc/{server.pid}/maps") as f:  # a coordinator's front-end runs no model: no torch
            assert "libtorch" not in f.read(), "serve --engine imported torch"
        yield served
    finally:
        if server is not None:
            server.kill()
            server.wait(10)
        c.close()


def post(url: str, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_completions_over_the_coordinator_equal_one_engines(url):
    ref = LLM(None, "cpu", "float32", InferenceConfig(block_size_tokens=4, num_kv_blocks=256))
    want = [o.generated_tokens for o in ref.generate(PROMPTS, SamplingParams(top_k=1, num_tokens_to_generate=6))]
    status, body = post(url, "/v1/completions", {"prompt": PROMPTS, "max_tokens": 6, "temperature": 0,
                                                 "return_token_ids": True})
    assert status == 200
    assert [c["token_ids"] for c in sorted(json.loads(body)["choices"], key=lambda c: c["index"])] == want
    status, body = post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
                                                 "stream": True, "return_token_ids": True})
    chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    assert status == 200 and sum((c["choices"][0].get("token_ids") or [] for c in chunks), []) == want[0]


def test_bad_requests_and_admin_routes(url):
    status, body = post(url, "/v1/completions", {"prompt": [5000], "max_tokens": 2})
    assert status == 400 and "outside the vocab" in body
    status, body = post(url, "/pause_generation", {"mode": "keep"})
    assert status == 200 and all(e["paused"] for e in json.loads(body)["engines"].values())
    status, body = post(url, "/resume_generation", {})
    assert status == 200 and not any(e["paused"] for e in json.loads(body)["engines"].values())
    assert urllib.request.urlopen(url + "/health", timeout=30).status == 200


def test_refit_routes_run_on_the_engines_named(url):
    """``engines`` in a refit route's body reaches the coordinator: only those engines run it."""
    status, body = post(url, "/destroy_weight_transfer", {"engines": [1]})
    assert status == 200 and list(json.loads(body)["engines"]) == ["1"], body
    status, body = post(url, "/destroy_weight_transfer", {})
    assert status == 200 and sorted(json.loads(body)["engines"]) == ["0", "1"], body
    status, body = post(url, "/update_weights_from_ipc", {"handles": "{not json", "engines": [0]})
    assert status == 400 and list(json.loads(body)["engines"]) == ["0"], body  # engine 0's own refusal
    status, body = post(url, "/destroy_weight_transfer", {"engines": [7]})
    assert status == 404 and "no live engine [7]" in body, body
    status, body = post(url, "/init_weight_transfer", {"master_address": "h", "master_port": 9, "rank_offset": 1,
                                                       "world_size": 2, "engines": "all"})
    assert status == 400 and "engines must be" in body, body


def metric(url: str, name: str, label: str = "") -> float:
    body = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith(name + "{") and label in line)


def test_a_short_request_is_not_queued_behind_a_huge_body(url):
    """The front-end keeps at most the engines' 128 places busy (120 for one body), so the short
    request starts at once and ends before the big body's first 16-token wave (0 of them ended
    here); without its fair queue the 250 prompts sat in the engines' queues, the short request
    behind about 60 of them on its engine, and it ended after 64 of them."""
    assert urllib.request.urlopen(url + "/health", timeout=30).status == 200  # the engines' places are read
    finished = ("megatron_async_request_success_total", 'finished_reason="length"')
    before, tokens, done = metric(url, *finished), metric(url, "megatron_async_generation_tokens_total"), {}
    big = {"prompt": [[5 + i % 200, 6, 7] for i in range(250)], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    thread = threading.Thread(target=lambda: done.setdefault("big", post(url, "/v1/completions", big)))
    thread.start()
    deadline = time.monotonic() + 60
    while metric(url, "megatron_async_generation_tokens_total") == tokens and time.monotonic() < deadline:
        time.sleep(0.02)  # until the big body runs
    status, _ = post(url, "/v1/completions", {"prompt": [300, 301, 302], "max_tokens": 2, "temperature": 0})
    behind = metric(url, *finished) - before - 1
    thread.join(120)
    assert status == 200 and done["big"][0] == 200
    assert behind < 16  # of the big body's 250 ended before the short request
