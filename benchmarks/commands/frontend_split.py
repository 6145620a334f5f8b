"""How evenly the HTTP front-end processes (``--api-server-count N``) share the connections and
requests of many keep-alive clients, with a listening socket per front-end (SO_REUSEPORT, the
server's default on Linux) and with one socket that all of them accept from (the fallback).

An engine stand-in (benchmarks/commands/_server_stub.py: each step sleeps --stub-step-ms, so the
engine is no bottleneck) is served exactly as ``python -m megatron_async.serve`` serves (serve/
launch.py) on a loopback port; --clients streaming clients in --client-processes processes (the
raw client: one keep-alive connection per client) start together and send --requests-per-client
requests each. Per front-end: the connections it held (from /proc, the most seen together during
the run) and the requests it handed to the engine (``/metrics``:
megatron_async_frontend_requests_total). Every cell runs both ways in turn, --repeats times; the
table gives the busiest front-end's share (median and worst run) and the median max / min.

    python -m benchmarks frontend-split                      # 2 and 3 front-ends, 64 and 256 clients
    python -m benchmarks frontend-split --api-server-count 2 --clients 256 --repeats 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.commands._server_stub import StubEngine  # noqa: E402
from benchmarks.server_load import LoadShape, run_load_test_processes  # noqa: E402

MODES = {"per front-end (SO_REUSEPORT)": True, "one shared socket": False}
"""Table row name -> ``Serving(share_port=...)``."""


def connections(pid: int, port: int) -> int:
    """Established TCP connections on local ``port`` that process ``pid`` holds (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()  # local address (hex ip:port), ..., state (01: established), ..., inode
                count += int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "01" and cols[9] in inodes
    return count


def frontend_requests(url: str) -> list[int]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    counts = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "megatron_async_frontend_requests_total":
                counts[int(s.labels["frontend"])] = int(s.value)
    return [counts[i] for i in sorted(counts)]


def one_run(count: int, share_port: bool, args) -> tuple[list[int], list[int]]:
    """(connections, requests) per front-end of one server under one load."""
    from megatron_async.serve.app import ServerState
    from megatron_async.serve.engine_loop import EngineLoop
    from megatron_async.serve.launch import Serving
    from megatron_async.serve.metrics import ServerMetrics

    engine = StubEngine(args.clients, args.stub_step_ms / 1000)
    state = ServerState(EngineLoop(engine, ServerMetrics("stub"), share=False), "stub", None, None,
                        max_model_len=1 << 20, max_requests=engine.max_requests, max_request_bytes=1 << 25)
    serving = Serving(state, "127.0.0.1", 0, count, share_port=share_port)
    try:
        serving.start()
        port = int(serving.url.rsplit(":", 1)[1])
        peak, done = [0] * count, threading.Event()

        def sample() -> None:
            while not done.wait(0.05):
                held = [connections(p.pid, port) for p in serving.frontends]
                if sum(held) > sum(peak):
                    peak[:] = held

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        report = run_load_test_processes(serving.url, "stub", args.client_processes, args.clients,
                                         args.clients * args.requests_per_client,
                                         LoadShape(args.max_tokens, 8, token_prompts=True), client="raw")
        done.set()
        sampler.join()
        if not report.ok:
            raise RuntimeError(report.format())
        return peak, frontend_requests(serving.url)
    finally:
        serving.close()


def shares(counts: list[int]) -> tuple[float, float]:
    """(the busiest one's share, max / min)."""
    return max(counts) / max(1, sum(counts)), max(counts) / min(counts) if min(counts) else float("inf")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--api-server-count", type=int, nargs="+", default=[2, 3])
    p.add_argument("--clients", type=int, nargs="+", default=[64, 256], help="keep-alive streaming clients")
    p.add_argument("--client-processes", type=int, default=4)
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--stub-step-ms", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rows = {}
    for count in args.api_server_count:
        for clients in args.clients:
            for r in range(args.repeats):
                for name, share_port in list(MODES.items())[::1 if r % 2 == 0 else -1]:  # each goes first in turn
                    conns, reqs = one_run(count, share_port, argparse.Namespace(**{**vars(args), "clients": clients}))
                    rows.setdefault((name, count, clients), []).append((shares(conns), shares(reqs)))
                    print(f"{count} front-ends, {clients} clients, {name}: connections {conns}, requests {reqs}",
                          flush=True)
    print("\n| listening sockets | front-ends | clients | connections: busiest share, median / worst | max / min "
          "| requests: busiest share, median / worst | max / min |\n|---|---:|---:|---:|---:|---:|---:|")
    for (name, count, clients), runs in rows.items():
        cells = []
        for i in (0, 1):  # connections, requests
            busiest = [run[i][0] for run in runs]
            cells += [f"{statistics.median(busiest):.0%} / {max(busiest):.0%}",
                      f"{statistics.median(run[i][1] for run in runs):.2f}"]
        print(f"| {name} | {count} | {clients} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
