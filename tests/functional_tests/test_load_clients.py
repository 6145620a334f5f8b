"""The raw load-test client (httpx2 + json.loads per SSE line) against the real server on a
tiny checkpoint: nothing lost, token counts right, disconnects abort and free every KV block,
and the same token ids as the openai client for the same greedy requests."""
import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx2")

from benchmarks.server_load import (LoadShape, StreamRecord, _collect,  # noqa: E402
                                              run_load_test, take_chunk)
from benchmarks.server_metrics import kv_leaked  # noqa: E402
from megatron_async.serve.process import ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--default-model", "tiny", "--device", "cpu", "--max-requests", "16"]) as srv:
        yield srv


def aborted(server) -> float:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "megatron_async_request_success_total" and s.labels.get("finished_reason") == "abort")


def test_raw_client_loses_nothing_and_disconnects_abort_and_free_every_block(server):
    shape = LoadShape(max_tokens=30, prompt_words=12, token_prompts=True, disconnect_fraction=0.2)
    before = aborted(server)
    report = asyncio.run(run_load_test(server.url, None, clients=12, requests=40, work=shape, client="raw"))
    report.kv_leaked = kv_leaked(server.url, settle_s=10)
    left = sum(shape.disconnects(i) for i in range(40))
    assert left == 8 and report.disconnected == left, report.format()
    assert report.ok and report.completed == 40 - left and report.output_tokens == (40 - left) * 30, report.format()
    assert aborted(server) - before == left  # each closed stream aborted its request on the server
    assert report.client == "raw" and report.chunks >= report.output_tokens and report.client_cpu_us_per_chunk > 0


def test_raw_and_openai_clients_see_the_same_tokens(server):
    shape = LoadShape(max_tokens=7, prompt_words=10, token_prompts=True)

    def tokens(client: str) -> dict[int, list[int]]:
        records, *_ = asyncio.run(_collect(server.url, None, list(range(12)), 6, shape, 60.0, client))
        assert all(len(recs) == 1 and recs[0].error is None and recs[0].finish_reason for recs in records.values())
        return {i: recs[0].token_ids for i, recs in records.items()}

    raw = tokens("raw")
    assert raw == tokens("openai") and all(len(ids) == 7 for ids in raw.values())
    assert len({tuple(ids) for ids in raw.values()}) > 1  # distinct prompts, distinct answers


def test_take_chunk_rejects_a_second_response_or_final_chunk():
    rec = StreamRecord(0)
    take_chunk(rec, 0.1, "a", [([5], None)])
    take_chunk(rec, 0.3, "a", [([6, 7], "length")])
    assert rec.token_ids == [5, 6, 7] and rec.ttft_s == 0.1 and rec.gaps_s == pytest.approx([0.1, 0.1])
    with pytest.raises(RuntimeError, match="two final chunks"):
        take_chunk(rec, 0.4, "a", [([], "stop")])
    with pytest.raises(RuntimeError, match="two responses"):
        take_chunk(rec, 0.5, "b", [([8], None)])


def test_load_test_script_takes_the_raw_client(server, tmp_path):
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "load-test", "--url", server.url, "--client", "raw",
         "--clients", "4", "--requests", "8", "--max-tokens", "5", "--token-prompts", "--output-path", str(out)],
        capture_output=True, text=True, timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["client"] == "raw" and report["completed"] == 8 and report["output_tokens"] == 40
    assert report["client_cpu_us_per_chunk"] > 0 and "us CPU per chunk" in proc.stdout
