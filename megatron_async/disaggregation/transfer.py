"""KV transfer connections: one process group of 2 per (prefill, decode) pair, set up once, on
the pair key the coordinator handed both engines over its authenticated wire (random per pair),
and a thread per connection that waits on its transfers, so that an engine's loop never blocks on
one.

Backends (``InferenceConfig.kv_transfer_backend``): "gloo" (CPU buffers, TCP: any two hosts; a
GPU engine stages through host memory), "nccl" (GPU to GPU, the same code with a NCCL group of
2), "ipc" (engines of one host: the blocks shared in memory, ipc_share.py, no pair connection).
"auto": nccl on CUDA, gloo on the CPU.

The decode engine hosts the rendezvous store (``Rendezvous``: a TCPStore on an ephemeral port
of the interface its coordinator reaches). The store and the group's connections carry no
secret of their own (torch.distributed has none): the store sees a digest of the pair key, and
the group's first exchange is the two engines' proof of the key (pair_auth.py); a connection
whose peer fails it is refused before any block moves.

Both ends queue their transfers in the coordinator's order: the decode engine posts a receive
(kv_accepted), then the prefill engine sends it (kv_send), so the two FIFOs meet in order. A
transfer that fails (the peer died, the group broke) fails every later one of that connection;
the engines report it (kv_failed) and the coordinator frees both sides.

A request's blocks move in bounded chunks on the connection's own CUDA stream (kv_stream.py); the
thread posts them without waiting for the GPU, and ``take_done`` hands a transfer back once its
end event passed (a query, never a synchronize of the engine's loop).

``TransferTimes`` counts what the transfers themselves took (the wire, not the control round
trips): a prefill engine's sends on a pair connection, a decode engine's copies out of an "ipc"
pair's shared blocks; a group's setup (NCCL creates its communicator at the first operation) is
paid by ``connect``'s proof before the first timed transfer."""
from __future__ import annotations

import datetime
import logging
import queue
import socket
import threading
import time
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_async.disaggregation.kv_stream import (CHUNK_BYTES, TRANSFER_PRIORITY, Clock, Staging, recv_blocks,
                                                     seconds_between, send_blocks)
from megatron_async.disaggregation.pair_auth import mac_key, prove, store_prefix

log = logging.getLogger("megatron_async.disaggregation")
SPENT = "spent"
"""The store key (under a pair's prefix) that says its connection was refused or broke: a group
never meets there again (the coordinator gives the pair a new key)."""
SETUP_TIMEOUT_S = 60.0
TRANSFER_TIMEOUT_S = 300.0


def resolve_backend(setting: str, device: torch.device) -> str:
    if setting == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if setting not in ("gloo", "nccl", "ipc"):
        raise ValueError(f"kv_transfer_backend must be auto, nccl, gloo or ipc, got {setting!r}")
    if setting == "nccl" and device.type != "cuda":
        raise ValueError("kv_transfer_backend='nccl' needs a CUDA engine")
    return setting


def store_host(coordinator_address: str) -> str:
    """The interface the pair's peer reaches this engine on: loopback when the coordinator is."""
    if coordinator_address.startswith("ipc://") or "127.0.0.1" in coordinator_address or "localhost" in coordinator_address:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # the interface toward the coordinator
        host = coordinator_address.split("://", 1)[-1].rsplit(":", 1)[0]
        s.connect((host, 9))
        return s.getsockname()[0]


class TransferTimes:
    """Transfers, their bytes and seconds; CUDA copies are timed by events, read once they ended."""

    def __init__(self):
        self.count = self.nbytes = 0
        self.seconds = 0.0
        self._pending: deque = deque()  # (start event, end event, bytes, what must live until the end)

    def add(self, nbytes: int, seconds: float) -> None:
        self.count, self.nbytes, self.seconds = self.count + 1, self.nbytes + nbytes, self.seconds + seconds

    def add_events(self, start, end, nbytes: int, keep=None) -> None:
        """A copy between ``start`` and ``end`` (recorded CUDA events); ``keep`` (the source) lives
        until it ended."""
        self._pending.append((start, end, nbytes, keep))

    def settle(self) -> None:
        """Count the timed copies that ended (no wait)."""
        while self._pending and self._pending[0][1].query():
            start, end, nbytes, _ = self._pending.popleft()
            self.add(nbytes, start.elapsed_time(end) / 1e3)

    def counters(self) -> dict:
        self.settle()
        return {"kv_transfers": self.count, "kv_transfer_bytes": self.nbytes, "kv_transfer_seconds": self.seconds}


