"""Where one request's round trip through the coordinator goes, stage by stage: a coordinator, 2
null engines (benchmarks/null_engine.py) and this process's client stamp ``time.perf_counter_ns``
(one clock for every process of a host) at each send (``zmq_send``'s entry) and at each wake-up
(the first Python after a blocking poll returned: the coordinator's loop, an engine's wait, the
client's reader). Where engines answer clients directly (dp_engine/direct_replies.py: the
coordinator's ipc twin, a request that does not stream), the path is 3 hops: the engine's first
send is to the client, whose reply socket's reader wakes. One request at a time; each row is the median over the requests of the time
from one stamp to the next on the request's path: the Python a process runs between its wake-up
and its send, and each hop from a send to the receiver's wake-up (the hops' floor:
benchmarks/bare_relay.py). The stamps add ~10 us to the round trip.

    python -m benchmarks.router_stages [--requests 3000] [--prompt-len 33]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

STAMPS: list[tuple[int, str]] = []
ROWS = [("client: the prompt's ids and block digests, the sampling map, the submission written", "C0", "C.send"),
        ("hop: client -> coordinator", "C.send", "K.wake"),
        ("coordinator: the submission read, routed, the route written", "K.wake", "K.send"),
        ("hop: coordinator -> engine", "K.send", "E.wake"),
        ("engine link: the route read, admitted, a null step, its outputs written", "E.wake", "E.send"),
        ("hop: engine -> coordinator", "E.send", "K.wake2"),
        ("coordinator: the outputs read, renumbered, the finished output written", "K.wake2", "K.send2"),
        ("hop: coordinator -> client (epoll, the event loop's callback)", "K.send2", "C.wake"),
        ("client: the output read and decoded, the future resolved, the caller resumed", "C.wake", "C1")]
DIRECT_ROWS = ROWS[:4] + [("engine link: the route read, admitted, a null step, its output sent to the client", "E.wake",
                           "E.send"), ("hop: engine -> client (epoll, the event loop's callback)", "E.send", "C.wake"),
                          ROWS[-1]]


def direct_replies() -> bool:
    """This tree's engines answer clients directly."""
    from importlib.util import find_spec

    return find_spec("megatron_async.dp_engine.direct_replies") is not None


def _stamp_before(owner, name: str, tag: str) -> None:
    fn, clock = getattr(owner, name), time.perf_counter_ns

    def stamped(*args, **kw):
        STAMPS.append((clock(), tag))
        return fn(*args, **kw)
    setattr(owner, name, stamped)


def _stamp_after(owner, name: str, tag: str) -> None:
    fn, clock = getattr(owner, name), time.perf_counter_ns

    def stamped(*args, **kw):
        out = fn(*args, **kw)
        STAMPS.append((clock(), tag))
        return out
    setattr(owner, name, stamped)


def _dump_on_term(path: str) -> None:
    def dump(*_):
        with open(path, "w") as fh:
            json.dump(STAMPS, fh)
        os._exit(0)
    signal.signal(signal.SIGTERM, dump)


def coordinator(out: str) -> None:
    from megatron_async.coordinator import server
    from megatron_async.inference.communication import handshake

    _stamp_after(server, "zmq_poll", "K.wake")
    _stamp_before(handshake, "zmq_send", "K.send")
    srv = server.CoordinatorServer("tcp://127.0.0.1:0", "scored")
    _dump_on_term(out)
    print(f"listening on {srv.address}", flush=True)
    srv.serve()


def engine(address: str, name: str, out: str) -> None:
    from benchmarks import null_engine
    from megatron_async.coordinator import transport

    _stamp_after(transport.PeerSocket, "wait", "E.wake")
    _stamp_before(transport, "zmq_send", "E.send")
    if direct_replies():
        from megatron_async.dp_engine import direct_replies as direct

        _stamp_before(direct, "zmq_send", "E.send")
    _dump_on_term(out)
    null_engine.main([address, name])


