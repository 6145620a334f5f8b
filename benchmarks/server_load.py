"""A bounded load test of a running server: C concurrent streaming clients (the official
``openai`` client, or the lighter ``raw`` one: benchmarks/load_clients.py) send N completions between them; every request must end exactly once with
all its tokens (none lost, none duplicated); TTFT and inter-token latency percentiles.

The clients can be spread over P processes: one Python process parsing thousands of SSE chunks
a second through the client's models saturates its core, falls behind the server and then
reads buffered chunks back to back, which shows as huge TTFTs and near-zero inter-token gaps
that the server never caused. ``client_cpu_busy`` (the busiest process's CPU time over its
wall time) says when that is happening: near 100 %, the client figures measure the client;
``client_cpu_us_per_chunk`` compares the clients."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import sys
import time
from dataclasses import asdict, dataclass, field

from benchmarks.load_clients import CLIENTS, make_client
from benchmarks.server_metrics import kv_leaked, server_side_summary
from megatron_async.serve.process import ServerProcess

# megatron_async.cli (flags, summary) imports torch: imported where used, so that the spawned client
# processes, which import this module, start in a fraction of a second

WORDS = ("the quick brown fox jumps over a lazy dog while engines batch many requests and decode "
         "one token for each per step").split()


@dataclass
class StreamRecord:
    index: int
    response_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    ttft_s: float | None = None
    last_token_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    chunks: int = 0
    error: str | None = None
    disconnected: bool = False
    """The client closed the stream mid-way on purpose (``LoadShape.disconnects``)."""


@dataclass
class LoadTestReport:
    clients: int
    requests: int
    completed: int
    """Requests that ended with every token and a finish reason."""
    failed: int
    lost: int
    """Requests that never produced a final chunk."""
    duplicated: int
    """Response ids seen more than once, or requests answered more than once."""
    wrong_length: int
    output_tokens: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    """Gaps between successive token chunks as the client sees them (bursty when the client or
    the event loop falls behind: several chunks then arrive back to back)."""
    itl_p99_ms: float | None
    tpot_p50_ms: float | None
    """Per request: (last token - first token) / (tokens - 1); percentiles over requests."""
    tpot_p99_ms: float | None
    errors: list[str] = field(default_factory=list)
    disconnected: int = 0
    """Requests whose client left mid-stream on purpose (not counted in ``requests``)."""
    kv_leaked: bool | None = None
    """After the run: the server still held requests or KV blocks (None: not checked)."""
    processes: int = 1
    client_cpu_busy: float | None = None
    """CPU time / wall time of the busiest client process (near 1.0: the client is the bottleneck)."""
    client: str = "openai"
    """The HTTP client (benchmarks/load_clients.py): ``openai`` or the lighter ``raw``."""
    chunks: int = 0
    """SSE chunks received, over all processes."""
    client_cpu_s: float | None = None
    """CPU time of all client processes together."""
    started_at: float | None = None
    """``time.perf_counter()`` when the first requests were sent (with ``ended_at``: the window a
    server-side sampler restricts itself to)."""
    ended_at: float | None = None

    @property
    def client_cpu_us_per_chunk(self) -> float | None:
        return None if self.client_cpu_s is None or not self.chunks else 1e6 * self.client_cpu_s / self.chunks

    @property
    def ok(self) -> bool:
        return self.completed == self.requests and not (self.failed or self.lost or self.duplicated or self.wrong_length
                                                        or self.kv_leaked)

    def as_dict(self) -> dict:
        return {**asdict(self), "client_cpu_us_per_chunk": self.client_cpu_us_per_chunk}

    def format(self) -> str:
        def ms(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.1f} ms"

        return (f"{self.completed}/{self.requests} requests completed by {self.clients} clients in {self.wall_s:.1f} s "
                f"({self.requests_per_s:.1f} req/s, {self.output_tokens_per_s:.0f} tok/s); failed {self.failed}, "
                f"lost {self.lost}, duplicated {self.duplicated}, wrong length {self.wrong_length}"
                + (f"; {self.disconnected} left mid-stream" if self.disconnected else "")
                + ("" if self.kv_leaked is None else f"; KV {'LEAKED' if self.kv_leaked else 'all freed'}") + "\n"
                f"TTFT p50 {ms(self.ttft_p50_ms)} p99 {ms(self.ttft_p99_ms)}; "
                f"inter-token p50 {ms(self.itl_p50_ms)} p99 {ms(self.itl_p99_ms)}; "
                f"TPOT p50 {ms(self.tpot_p50_ms)} p99 {ms(self.tpot_p99_ms)}"
                + ("" if self.client_cpu_busy is None else
                   f"; {self.client} client processes {self.processes}, busiest {self.client_cpu_busy:.0%} CPU-busy"
                   + ("" if self.client_cpu_us_per_chunk is None else
                      f", {self.client_cpu_us_per_chunk:.0f} us CPU per chunk")))


def prompt_for(index: int, num_words: int) -> str:
    """A distinct text prompt per request (its index first)."""
    return f"request {index}: " + " ".join(WORDS[(index + k) % len(WORDS)] for k in range(num_words))


TOKEN_PROMPT_VOCAB = 256
"""Token-id prompts draw ids below this (every built-in model's vocabulary is larger)."""


def token_prompt_for(index: int, num_tokens: int) -> list[int]:
    """A distinct token-id prompt per request, for models without a tokenizer (the built-in ones)."""
    return [1 + (index * 7919 + k * 104729 + k * k) % (TOKEN_PROMPT_VOCAB - 1) for k in range(num_tokens)]


@dataclass(frozen=True)
class LoadShape:
    """What each request of a load run asks for, decided by its index (every process agrees)."""

    max_tokens: int = 32
    prompt_words: int = 12
    token_prompts: bool = False
    disconnect_fraction: float = 0.0
    """This share of requests closes its stream after a third of its tokens (an abort mid-stream)."""
    long_prompt_every: int = 0
    """Every this many requests (0: none) sends a prompt of ``long_prompt_words`` instead."""
    long_prompt_words: int = 8192
    disconnect_max_tokens: int = 0
    """What the requests that leave mid-stream ask for (0: ``max_tokens``): far more than they
    wait for, so that only the server's abort frees them before the load ends."""

    def disconnects(self, index: int) -> bool:
        return (index * 37) % 100 < round(100 * self.disconnect_fraction)

    def prompt(self, index: int) -> str | list[int]:
        long = self.long_prompt_every and index % self.long_prompt_every == self.long_prompt_every - 1
        n = self.long_prompt_words if long else self.prompt_words
        return token_prompt_for(index, n) if self.token_prompts else prompt_for(index, n)


def take_chunk(rec: StreamRecord, t: float, response_id: str, choices: list[tuple[list[int], str | None]]) -> None:
    """Files one streamed chunk, received ``t`` s after its request was sent, into ``rec``: one
    response id per stream, at most one final chunk, TTFT and per-token gaps. Both clients call this."""
    rec.chunks += 1
    rec.response_id = rec.response_id or response_id
    if response_id != rec.response_id:
        raise RuntimeError(f"chunks of two responses in one stream: {rec.response_id} and {response_id}")
    for ids, finish_reason in choices:
        if ids:
            if rec.last_token_s is None:
                rec.ttft_s = t
            else:
                rec.gaps_s.extend([(t - rec.last_token_s) / len(ids)] * len(ids))
            rec.last_token_s = t
            rec.token_ids.extend(ids)
        if finish_reason is not None:
            if rec.finish_reason is not None:
                raise RuntimeError("two final chunks")
            rec.finish_reason = finish_reason


def request_body(model: str, index: int, work: LoadShape) -> dict:
    max_tokens = work.disconnect_max_tokens if work.disconnect_max_tokens and work.disconnects(index) else work.max_tokens
    return {"model": model, "prompt": work.prompt(index), "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True, "return_token_ids": True}


async def _one(client, model: str, rec: StreamRecord, work: LoadShape) -> None:
    leave_after = max(1, work.max_tokens // 3) if work.disconnects(rec.index) else None
    t0 = time.perf_counter()
    try:
        async with contextlib.aclosing(client.chunks(request_body(model, rec.index, work))) as chunks:
            async for response_id, choices in chunks:
                take_chunk(rec, time.perf_counter() - t0, response_id, choices)
                if leave_after is not None and len(rec.token_ids) >= leave_after and rec.finish_reason is None:
                    rec.disconnected = True  # closing the stream: the server sees the connection go and aborts
                    return
    except Exception as e:  # noqa: BLE001 -- counted and reported, the test goes on
        rec.error = f"{type(e).__name__}: {e}"


async def _collect(base_url: str, model: str | None, indices: list[int], clients: int, work: LoadShape,
                   timeout_s: float, client_kind: str = "openai"):
    """``clients`` workers share a queue of request ``indices``. Returns (records, start, end, CPU s):
    ``start`` / ``end`` are ``time.perf_counter()`` readings (the system's monotonic clock on
    Linux, so those of several processes compare). With several processes, every one waits at
    ``_START`` after loading its client, so that all send their first requests together."""
    client = make_client(client_kind, base_url, timeout_s)
    served = await client.served_model()  # also loads what the client loads lazily, before the clock
    model = model or served
    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in indices:
        todo.put_nowait(i)
    records: dict[int, list[StreamRecord]] = {i: [] for i in indices}

    async def worker():
        while not todo.empty():
            rec = StreamRecord(todo.get_nowait())
            records[rec.index].append(rec)
            await _one(client, model, rec, work)

    if _START is not None:
        _START.wait(timeout_s)
    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(clients))), timeout_s)
    end, cpu = time.perf_counter(), time.process_time() - c0
    await client.close()
    return records, t0, end, cpu


