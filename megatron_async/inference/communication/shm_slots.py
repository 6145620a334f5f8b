"""An all-gather of a few int64 (and optionally some bytes) per rank through one shared-memory
segment (ranks on one host).

Layout: a header line (the poison word: nonzero once some rank gave up, naming it), then one
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
values and the seq are separate numpy assignments (separate C calls: no compiler reordering
across them) and the seq is one aligned 8-byte store (atomic). Weakly ordered CPUs (Arm) would
need fences Python cannot issue, so ``supported()`` is False there and the caller uses ZMQ.

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
import tempfile
import time
import uuid
from typing import Callable

import numpy as np

_LINE = 8  # int64 per 64-byte cache line
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


class SharedSlots:
    def __init__(self, path: str, rank: int, world_size: int, capacity: int, create: bool,
                 timeout_s: float | None = 300.0, spin_us: float = 50.0, blob_bytes: int = 1 << 20):
        """``capacity``: most ints one rank contributes per round. ``create``: this rank makes the
        segment at ``path`` and the ranks' FIFOs next to it (the others open them; ``unlink``
        once every rank has). ``spin_us``: how long a wait spins before it sleeps. ``blob_bytes``:
        the most bytes one rank hands to the others per round (``gather(blob=...)``)."""
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
        self._words = np.frombuffer(self._map, dtype=np.int64, count=words)
        self._blobs = np.frombuffer(self._map, dtype=np.uint8, offset=8 * words).reshape(
            world_size, 2, self.blob_bytes)  # per bank: an int64 size (-1: none), then the bytes
        self._headers = np.frombuffer(self._map, dtype=np.int64, offset=8 * words).reshape(
            world_size, 2, self.blob_bytes // 8)[:, :, 0]
        self._poison = self._words[0:1]
        self._slots = self._words[_LINE:].reshape(world_size, self._slot)
        self._seqs = self._slots[:, 0]  # strided views: one load per rank
        self._sleeping = self._slots[:, 1]
        self._posted = self._slots[:, 2]  # the latest round whose ``post`` is complete
        self._mine = self._slots[rank]
        self.round = int(self._mine[0])  # 0 on a fresh segment
        self._poll = select.poll()
        self._poll.register(self._fifos[rank], select.POLLIN)

    def gather(self, values: np.ndarray, alive: Callable[[], None] | None = None, blob: bytes | None = None,
               published: Callable[[], None] | None = None) -> np.ndarray:
        """Collective: every rank's ``values`` (int64, same length on every rank) as a
        (world_size, n) array, by rank. ``alive()`` raises if a peer is known dead. ``blob``
        (at most ``blob_bytes``): bytes the others read with ``blob(rank)`` until this rank's
        next ``gather`` returns. ``published()`` runs once this rank's values are visible,
        before it waits for the others (the time to ``post`` what nobody waits for yet)."""
        n = len(values)
        if n > self.capacity:
            raise ValueError(f"{n} values exceed the shared slots' capacity of {self.capacity}")
        k = self.round + 1
        at = _LINE + (k & 1) * self._bank
        if blob is not None:
            self._write_blob(k, blob)
        self._mine[at + 1:at + 1 + n] = values
        self._mine[at] = n
        self._mine[0] = k  # publish last: x86 keeps the stores above visible first
        self.round = k
        if published is not None:
            published()
        if self._seqs.min() < k:
            self._wait(k, alive, self._seqs)
        self._wake(k)  # the round is complete: wake whoever sleeps in it
        rows = self._slots[:, at:at + 1 + n].copy()
        if (rows[:, 0] != n).any():
            raise SlotsError(f"round {k}: ranks contributed {rows[:, 0].tolist()} values, rank {self.rank} {n}: "
                             "the ranks diverged")
        return rows[:, 1:]

    def blob(self, rank: int) -> bytes | None:
        """What ``rank`` handed over in the latest round (``gather``'s or ``post``'s blob; None:
        it posted none). Valid until this rank's next ``gather`` returns."""
        size = int(self._headers[rank, self.round & 1])
        return None if size < 0 else self._blobs[rank, self.round & 1, 8:8 + size].tobytes()

    def post(self, blob: bytes | None) -> None:
        """After publishing round k's values: bytes the others read after ``wait_posted(rank,
        k)`` (None: nothing here, the caller sent it some other way)."""
        self._write_blob(self.round, blob)
        self._posted[self.rank] = self.round  # after the bytes (x86 store order)

    def wait_posted(self, rank: int, alive: Callable[[], None] | None = None) -> bytes | None:
        """``rank``'s ``post`` of the latest round (it is on its way: spin, yielding the core)."""
        k = self.round
        if self._posted[rank] < k:
            self._wait(k, alive, self._posted[rank:rank + 1], sleep=False)
        return self.blob(rank)

    def _write_blob(self, k: int, blob: bytes | None) -> None:
        if blob is not None and len(blob) > self.blob_bytes - 8:
            raise ValueError(f"{len(blob)} bytes exceed the shared slots' {self.blob_bytes - 8} per round")
        if blob:
            self._blobs[self.rank, k & 1, 8:8 + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        self._headers[self.rank, k & 1] = -1 if blob is None else len(blob)

    def _wake(self, k: int) -> None:
        for r in np.flatnonzero(self._sleeping == k).tolist():
            if r == self.rank:
                continue
            try:
                os.write(self._fifos[r], b"\0")
            except BlockingIOError:  # its FIFO is full of wake-ups already
                pass

    def _wait(self, k: int, alive, words: np.ndarray, sleep: bool = True) -> None:
        """Until every one of ``words`` is >= k."""
        t0 = checked = time.perf_counter()
        while time.perf_counter() - t0 < self.spin_s or not sleep:
            if words.min() >= k:
                return
            os.sched_yield()  # a peer or ZMQ thread waiting for this core runs first
            now = time.perf_counter()
            if now - checked > 1e-3:
                checked = now
                self._check(k, now - t0, alive, words)
        while True:
            self._sleeping[self.rank] = k  # then re-check: a rank arriving now sees the mark
            if words.min() >= k:
                break
            self._poll.poll(_NAP_S * 1000)
            try:
                os.read(self._fifos[self.rank], 4096)  # drain (several ranks may have written)
            except BlockingIOError:
                pass
            if words.min() >= k:
                break
            self._check(k, time.perf_counter() - t0, alive, words)

    def _check(self, k: int, waited: float, alive, words: np.ndarray) -> None:
        """Raise if a peer gave up, is known dead, or the wait timed out, unless the round
        completed meanwhile (a peer that published and then exited left a good round: its
        death shows at the next one, the poison word and a lost connection being sticky)."""
        try:
            if self._poison[0]:
                raise SlotsError(f"rank {self.rank}: rank {self._poison[0] - 1} gave up in shared-memory round {k}")
            if alive is not None:
                alive()
            if self.timeout_s is not None and waited > self.timeout_s:
                late = [r for r in range(self.world_size) if self._seqs[r] < k]
                raise SlotsError(f"rank {self.rank}: ranks {late} did not arrive within {self.timeout_s:.3g} s "
                                 f"in shared-memory round {k}")
        except Exception:
            if words.min() >= k:
                return
            if not self._poison[0]:
                self._poison[0] = self.rank + 1  # the others waiting here fail at once too
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
            del self._words, self._blobs, self._headers, self._poison, self._slots, self._seqs, self._sleeping
            del self._posted, self._mine
            try:
                self._map.close()
            except BufferError:  # a view is still alive (a traceback's frame): freed with it
                pass
            self._map = None
