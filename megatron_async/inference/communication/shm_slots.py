"""An all-gather of a few int64 (and optionally some bytes) per rank through one shared-memory
segment (ranks on one host).

Layout: a header line (the poison word: nonzero once some rank gave up, naming it; the end
word: nonzero once rank 0 announced the end of the job, holding its exit status + 1), then one
slot per rank, each padded to whole cache lines so two ranks never write the same line:
``[seq, bank 0: n + values, bank 1: n + values]``; after the slots, a byte area per rank and
bank (``blob_bytes`` each; tmpfs backs only the pages written). Round k: every rank writes its
values (and bytes) into bank ``k % 2`` of its own slot, THEN stores ``seq = k``; it waits until
every slot's seq is >= k and reads every bank ``k % 2``. No root hop, no thread wake-up.

Why two banks suffice: a rank can run at most one round ahead of the slowest reader (it cannot
finish round k+1 before everyone wrote k+1, i.e. finished reading k), so bank ``k % 2`` is not
rewritten (round k+2) before every rank has read round k from it.

Memory ordering: a reader that sees ``seq == k`` must see the values written before it. On x86
(TSO) stores become visible in program order and loads are not reordered with older loads; the
values and the seq are separate ``struct`` writes (separate C calls: no compiler reordering
across them; on a little-endian host "<q" packs with one 8-byte ``memcpy``) and the seq is one
aligned 8-byte store (atomic). Weakly ordered CPUs (Arm) would need fences Python cannot issue,
so ``supported()`` is False there and the caller uses ZMQ.

Waiting: spin for a bounded time (the fast case: peers a few us behind), calling
``sched_yield`` every turn so that a peer, a ZMQ thread or another job waiting for this core
runs first (a bare spin on a busy box held the core its peer needed: rounds of milliseconds),
then sleep in the kernel on this rank's FIFO: a sleeper marks its slot with
the round it sleeps in, re-checks, and blocks; a rank that completes a round (it sees every seq)
writes a byte to the FIFO of each rank marked for that round. The mark and the check can cross
(x86 may order a load before an older store), so a sleep also ends after 2 ms and re-checks:
a lost wake-up costs at most that. No spinning rank starves a computing one on a small box, and
no I/O thread sits between ranks. Each wake-up also checks the poison word, the caller's
liveness check (a dead peer) and the timeout, so a dead or silent peer ends in an error.
"""
from __future__ import annotations

import mmap
import os
import platform
import select
import socket
import struct
import tempfile
import time
import uuid
from typing import Callable

_LINE = 8  # int64 per 64-byte cache line
_Q = struct.Struct("<q")  # one aligned word: a single 8-byte store or load
_NAP_S = 2e-3  # longest sleep before re-checking (bounds a lost wake-up and the liveness checks)


