"""A small CPU communicator among the ranks of a tensor-parallel group, over ZMQ.

Collectives are star-shaped through rank 0, which is plenty for the few small Python
objects the engine exchanges per step: ``exchange`` is the engine's one per-step round trip
(every rank's ints max-reduced, the others' uploads gathered at rank 0, rank 0's payload sent
back). This module holds the collectives; the sockets, how ranks find each other (through the
torch.distributed store: ``from_rendezvous``) and liveness are the transport's
(zmq_transport.py), and what a message is made of is wire.py's. Every message carries the
collective's sequence number and kind, so ranks that call different collectives fail loudly
instead of silently pairing the wrong messages; every receive has a timeout so a silent peer
raises instead of hanging, and a peer whose connection drops (its process died) makes the
waiting ranks raise at once.

Ranks all on one host (decided together at construction) run ``exchange`` through shared memory
instead (shm_slots.py: a slot per rank, every rank takes the max itself, no root hop, no I/O
thread); rank 0's payload rides the segment too, only when present (a flag among the ints says
so), and the other ranks' uploads are posted there after the round for rank 0 to take when it
needs them (``take_uploads``); either goes over ZMQ when larger than the segment's byte area.
``exchange_path`` says which path this communicator uses."""
from __future__ import annotations

import os
from typing import Any, Callable

import pickle
from megatron_async.inference.communication.shm_slots import SharedSlots, SlotsError, join_slots
from megatron_async.inference.communication.zmq_transport import CommunicatorError, ZMQTransport, address_towards

JOIN_TIMEOUT_S = 60.0
"""The longest wait for the peers while joining (at least the per-message timeout)."""