async def run_load_test(base_url: str, model: str | None, clients: int = 64, requests: int = 500,
                        work: LoadShape = LoadShape(), timeout_s: float = 600.0,
                        client: str = "openai") -> LoadTestReport:
    """One client process: ``clients`` workers send ``requests`` requests; each asks for exactly
    ``work.max_tokens`` tokens (EOS ignored) so that a short or long answer shows. ``client``:
    ``openai`` or ``raw`` (benchmarks/load_clients.py)."""
    records, start, end, cpu = await _collect(base_url, model, list(range(requests)), clients, work, timeout_s, client)
    wall = end - start
    report = _report(records, clients, work.max_tokens, wall)
    report.started_at, report.ended_at = start, end
    report.client, report.client_cpu_s = client, cpu
    report.client_cpu_busy = cpu / wall if wall else None
    return report


_START = None
"""The barrier every client process waits at before its first request (set in each process)."""


def _set_start(barrier) -> None:
    global _START
    _START = barrier


def _process_part(args: tuple) -> tuple:
    return asyncio.run(_collect(*args))


def run_load_test_processes(base_url: str, model: str | None, processes: int, clients: int = 64, requests: int = 500,
                            work: LoadShape = LoadShape(), timeout_s: float = 600.0,
                            client: str = "openai") -> LoadTestReport:
    """``run_load_test`` with the clients and requests dealt round-robin over ``processes``
    client processes (spawned). They start together (a barrier after each has imported and
    loaded its client: otherwise the first would run alone while the last still imports); the
    wall time runs from that start to the last request's end."""
    if processes <= 1:
        return asyncio.run(run_load_test(base_url, model, clients, requests, work, timeout_s, client))
    parts = [(base_url, model, list(range(p, requests, processes)), len(range(p, clients, processes)), work,
              timeout_s, client) for p in range(processes)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(processes, initializer=_set_start, initargs=(ctx.Barrier(processes),)) as pool:
        results = pool.map(_process_part, parts, chunksize=1)
    records = {i: recs for part, _, _, _ in results for i, recs in part.items()}
    start, end = min(r[1] for r in results), max(r[2] for r in results)
    report = _report(dict(sorted(records.items())), clients, work.max_tokens, end - start)
    report.processes, report.client, report.client_cpu_s = processes, client, sum(r[3] for r in results)
    report.client_cpu_busy = max(c / (e - s) for _, s, e, c in results if e > s)
    report.started_at, report.ended_at = start, end
    return report


def _report(records: dict[int, list[StreamRecord]], clients: int, max_tokens: int, wall: float) -> LoadTestReport:
    flat = [r for recs in records.values() for r in recs]
    ids = [r.response_id for r in flat if r.response_id]
    failed = [r for r in flat if r.error is not None]
    left = [r for r in flat if r.disconnected and r.error is None]
    ended = [r for r in flat if r.error is None and r.finish_reason is not None]
    lost = sum(1 for recs in records.values() if not any(r.finish_reason or r.disconnected for r in recs))
    duplicated = (len(ids) - len(set(ids))) + sum(1 for recs in records.values() if len(recs) > 1)
    wrong = [r for r in ended if len(r.token_ids) != max_tokens]
    ttft = [r.ttft_s for r in ended if r.ttft_s is not None]
    gaps = [g for r in ended for g in r.gaps_s]
    tpot = [(r.last_token_s - r.ttft_s) / (len(r.token_ids) - 1) for r in ended
            if r.ttft_s is not None and r.last_token_s is not None and len(r.token_ids) > 1]
    tokens = sum(len(r.token_ids) for r in ended)

    from megatron_async.cli.summary import percentile

    def ms(xs, q):
        p = percentile(xs, q)
        return None if p is None else 1e3 * p

    return LoadTestReport(
        clients=clients, requests=len(records) - len(left), completed=len(ended) - len(wrong), failed=len(failed),
        lost=lost, disconnected=len(left),
        duplicated=duplicated, wrong_length=len(wrong), output_tokens=tokens, wall_s=wall,
        requests_per_s=len(ended) / wall if wall else 0.0, output_tokens_per_s=tokens / wall if wall else 0.0,
        ttft_p50_ms=ms(ttft, 50), ttft_p99_ms=ms(ttft, 99), itl_p50_ms=ms(gaps, 50), itl_p99_ms=ms(gaps, 99),
        tpot_p50_ms=ms(tpot, 50), tpot_p99_ms=ms(tpot, 99), chunks=sum(r.chunks for r in flat),
        errors=sorted({r.error for r in failed})[:5],
    )


def main(argv: list[str] | None = None) -> int:
    """The command line of python -m benchmarks load-test (see there)."""
    argv = sys.argv[1:] if argv is None else argv
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    from megatron_async.cli.flags import NON_NEGATIVE_INT, POSITIVE_INT, HelpFormatter

    p = argparse.ArgumentParser(description="Loopback load test of the OpenAI-compatible server", formatter_class=HelpFormatter)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--model", help="checkpoint dir of the server to start (default: the server's built-in model)")
    target.add_argument("--url", help="base URL of a running server (default: start one on a free loopback port)")
    p.add_argument("--served-model-name", default=None, help="with --url: the model to request (default: the server's)")
    p.add_argument("--clients", type=POSITIVE_INT, default=64)
    p.add_argument("--client-processes", type=POSITIVE_INT, default=1,
                   help="spread the clients over this many processes (one process saturates at a few thousand chunks/s)")
    p.add_argument("--client", choices=CLIENTS, default="openai",
                   help="openai: the official client; raw: the same requests over httpx2 with json.loads per SSE "
                        "line (less client CPU per chunk)")
    p.add_argument("--requests", type=POSITIVE_INT, default=500)
    p.add_argument("--max-tokens", type=POSITIVE_INT, default=32, help="tokens per request (EOS ignored)")
    p.add_argument("--prompt-words", type=POSITIVE_INT, default=12, help="prompt length (words, or ids with --token-prompts)")
    p.add_argument("--token-prompts", action="store_true", help="token-id prompts (a model without a tokenizer)")
    p.add_argument("--disconnect-fraction", type=float, default=0.0,
                   help="share of requests whose client closes the stream after a third of its tokens")
    p.add_argument("--long-prompt-every", type=NON_NEGATIVE_INT, default=0,
                   help="every N-th request sends a --long-prompt-words prompt instead (0: none)")
    p.add_argument("--long-prompt-words", type=POSITIVE_INT, default=8192)
    p.add_argument("--no-kv-check", action="store_true",
                   help="skip the check that the server holds no request or KV block after the run "
                        "(a server that others use too)")
    p.add_argument("--warmup-requests", type=NON_NEGATIVE_INT, default=0, help="an unreported load run first")
    p.add_argument("--start-timeout", type=POSITIVE_INT, default=300, help="seconds the server may take to start")
    p.add_argument("--output-path", default=None, help="write the report as JSON")
    args = p.parse_args(argv)

    def run(url: str, model: str | None) -> LoadTestReport:
        if args.warmup_requests:
            warm = load(url, model, args.warmup_requests)
            print(f"warm-up: {warm.format().splitlines()[0]}", flush=True)
        return load(url, model, args.requests)

    work = LoadShape(args.max_tokens, args.prompt_words, args.token_prompts, args.disconnect_fraction,
                    args.long_prompt_every, args.long_prompt_words)

    def load(url: str, model: str | None, requests: int) -> LoadTestReport:
        report = run_load_test_processes(url, model, args.client_processes, args.clients, requests, work,
                                         client=args.client)
        if not args.no_kv_check:
            report.kv_leaked = kv_leaked(url)
        return report

    if args.url:
        report = run(args.url.rstrip("/"), args.served_model_name)
        print(server_side_summary(args.url.rstrip("/")))
    else:
        model_args = ["--model", args.model] if args.model else []
        with ServerProcess([*model_args, *server_args], start_timeout_s=args.start_timeout) as srv:
            print(f"server: {srv.model_name} at {srv.url} ({' '.join(model_args + server_args)})", flush=True)
            report = run(srv.url, srv.model_name)
            print(server_side_summary(srv.url))
    print(report.format())
    if args.output_path:
        with open(args.output_path, "w") as f:
            json.dump(report.as_dict(), f, indent=1)
    return 0 if report.ok else 1