async def client(address: str, n: int, prompt: list[int]) -> list[int]:
    from megatron_async import SamplingParams
    from megatron_async.client import InferenceClient
    from megatron_async.client.channel import ClientChannel
    from megatron_async.coordinator import transport

    _stamp_before(transport, "zmq_send", "C.send")
    if direct_replies():
        from megatron_async.client.replies import ReplySocket

        _stamp_before(ReplySocket, "read", "C.wake")
    else:
        _stamp_before(ClientChannel, "_read", "C.wake")
    c = await InferenceClient(address).start()
    params, totals, clock = SamplingParams(num_tokens_to_generate=1), [], time.perf_counter_ns
    for i in range(-200, n):  # 200 to warm up
        if i == 0:
            STAMPS.clear()
        t0 = clock()
        STAMPS.append((t0, "C0"))
        await c.add_request(prompt + [i % 1000], params)
        STAMPS.append((clock(), "C1"))
        totals.append(clock() - t0)
    c.close()
    return totals[200:]


def path_of(window: list[tuple[int, str]], direct: bool = False) -> dict[str, int] | None:
    """The stamps of one request, in path order: each the first of its kind after the one before
    (a heartbeat or a timeout in between is passed over); None when one is missing."""
    order = ["C0", "C.send", "K.wake", "K.send", "E.wake", "E.send", *([] if direct else ["K.wake2", "K.send2"]),
             "C.wake", "C1"]
    got, at = {}, 0
    for key in order:
        kind = key.rstrip("2")
        while at < len(window) and window[at][1] != kind:
            at += 1
        if at == len(window):
            return None
        got[key] = window[at][0]
        at += 1
    return got


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--prompt-len", type=int, default=33)
    args = p.parse_args(argv)
    from benchmarks.bare_relay import BareRelay
    from tests.helpers.coordinator_procs import ROOT, _env, _wait_line

    tmp = tempfile.mkdtemp(prefix="router_stages_")

    def start(*role: str) -> subprocess.Popen:  # (stderr: the coordinator logs its engines' exits at the end)
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.router_stages", *role], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, env=_env(), cwd=ROOT))
        return procs[-1]
    procs: list[subprocess.Popen] = []
    try:
        address = _wait_line(start("--coordinator", f"{tmp}/k.json"), "listening on ", 60)
        for i in range(2):
            _wait_line(start("--engine", address, f"null{i}", f"{tmp}/e{i}.json"), "megatron_async.serve: engine ", 60)
        totals = asyncio.run(client(address, args.requests, list(range(1, args.prompt_len))))
        bare = {}
        for ipc in (False, True):
            floor = BareRelay(ipc=ipc)
            try:
                bare[ipc] = statistics.median(floor.round_trips(2000))
            finally:
                floor.close()
    finally:
        for proc in reversed(procs):  # the engines first: they would end with their coordinator, undumped
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
    stamps = [tuple(s) for s in STAMPS]
    for name in ("k", "e0", "e1"):
        with open(f"{tmp}/{name}.json") as fh:
            stamps += [tuple(s) for s in json.load(fh)]
    stamps.sort()
    starts = [i for i, (_, kind) in enumerate(stamps) if kind == "C0"] + [len(stamps)]
    direct = direct_replies()
    paths = [path_of(stamps[a:b], direct) for a, b in zip(starts, starts[1:])]
    paths = [p for p in paths if p is not None]
    print(f"{len(paths)} of {args.requests} requests one at a time, round trip median "
          f"{statistics.median(totals) / 1e3:.0f} us, load average {os.getloadavg()[0]:.2f}:\n")
    print("| on the request's path | median |\n|---|---:|")
    for label, a, b in DIRECT_ROWS if direct else ROWS:
        print(f"| {label} | {statistics.median(p[b] - p[a] for p in paths) / 1e3:.0f} us |")
    print(f"\nThe same 4 hops over bare ZMQ (benchmarks/bare_relay.py), after: {1e6 * bare[False]:.0f} us over TCP, "
          f"{1e6 * bare[True]:.0f} us over ipc")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--coordinator":
        coordinator(sys.argv[2])
    elif len(sys.argv) > 4 and sys.argv[1] == "--engine":
        engine(*sys.argv[2:5])
    else:
        main()
