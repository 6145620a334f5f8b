"""CPU per streamed chunk of the SSE response classes alone: Starlette's StreamingResponse against
serve/sse_response.py's SSEResponse, each behind the same FastAPI route, called by a fake ASGI
server (no socket) whose stream wakes up once per chunk. Small --chunks shows the per-response
cost (task group, disconnect listener) spread over a short answer; large, the per-chunk cost.

    python -m benchmarks sse-send-cost                 # 32 chunks per response, uvloop if installed
    python -m benchmarks sse-send-cost --chunks 50000 --responses 1
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastapi import FastAPI  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402

from megatron_async.serve.sse_response import SSEResponse  # noqa: E402

CHUNK = 'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" w1"}]}\n\n'


def build_app(chunks: int) -> FastAPI:
    app = FastAPI()

    async def events():
        for _ in range(chunks):
            await asyncio.sleep(0)  # one wake-up per chunk, as a stream waiting for the next step
            yield CHUNK

    @app.get("/starlette")
    async def starlette_response():
        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/sse")
    async def sse_response():
        return SSEResponse(events(), on_close=lambda: None)

    return app


async def us_per_chunk(app: FastAPI, path: str, chunks: int, responses: int) -> float:
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
    sent = 0

    async def receive():  # the client stays
        await asyncio.Event().wait()

    async def send(message):
        nonlocal sent
        sent += 1

    t0 = time.process_time()
    for _ in range(responses):
        await app(scope, receive, send)
    dt = time.process_time() - t0
    assert sent == responses * (chunks + 2), sent
    return 1e6 * dt / (responses * chunks)


async def run(args) -> None:
    app = build_app(args.chunks)
    paths = ("/starlette", "/sse")
    for p in paths:  # warm-up
        await us_per_chunk(app, p, args.chunks, 1)
    times = {p: [] for p in paths}
    for _ in range(args.rounds):  # interleaved: drift on a shared machine hits both
        for p in paths:
            times[p].append(await us_per_chunk(app, p, args.chunks, args.responses))
    print(f"{args.chunks} chunks per response, {args.responses} responses, {args.rounds} rounds, "
          f"{type(asyncio.get_running_loop()).__module__}")
    for p, name in zip(paths, ("StreamingResponse", "SSEResponse")):
        v = times[p]
        print(f"{name:<18} median {statistics.median(v):6.2f} us CPU per chunk  (min {min(v):.2f}, max {max(v):.2f})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=32, help="chunks per response")
    p.add_argument("--responses", type=int, default=2000, help="responses per timed round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"])
    args = p.parse_args()
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if args.loop == "uvloop" or (args.loop == "auto" and uvloop is not None):
        uvloop.run(run(args))
    else:
        asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