def supported() -> bool:
    """Shared slots rely on x86's store ordering (see the module docstring)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def segment_path() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"ma-consensus-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def join_slots(rank: int, world_size: int, wanted: bool, broadcast, all_reduce_max, timeout_s: float | None,
               spin_us: float | None) -> "SharedSlots | None":
    """Collective over an existing link (``broadcast(obj)`` from rank 0, ``all_reduce_max(ints)``):
    rank 0's slots, mapped on every rank, if every rank is on its host and wants them; else None
    on every rank. ``spin_us`` None: 2000 with a spare core per rank, else 20 (see
    ``InferenceConfig.consensus_spin_us``)."""
    if spin_us is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        spin_us = 2000.0 if cores >= os.getloadavg()[0] + world_size else 20.0
    # StepConsensus sends ~8 + 3 ints per rank
    args = dict(world_size=world_size, capacity=32 + 4 * world_size, timeout_s=timeout_s, spin_us=spin_us)
    slots = offer = None
    if rank == 0 and wanted and supported():
        try:
            slots = SharedSlots(segment_path(), 0, create=True, **args)
            offer = (socket.gethostname(), slots.path)
        except OSError:
            slots = None
    offer = broadcast(offer)
    if rank != 0 and wanted and offer is not None and offer[0] == socket.gethostname():
        try:
            slots = SharedSlots(offer[1], rank, create=False, **args)
        except (OSError, ValueError):
            slots = None
    everyone = all_reduce_max([int(slots is None)]) == [0]  # after it, every rank has mapped it
    if slots is None:
        return None
    slots.unlink()  # nothing to leak from here on, even if a rank is killed
    if not everyone:
        slots.close()
        return None
    return slots


class SlotsError(RuntimeError):
    """A peer gave up, went silent or died (the caller re-raises it as its own error type)."""


class SlotsEnded(Exception):
    """Rank 0 announced the end of the job (``status``: its exit status) while this rank waited."""

    def __init__(self, status: int, k: int):
        super().__init__(f"shared-memory round {k}")
        self.status = status


class SharedSlots:
    def __init__(self, path: str, rank: int, world_size: int, capacity: int, create: bool,
                 timeout_s: float | None = 300.0, spin_us: float = 50.0, blob_bytes: int = 1 << 20):
        """``capacity``: most ints one rank contributes per round. ``create``: this rank makes the
        segment at ``path`` and the ranks' FIFOs next to it (the others open them; ``unlink``
        once every rank has). ``spin_us``: how long a wait spins before it sleeps. ``blob_bytes``:
        the most bytes one rank hands to the others per round (``gather(blob=...)``).

        Every access is a precompiled ``struct`` over the mapping: a round's write is one call,
        its read of every rank's seq (and sleep mark) one call, its read of every rank's values
        one call. Few C calls matter more than their speed: between two rounds the engine's own
        work evicts this code from the caches, and each cold call costs microseconds."""
        self.rank, self.world_size, self.capacity = rank, world_size, capacity
        self.timeout_s, self.spin_s = timeout_s, spin_us / 1e6
        self._bank = -(-(1 + capacity) // _LINE) * _LINE
        self._slot = _LINE + 2 * self._bank  # [seq, sleeping in round, posted] (a line of their own), two banks
        words = _LINE + world_size * self._slot
        self.blob_bytes = -(-blob_bytes // 64) * 64
        size = 8 * words + 2 * world_size * self.blob_bytes
        self.path, self._map, self._fifos = path, None, []
        self._fifo_paths = [f"{path}.w{r}" for r in range(world_size)]
        if create:
            for f in self._fifo_paths:
                os.mkfifo(f, 0o600)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        # O_RDWR: opening a FIFO this way never blocks, and it never reports end-of-file.
        self._fifos = [os.open(f, os.O_RDWR | os.O_NONBLOCK) for f in self._fifo_paths]
        stride = 8 * self._slot
        self._slot0 = 8 * _LINE  # byte offset of rank 0's slot
        self._mine = self._slot0 + rank * stride
        self._blob0 = 8 * words  # byte offset of the byte areas: per rank and bank, an int64 size (-1: none), bytes
        # (seq, sleeping) of every rank in one read; every rank's posted word in another
        self._heads = struct.Struct("<" + f"{stride - 16}x".join(["qq"] * world_size))
        self._posted_all = struct.Struct("<" + f"{stride - 8}x".join(["q"] * world_size))
        self._fmt: dict[int, tuple] = {}  # by value count (``_formats``)
        self.round = _Q.unpack_from(self._map, self._mine)[0]  # 0 on a fresh segment
        self._poll = select.poll()
        self._poll.register(self._fifos[rank], select.POLLIN)
        self.probe = None
        """A ``RoundProbe`` (debug; round_probe.py) or None."""
        self.waited_ns = 0
        """How long the latest ``gather`` waited for the other ranks."""
        self.sleeps = 0
        """Waits that outlasted the spin and slept on the FIFO (each wake-up costs tens of us)."""

    def _formats(self, n: int) -> tuple[struct.Struct, struct.Struct, list[slice]]:
        """The write of ``n`` values (count first), the read of every rank's ``n``, and where
        each rank's values sit in what the read returns."""
        if n > self.capacity:
            raise ValueError(f"{n} values exceed the shared slots' capacity of {self.capacity}")
        m = 1 + n
        read = struct.Struct("<" + f"{8 * (self._slot - m)}x".join([f"{m}q"] * self.world_size))
        self._fmt[n] = struct.Struct(f"<{m}q"), read, [slice(r * m + 1, (r + 1) * m) for r in range(self.world_size)]
        return self._fmt[n]

    def gather(self, values, alive: Callable[[], None] | None = None, blob: bytes | None = None,
               published: Callable[[], None] | None = None) -> tuple[tuple[int, ...], list[slice]]:
        """Collective: every rank's ``values`` (ints, as many on every rank), as ``(flat,
        slices)``: rank r's values are ``flat[slices[r]]``. ``alive()`` raises if a peer is known
        dead. ``blob`` (at most ``blob_bytes``): bytes the others read with ``blob(rank)`` until
        this rank's next ``gather`` returns. ``published()`` runs once this rank's values are
        visible, before it waits for the others (the time to ``post`` what nobody waits for yet)."""
        n = len(values)
        write, read, slices = self._fmt.get(n) or self._formats(n)
        k = self.round + 1
        bank = 8 * (_LINE + (k & 1) * self._bank)
        if blob is not None:
            self._write_blob(k, blob)
        write.pack_into(self._map, self._mine + bank, n, *values)
        _Q.pack_into(self._map, self._mine, k)  # publish last: x86 keeps the stores above visible first
        self.round = k
        probe = self.probe
        if probe is not None:
            probe.mark("publish")
        if published is not None:
            published()
            if probe is not None:
                probe.mark("post")
        heads = self._heads.unpack_from(self._map, self._slot0)
        self.waited_ns = 0
        if min(heads[0::2]) < k:
            t = time.perf_counter_ns()
            self._wait(k, alive, self._seqs_done)
            self.waited_ns = time.perf_counter_ns() - t
            heads = self._heads.unpack_from(self._map, self._slot0)
        if probe is not None:
            probe.mark("wait")
        if k in heads[1::2]:
            self._wake(k, heads[1::2])  # the round is complete: wake whoever sleeps in it
        flat = read.unpack_from(self._map, self._slot0 + bank)
        if flat[0::n + 1].count(n) != self.world_size:
            raise SlotsError(f"round {k}: ranks contributed {list(flat[0::n + 1])} values, rank {self.rank} {n}: "
                             "the ranks diverged")
        return flat, slices

    def _seqs_done(self, k: int) -> bool:
        return min(self._heads.unpack_from(self._map, self._slot0)[0::2]) >= k

    def blob(self, rank: int) -> bytes | None:
        """What ``rank`` handed over in the latest round (``gather``'s or ``post``'s blob; None:
        it posted none). Valid until this rank's next ``gather`` returns."""
        at = self._blob_at(rank, self.round)
        size = _Q.unpack_from(self._map, at)[0]
        return None if size < 0 else self._map[at + 8:at + 8 + size]

    def post(self, blob: bytes | None) -> None:
        """After publishing round k's values: bytes the others read after ``wait_posted(rank,
        k)`` (None: nothing here, the caller sent it some other way)."""
        self._write_blob(self.round, blob)
        _Q.pack_into(self._map, self._mine + 16, self.round)  # after the bytes (x86 store order)

    def wait_posted(self, rank: int, alive: Callable[[], None] | None = None) -> bytes | None:
        """``rank``'s ``post`` of the latest round (it is on its way: spin, yielding the core)."""
        k, at = self.round, self._slot0 + rank * 8 * self._slot + 16
        if _Q.unpack_from(self._map, at)[0] < k:
            self._wait(k, alive, lambda k: _Q.unpack_from(self._map, at)[0] >= k, sleep=False)
        return self.blob(rank)

    def _blob_at(self, rank: int, k: int) -> int:
        return self._blob0 + (2 * rank + (k & 1)) * self.blob_bytes

    def _write_blob(self, k: int, blob: bytes | None) -> None:
        if blob is not None and len(blob) > self.blob_bytes - 8:
            raise ValueError(f"{len(blob)} bytes exceed the shared slots' {self.blob_bytes - 8} per round")
        at = self._blob_at(self.rank, k)
        if blob:
            self._map[at + 8:at + 8 + len(blob)] = blob
        _Q.pack_into(self._map, at, -1 if blob is None else len(blob))

    def _wake(self, k: int, sleeping: tuple[int, ...]) -> None:
        for r, round_ in enumerate(sleeping):
            if round_ != k or r == self.rank:
                continue
            try:
                os.write(self._fifos[r], b"\0")
            except BlockingIOError:  # its FIFO is full of wake-ups already
                pass

    def _wait(self, k: int, alive, done: Callable[[int], bool], sleep: bool = True) -> None:
        """Until ``done(k)``."""
        t0 = checked = time.perf_counter()
        while time.perf_counter() - t0 < self.spin_s or not sleep:
            if done(k):
                return
            os.sched_yield()  # a peer or ZMQ thread waiting for this core runs first
            now = time.perf_counter()
            if now - checked > 1e-3:
                checked = now
                self._check(k, now - t0, alive, done)
        self.sleeps += 1  # (only a sleeping wait gets here)
        while True:
            _Q.pack_into(self._map, self._mine + 8, k)  # sleeping in k; then re-check: a rank arriving now sees it
            if done(k):
                break
            self._poll.poll(_NAP_S * 1000)
            try:
                os.read(self._fifos[self.rank], 4096)  # drain (several ranks may have written)
            except BlockingIOError:
                pass
            if done(k):
                break
            self._check(k, time.perf_counter() - t0, alive, done)

    def _seq(self, rank: int) -> int:
        return _Q.unpack_from(self._map, self._slot0 + rank * 8 * self._slot)[0]

    def end(self, status: int) -> None:
        """Rank 0: announce the end of the job with exit ``status``; whoever waits in a round
        (now or later) raises ``SlotsEnded`` instead of waiting for a round rank 0 never starts."""
        _Q.pack_into(self._map, 8, status + 1)
        for fd in self._fifos:
            try:
                os.write(fd, b"\0")
            except BlockingIOError:
                pass

    def _check(self, k: int, waited: float, alive, done: Callable[[int], bool]) -> None:
        """Raise if rank 0 ended the job, a peer gave up, is known dead, or the wait timed out,
        unless the round completed meanwhile (a peer that published and then exited left a good
        round: its death shows at the next one, the poison word and a lost connection being sticky)."""
        ended = _Q.unpack_from(self._map, 8)[0]
        if ended and not done(k):  # before the liveness check: rank 0 may be gone already
            raise SlotsEnded(ended - 1, k)
        try:
            poison = _Q.unpack_from(self._map, 0)[0]
            if poison:
                raise SlotsError(f"rank {self.rank}: rank {poison - 1} gave up in shared-memory round {k}")
            if alive is not None:
                alive()
            if self.timeout_s is not None and waited > self.timeout_s:
                late = [r for r in range(self.world_size) if self._seq(r) < k]
                raise SlotsError(f"rank {self.rank}: ranks {late} did not arrive within {self.timeout_s:.3g} s "
                                 f"in shared-memory round {k}")
        except Exception:
            if done(k):
                return
            if not _Q.unpack_from(self._map, 0)[0]:
                _Q.pack_into(self._map, 0, self.rank + 1)  # the others waiting here fail at once too
            for fd in self._fifos:
                try:
                    os.write(fd, b"\0")
                except BlockingIOError:
                    pass
            raise

    def unlink(self) -> None:
        """Remove the files (mappings and open FIFOs stay valid); call once every rank opened them."""
        for f in [self.path, *self._fifo_paths]:
            try:
                os.unlink(f)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        for fd in self._fifos:
            os.close(fd)
        self._fifos = []
        if self._map is not None:
            self._map.close()
            self._map = None