class Rendezvous:
    """A decode engine's store that its pairs' groups meet at."""

    def __init__(self, host: str):
        self.store = dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=SETUP_TIMEOUT_S),
                                   wait_for_workers=False)
        self.address = f"{host}:{self.store.port}"

    def spend(self, key: str) -> None:
        """``key``'s connection was refused or broke: a peer still coming with it is refused at once
        instead of meeting what is left of the old group's rendezvous."""
        dist.PrefixStore(store_prefix(key), self.store).set(SPENT, "1")


class PairChannel:
    """This engine's end of one pair's group: ``send`` / ``recv`` (one tensor) and ``send_blocks``
    / ``recv_blocks`` (a request's blocks, chunked) queue a transfer, ``take_done`` hands back
    those that ended: (tag, result, error or None, seconds: a send's time on the wire, 0 for a
    receive, which waits for its send); a receive's result is its tensor, or for ``recv_blocks``
    the Mamba state's bytes (None without Mamba layers: the blocks are in the pool).

    ``hook(kind, tag)``, when given, runs on the connection's thread after a transfer's operations
    were posted and before it is handed back (a test holds a transfer in flight with it)."""

    def __init__(self, key: str, address: str, rank: int, backend: str, device: torch.device,
                 rendezvous: Rendezvous | None = None, chunk_bytes: int = CHUNK_BYTES,
                 hook: Callable[[str, int], None] | None = None):
        self.key, self.rank, self.backend = key, rank, backend
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.pool_device = device
        self.chunk_bytes, self.hook = chunk_bytes, hook
        self._address, self._rendezvous = address, rendezvous
        self._mac_key = mac_key(key)
        self._jobs: queue.Queue = queue.Queue()
        self._done: deque = deque()  # (tag, result, error, start mark, end mark, end event or None)
        self.error: str | None = None
        self.pending = 0
        """Transfers queued and not yet handed back (the loop thread's count)."""
        self.setup_seconds = 0.0
        """Its set-up's time on its own thread (group, proof, staging buffers): never a loop turn's."""
        self._stream = None
        name = f"megatron-async-kv-{store_prefix(key)[3:15]}"  # (not the key: names and logs are no secret)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _queue(self, kind: str, tag: int, payload, ready_on: torch.device | None, ready=None) -> None:
        """``ready``: what the transfer waits for on the device; None: an event of the caller's
        current stream (what it enqueued so far comes first)."""
        if ready is None and ready_on is not None and ready_on.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(ready_on))
        self.pending += 1
        self._jobs.put((kind, tag, payload, ready))

    def send(self, tag: int, tensor: torch.Tensor) -> None:
        """``tensor`` was written on the caller's current stream (a CUDA tensor is sent after it)."""
        self._queue("send", tag, tensor, tensor.device)

    def recv(self, tag: int, tensor: torch.Tensor) -> None:
        self._queue("recv", tag, tensor, None)

    def send_blocks(self, tag: int, layout, block_ids: list[int], state, written=None) -> None:
        """Send ``block_ids`` of ``layout``'s pool (and a Mamba ``state``), written on the caller's
        stream before ``written`` (a CUDA event; None: before now)."""
        self._queue("send_blocks", tag, (layout, list(block_ids), state), layout.device, written)

    def recv_blocks(self, tag: int, layout, block_ids: list[int]) -> None:
        """Receive into ``block_ids`` of ``layout``'s pool, after what the caller's stream enqueued so far."""
        self._queue("recv_blocks", tag, (layout, list(block_ids)), layout.device)

    def take_done(self) -> list[tuple[int, Any, str | None, float]]:
        out = []
        while self._done and (self._done[0][5] is None or self._done[0][5].query()):
            tag, result, error, start, end, _ = self._done.popleft()
            out.append((tag, result, error, 0.0 if start is None else seconds_between(start, end)))
        self.pending -= len(out)
        return out

    def close(self) -> None:
        self._jobs.put(None)

    def _group(self) -> Any:
        timeout = datetime.timedelta(seconds=SETUP_TIMEOUT_S)
        if self._rendezvous is not None:
            store = self._rendezvous.store
        else:
            host, port = self._address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), None, False, timeout=timeout)
        store = dist.PrefixStore(store_prefix(self.key), store)
        if store.check([SPENT]):
            raise ConnectionRefusedError("this pair key's connection was refused or broke before: the pair has a new one")
        if self.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = datetime.timedelta(seconds=TRANSFER_TIMEOUT_S)
            opts.is_high_priority_stream = True  # (as the gathers and scatters: TRANSFER_PRIORITY)
            return dist.ProcessGroupNCCL(store, self.rank, 2, opts)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=TRANSFER_TIMEOUT_S)
        host = self._rendezvous.address.rsplit(":", 1)[0] if self._rendezvous else self._address.rsplit(":", 1)[0]
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1" if host == "127.0.0.1" else "")]
        return dist.ProcessGroupGloo(store, self.rank, 2, opts)

    def _post(self, group, kind: str, tensor: torch.Tensor, tag: int):
        return group.send([tensor], 1 - self.rank, tag) if kind == "send" else group.recv([tensor], 1 - self.rank, tag)

    def _exchange(self, group, kind: str, tensor: torch.Tensor, tag: int) -> None:
        self._post(group, kind, tensor, tag).wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # (this connection's stream, this thread)

    def connect(self, group) -> None:
        """The pair's proof of its key (pair_auth.py; AuthError: refused), before any transfer;
        the group's connections then exist (NCCL makes them at its first operation) when the
        first transfer is timed."""
        prove(lambda kind, tensor: self._exchange(group, kind, tensor, 0), self.rank, self._mac_key, self.device)

    def _move(self, group, kind: str, tag: int, payload, before_scatter: Callable[[], None]):
        """Post one transfer on this thread's stream: (result, start mark, end mark)."""
        clock = Clock(self.pool_device.type == "cuda")
        op = lambda k, t: self._post(group, k, t, tag)  # noqa: E731
        if kind == "send_blocks":
            layout, block_ids, state = payload
            start, end = send_blocks(op, self._staging, layout, block_ids, state, self.chunk_bytes, clock)
            return None, start, end
        if kind == "recv_blocks":
            layout, block_ids = payload
            return recv_blocks(op, self._staging, layout, block_ids, self.chunk_bytes, before_scatter), None, None
        start = clock.mark()
        self._post(group, kind, payload, tag).wait()
        return payload, (start if kind == "send" else None), clock.mark()

    def _run(self) -> None:
        group = None
        cuda = self.pool_device.type == "cuda"
        if cuda:  # (the thread's own stream: the engine's compute stream never waits on a transfer)
            torch.cuda.set_device(self.pool_device)
            self._stream = torch.cuda.Stream(self.pool_device, priority=TRANSFER_PRIORITY)
            torch.cuda.set_stream(self._stream)
        self._staging = Staging(self.pool_device, self.device, self.chunk_bytes)
        while (job := self._jobs.get()) is not None:
            kind, tag, payload, ready = job
            result, start, end, ended = None, None, None, None
            if self.error is None:
                try:
                    if group is None:
                        started = time.perf_counter()
                        self._staging.reserve()
                        group = self._group()
                        self.connect(group)
                        self.setup_seconds = time.perf_counter() - started
                    wait = (lambda ready=ready: self._stream.wait_event(ready)) if ready is not None else (lambda: None)
                    if kind != "recv_blocks":  # (a receive waits only before it writes the pool)
                        wait()
                    result, start, end = self._move(group, kind, tag, payload, wait)
                    if cuda:
                        ended = torch.cuda.Event()
                        ended.record(self._stream)
                    if self.hook is not None:
                        self.hook(kind, tag)
                except Exception as e:  # noqa: BLE001 -- the peer died or the group broke: every later transfer fails too
                    self.error = f"{type(e).__name__}: {e}"
                    result, start, end, ended = None, None, None, None
                    if cuda:  # (what it enqueued ends before its blocks go back to the pool)
                        ended = torch.cuda.Event()
                        ended.record(self._stream)
                    if self._rendezvous is not None:  # (the store is this engine's: no wait on a peer)
                        self._rendezvous.spend(self.key)
                    log.error("KV transfer connection %s broke: %s", store_prefix(self.key), self.error)
            self._done.append((tag, result, self.error, start, end, ended))