class _Pickled:
    """The messages as pickles: ranks of one trusted job only (being replaced by wire.py frames)."""

    pack = staticmethod(lambda seq, kind, payload: pickle.dumps((seq, kind, payload)))
    unpack = staticmethod(pickle.loads)
    dumps = staticmethod(lambda obj: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    loads = staticmethod(pickle.loads)


wire = _Pickled


class ZMQCommunicator:
    def __init__(self, rank: int, world_size: int, host: str, port: int | None, timeout_s: float | None = 300.0,
                 publish=None, lookup=None, shared_memory: bool = True, spin_us: float | None = None):
        """``timeout_s``: longest wait for one message once joined (None: wait forever; joining
        waits up to ``max(timeout_s, JOIN_TIMEOUT_S)``). ``port`` None: rank 0
        binds an ephemeral port on ``host`` and hands ``tcp://host:port`` to ``publish``; the
        others connect to the address ``lookup()`` returns (see ``from_rendezvous``).
        ``shared_memory``: run ``exchange``'s ints through shared memory when every rank is on
        this host (False on any rank: ZMQ everywhere). ``spin_us``: how long a shared-memory wait
        spins before it sleeps (None: see ``InferenceConfig.consensus_spin_us``)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        self.rank, self.world_size = rank, world_size
        self._seq = 0
        self.transport: ZMQTransport | None = None
        """The sockets (None for a world of one, and once closed)."""
        self._slots: SharedSlots | None = None
        self._early: list[tuple[int, bytes]] = []  # rank 0: (peer, message) of a later collective
        self._carry: list[Any] = []  # rank 0: uploads received, not yet taken
        self._posting: tuple[int, list[int]] | None = None  # rank 0: (exchange, ranks) whose uploads are posted
        self.upload_codec: tuple[Callable[[Any], bytes], Callable[[bytes], Any]] | None = None
        """(encode, decode) turning uploads into bytes and back, used instead of pickle (the
        caller's compact format); set on every rank alike."""
        self._probe = None
        self.plain_rounds = 0
        """Shared-memory exchanges in which this rank pickled and unpickled nothing: only its
        record of ints moved (the common step: no news from rank 0, no upload from this rank)."""
        self.waited_ns = 0
        """How long the latest ``exchange`` waited for other ranks (over ZMQ: for messages)."""
        self.exchange_path = "local" if world_size == 1 else "zmq"
        """How ``exchange`` moves its ints: "shared_memory", "zmq", or "local" (one rank)."""
        if world_size == 1:
            return
        step_timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        self.transport = ZMQTransport(rank, world_size, host, port, step_timeout_ms, publish, lookup)
        # Handshake: rank 0 learns every peer's identity before it routes anything to it. Ranks
        # start at different times (process spawn, imports, model build on a loaded host), so
        # joining waits up to JOIN_TIMEOUT_S even when the per-message timeout is shorter.
        if step_timeout_ms is not None:
            self.transport.timeout_ms = max(step_timeout_ms, int(JOIN_TIMEOUT_S * 1000))
        try:
            self.barrier()
            self._slots = join_slots(self.rank, self.world_size, shared_memory, self.broadcast_object,
                                     self.all_reduce_max, timeout_s, spin_us)
        finally:
            self.transport.timeout_ms = step_timeout_ms
        if self._slots is not None:
            self.exchange_path = "shared_memory"

    @property
    def probe(self):
        """A ``RoundProbe`` timing each exchange's phases (debug), or None (the default)."""
        return self._probe

    @probe.setter
    def probe(self, probe) -> None:
        self._probe = probe
        if self._slots is not None:
            self._slots.probe = probe

    @property
    def spin_us(self) -> float | None:
        """How long a shared-memory wait spins before it sleeps (None over ZMQ)."""
        return self._slots.spin_s * 1e6 if self._slots is not None else None

    @property
    def sleeps(self) -> int:
        """Shared-memory waits that outlasted the spin and slept (0 over ZMQ)."""
        return self._slots.sleeps if self._slots is not None else 0

    _joined = 0  # communicators built through a rendezvous by this process (same count on every rank)

    @classmethod
    def from_rendezvous(cls, store, rank: int, world_size: int, timeout_s: float | None = 300.0,
                        shared_memory: bool = True, spin_us: float | None = None) -> "ZMQCommunicator":
        """Join through a torch.distributed ``Store`` (the job's rendezvous): rank 0 binds an
        ephemeral port on the address it uses to reach the store's host (MASTER_ADDR) and
        publishes it; the others wait for it and connect there. Works across nodes. The key is
        numbered, so a store that outlives one engine never hands out a stale address."""
        ZMQCommunicator._joined += 1
        key = f"megatron_async/zmq/{ZMQCommunicator._joined}"
        host = address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1")) if rank == 0 else ""
        publish = lambda endpoint: store.set(key, endpoint)  # noqa: E731
        lookup = lambda: store.get(key).decode()  # noqa: E731  (store.get blocks until it is set)
        return cls(rank, world_size, host, None, timeout_s, publish=publish, lookup=lookup, shared_memory=shared_memory,
                   spin_us=spin_us)

    # ------------------------------------------------------------------ collectives
    def exchange(self, values: list[int], upload: Any = None, payload: Any = None) -> tuple[list[int], Any]:
        """One round: the element-wise max of every rank's ``values`` and rank 0's ``payload``
        on every rank (None: nothing to send). The other ranks' ``upload``s (results, not
        decisions: nobody waits for them) reach rank 0 through ``take_uploads``."""
        seq = self._next_seq()
        self.waited_ns = 0
        if self._slots is not None:  # (struct packs any int-like value, and reads back ints)
            return self._exchange_shared(seq, values, upload, payload)
        values = [int(v) for v in values]
        if self.world_size == 1:
            return values, payload
        if self.rank != 0:
            self.transport.send_to_root(wire.pack(seq, "exchange", (values, self._encode(upload))))
            return self._recv_from_root(seq, "exchange")
        result = values
        for peer, (theirs, up) in sorted(self._gather_at_root(seq, "exchange").items()):
            if len(theirs) != len(result):
                raise CommunicatorError(f"exchange #{seq}: rank {peer} sent {len(theirs)} values, rank 0 {len(result)}")
            result = [max(a, b) for a, b in zip(result, theirs)]
            if up is not None:
                self._carry.append(self._decode(up))
        self.transport.send_to_peers(wire.pack(seq, "exchange", (result, payload)))
        return result, payload

    def take_uploads(self) -> list[Any]:
        """Rank 0: the uploads of the exchanges so far not taken, by round then rank. Call it
        when the results are needed (after launching the step, say); the next exchange keeps
        any left untaken for the call after it."""
        got, self._carry = self._carry + self._take_posted(), []
        return got

    def _exchange_shared(self, seq: int, values: list[int], upload: Any, payload: Any):
        """``exchange`` with the ints in shared memory. Rank 0's payload rides the segment's byte
        area (or, too big for it, ZMQ, sent before the ints are published so it is in flight
        once the others learn from them that it comes; the last int says which: 0 none, 1
        shared memory, -1 ZMQ). An upload is serialised (``upload_codec``, else pickle) and
        posted after its rank's ints are published (into the byte area, or over ZMQ), so no rank
        waits for it in the round."""
        leader, probe = self.rank == 0, self.probe
        blob = None if payload is None else wire.dumps(payload)
        code = 0 if blob is None else 1 if len(blob) <= self._slots.blob_bytes - 8 else -1
        if leader and code < 0:
            self.transport.send_to_peers(wire.pack(seq, "exchange", payload))
        if not leader:
            code = int(upload is not None)
        if probe is not None:
            probe.mark("serialise")

        def post() -> None:
            data = self._encode(upload)
            if len(data) > self._slots.blob_bytes - 8:
                self.transport.send_to_root(wire.pack(seq, "upload", data))
                data = None
            self._slots.post(data)

        try:
            flat, slices = self._slots.gather((*values, code), self.transport.alive, blob if leader and code > 0 else None,
                                              post if not leader and upload is not None else None)
        except SlotsError as e:
            raise CommunicatorError(f"{e} (exchange #{seq})") from None
        self.waited_ns = self._slots.waited_ns
        result = list(map(max, *map(flat.__getitem__, slices)))  # element-wise, no Python frame per rank
        codes = flat[len(values) + 1::len(values) + 2]  # each rank's last int
        del result[-1]
        if probe is not None:
            probe.mark("read")
        if leader:
            self._posting = (seq, [r for r in range(1, self.world_size) if codes[r]])
            self.plain_rounds += blob is None
            return result, payload
        if codes[0] == 0:
            self.plain_rounds += upload is None
            return result, None
        got = self._recv_from_root(seq, "exchange") if codes[0] < 0 else wire.loads(self._slots.blob(0))
        if probe is not None:
            probe.mark("deserialise")
        return result, got

    def _take_posted(self) -> list[Any]:
        """Rank 0: the uploads posted in the latest shared-memory round (each at most once)."""
        if self._posting is None:
            return []
        (seq, ranks), self._posting = self._posting, None
        got, over_zmq = [], []
        for r in ranks:
            try:
                data = self._slots.wait_posted(r, self.transport.alive)
            except SlotsError as e:
                raise CommunicatorError(f"{e} (uploads of exchange #{seq})") from None
            if self.probe is not None:
                self.probe.mark("wait")
            if data is None:
                over_zmq.append(r)
            else:
                got.append((r, self._decode(data)))
                if self.probe is not None:
                    self.probe.mark("deserialise")
        if over_zmq:
            got += [(r, self._decode(data)) for r, data in self._gather_at_root(seq, "upload", set(over_zmq)).items()]
        return [up for _, up in sorted(got, key=lambda x: x[0])]

    def _encode(self, upload: Any) -> bytes | None:
        if upload is None:
            return None
        return self.upload_codec[0](upload) if self.upload_codec else wire.dumps(upload)

    def _decode(self, data: bytes) -> Any:
        return self.upload_codec[1](data) if self.upload_codec else wire.loads(data)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (the others' arguments are ignored)."""
        seq = self._next_seq()
        if self.world_size == 1:
            return obj
        if self.rank == 0:
            self.transport.send_to_peers(wire.pack(seq, "broadcast", obj))
            return obj
        return self._recv_from_root(seq, "broadcast")

    def all_reduce_max(self, values: list[int]) -> list[int]:
        """Element-wise max of every rank's ``values`` (all of one length), on every rank."""
        seq = self._next_seq()
        values = [int(v) for v in values]
        if self.world_size == 1:
            return values
        if self.rank != 0:
            self.transport.send_to_root(wire.pack(seq, "all_reduce_max", values))
            return self._recv_from_root(seq, "all_reduce_max")
        result = values
        for peer, theirs in self._gather_at_root(seq, "all_reduce_max").items():
            if len(theirs) != len(result):
                raise CommunicatorError(
                    f"all_reduce_max #{seq}: rank {peer} sent {len(theirs)} values, rank 0 {len(result)}"
                )
            result = [max(a, b) for a, b in zip(result, theirs)]
        self.transport.send_to_peers(wire.pack(seq, "all_reduce_max", result))
        return result

    def barrier(self) -> None:
        self.all_reduce_max([0])

    def close(self) -> None:
        if self._slots is not None:
            self._slots.close()
            self._slots = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    # ------------------------------------------------------------------ messages
    def _next_seq(self) -> int:
        if self.world_size > 1 and self.transport is None:
            raise CommunicatorError("communicator is closed")
        if self._posting is not None:  # before any other collective: uploads of the round nobody took
            self._carry.extend(self._take_posted())
        self._seq += 1
        return self._seq

    def _wait(self, seq: int, kind: str) -> None:
        self.waited_ns += self.transport.wait(f"{kind} #{seq}")

    def _check(self, msg: bytes, seq: int, kind: str, sender: str) -> Any:
        """The payload of ``msg``, which must be of collective ``seq`` of kind ``kind``."""
        got_seq, got_kind, payload = wire.unpack(msg)
        if (got_seq, got_kind) != (seq, kind):
            raise CommunicatorError(
                f"rank {self.rank} is in {kind} #{seq} but {sender} sent {got_kind} #{got_seq}: the ranks diverged"
            )
        return payload

    def _recv_from_root(self, seq: int, kind: str) -> Any:
        self._wait(seq, kind)
        return self._check(self.transport.recv_from_root(), seq, kind, "rank 0")

    def _gather_at_root(self, seq: int, kind: str, peers: set[int] | None = None) -> dict[int, Any]:
        """One message from each of ``peers`` (default: every other rank). With shared memory a
        peer can be a round ahead: a message of its next collective that comes first waits in
        ``_early`` (a peer's messages arrive in the order it sent them)."""
        want = set(range(1, self.world_size)) if peers is None else peers
        got: dict[int, Any] = {}
        early, self._early = self._early, []

        def take(peer: int, msg: bytes) -> None:
            if peer in want and peer not in got:
                got[peer] = self._check(msg, seq, kind, f"rank {peer}")
            else:
                self._early.append((peer, msg))

        for peer, msg in early:
            take(peer, msg)
        while len(got) < len(want):
            self._wait(seq, kind)
            take(*self.transport.recv_from_peer())
        return got

    def __enter__(self) -> "ZMQCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

