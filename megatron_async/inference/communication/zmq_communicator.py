"""A small CPU communicator among the ranks of a job (tensor / expert parallel), over ZMQ.

Collectives are star-shaped through rank 0, which is plenty for the few small records the
engine exchanges per step: ``exchange`` is the engine's one per-step round trip (every rank's
ints max-reduced, the others' uploads gathered at rank 0 as bytes, read only when rank 0 takes
them, rank 0's payload sent back). This
module holds the collectives; the sockets, how ranks find and authenticate each other (through
the torch.distributed store: ``from_rendezvous``) and liveness are the transport's
(zmq_transport.py). Every message is a wire frame (wire.py) of one of the four types below,
carrying the collective's sequence number, so ranks that call different collectives fail loudly
instead of silently pairing the wrong messages; payloads and uploads are bytes made by the
caller's codecs (``payload_codec``, ``upload_codec``: the engine's records, step_records.py), or
plain msgpack values by default. Nothing is pickled. Every receive has a timeout so a silent
peer raises instead of hanging, and a rank whose connection drops (its process died) makes the
waiting ranks raise at once; strangers' connections and frames change nothing (counted in
``wire_stats``).

Ranks all on one host (decided together at construction) run ``exchange`` through shared memory
instead (shm_slots.py: a slot per rank, every rank takes the max itself, no root hop, no I/O
thread); rank 0's payload rides the segment too, only when present (a flag among the ints says
so), and the other ranks' uploads are posted there after the round for rank 0 to take when it
needs them (``take_uploads``); either goes over ZMQ when larger than the segment's byte area.
``exchange_path`` says which path this communicator uses."""
from __future__ import annotations

from typing import Any, Callable

from megatron_async.inference.communication import job_end, wire
from megatron_async.inference.communication import wire_fields as f
from megatron_async.inference.communication.shm_slots import SharedSlots, SlotsEnded, SlotsError, join_slots
from megatron_async.inference.communication.zmq_transport import (
    MAX_FRAME_BYTES, CommunicatorError, LeaderEnded, ZMQTransport,
)

JOIN_TIMEOUT_S = 60.0
"""The longest wait for the peers while joining (at least the per-message timeout)."""
MAX_AHEAD = 4
"""Rank 0: most messages one rank may send ahead of the collective rank 0 is in."""

EXCHANGE = wire.message_type("exchange", 16, arity=3)
"""[seq, values | nil, bytes | nil]: up, a rank's ints and upload; down, the result and rank 0's
payload (shared memory: [seq, nil, payload] when the payload is too big for the segment)."""
UPLOAD = wire.message_type("upload", 17, arity=2)
"""[seq, bytes]: an upload too big for the shared-memory byte area."""
BROADCAST = wire.message_type("broadcast", 18, arity=2)
"""[seq, value]: ``broadcast_object``'s value (plain, or bytes of the caller's codec)."""
ALL_REDUCE_MAX = wire.message_type("all_reduce_max", 19, arity=2)
"""[seq, values]: both ways."""

Codec = tuple[Callable[[Any], bytes], Callable[[bytes], Any]]
PLAIN: Codec = (wire.pack, lambda data: wire.unpack(data, MAX_FRAME_BYTES))
"""Plain msgpack values (None, bool, int, float, str, bytes, lists, str-keyed maps)."""


class ZMQCommunicator:
    def __init__(self, rank: int, world_size: int, store=None, key: str = "megatron_async/ranks",
                 timeout_s: float | None = 300.0, shared_memory: bool = True, spin_us: float | None = None,
                 force_tcp: bool = False):
        """``store``: the job's torch.distributed store (rank 0 publishes its endpoints under
        ``key``; unused for a world of one). ``timeout_s``: longest wait for one message once
        joined (None: wait forever; joining waits up to ``max(timeout_s, JOIN_TIMEOUT_S)``).
        ``shared_memory``: run ``exchange``'s ints through shared memory when every rank is on
        this host (False on any rank: ZMQ everywhere). ``spin_us``: how long a shared-memory wait
        spins before it sleeps (None: see ``InferenceConfig.consensus_spin_us``). ``force_tcp``:
        listen on TCP as if the ranks spanned hosts (tests, measurements)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        self.rank, self.world_size = rank, world_size
        self._seq = 0
        self.transport: ZMQTransport | None = None
        """The sockets (None for a world of one, and once closed)."""
        self._slots: SharedSlots | None = None
        self._early: list[tuple[int, wire.MessageType, list]] = []  # rank 0: messages of a later collective
        self._carry: list[tuple[int, Any]] = []  # rank 0: (sender, upload bytes) received, not yet taken
        self._posting: tuple[int, list[int]] | None = None  # rank 0: (exchange, ranks) whose uploads are posted
        self.payload_codec: Codec = PLAIN
        """(encode, decode) of rank 0's ``exchange`` payloads; set on every rank alike."""
        self.upload_codec: Codec = PLAIN
        """(encode, decode) of the other ranks' uploads; set on every rank alike."""
        self._probe = None
        self.plain_rounds = 0
        """Shared-memory exchanges in which this rank encoded and decoded nothing: only its
        record of ints moved (the common step: no news from rank 0, no upload from this rank)."""
        self.waited_ns = 0
        """How long the latest ``exchange`` waited for other ranks (over ZMQ: for messages)."""
        self.exchange_path = "local" if world_size == 1 else "zmq"
        """How ``exchange`` moves its ints: "shared_memory", "zmq", or "local" (one rank)."""
        if world_size == 1:
            return
        step_timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        # Ranks start at different times (process spawn, imports, model build on a loaded host), so
        # joining waits up to JOIN_TIMEOUT_S even when the per-message timeout is shorter.
        join_s = JOIN_TIMEOUT_S if timeout_s is None else max(timeout_s, JOIN_TIMEOUT_S)
        self.transport = ZMQTransport(rank, world_size, store, key, int(join_s * 1000), join_s, force_tcp)
        try:
            self.barrier()  # rank 0 has heard (and authenticated) every rank
            self._slots = join_slots(self.rank, self.world_size, shared_memory, self.broadcast_object,
                                     self.all_reduce_max, timeout_s, spin_us)
        except BaseException:
            self.close()
            raise
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

    @property
    def wire_stats(self) -> wire.WireStats | None:
        """Rank 0: what strangers sent to and did on its socket (None elsewhere)."""
        return self.transport.stats if self.transport is not None and self.rank == 0 else None

    _joined = 0  # communicators built through a rendezvous by this process (same count on every rank)

    @classmethod
    def from_rendezvous(cls, store, rank: int, world_size: int, timeout_s: float | None = 300.0,
                        shared_memory: bool = True, spin_us: float | None = None,
                        force_tcp: bool = False) -> "ZMQCommunicator":
        """Join through a torch.distributed ``Store`` (the job's rendezvous): see the
        transport for where rank 0 listens and how the others prove they belong to the job.
        The key is numbered, so a store that outlives one engine never hands out a stale address."""
        ZMQCommunicator._joined += 1
        return cls(rank, world_size, store, f"megatron_async/ranks/{ZMQCommunicator._joined}", timeout_s,
                   shared_memory, spin_us, force_tcp)

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
        self.transport.waited_ns = 0
        if self.rank != 0:
            self.transport.send_to_root(wire.encode(EXCHANGE, seq, values, self._encode(upload)))
            result, blob = self._recv_from_root(seq, EXCHANGE)
            self.waited_ns = self.transport.waited_ns
            return f.int_list(result, "values"), None if blob is None else self._decode(self.payload_codec, blob, 0)
        result = values
        for peer, (theirs, up) in sorted(self._gather_at_root(seq, EXCHANGE).items()):
            if type(theirs) is not list or len(theirs) != len(result):
                raise CommunicatorError(f"exchange #{seq}: rank {peer} sent {theirs!r:.40} values, rank 0 {len(result)}")
            result = [a if a > b else b for a, b in zip(result, f.int_list(theirs, "values"))]  # (4x max(a, b))
            if up is not None:  # read at take_uploads, after the others have the result
                self._carry.append((peer, up))
        self.transport.send_to_peers(wire.encode(EXCHANGE, seq, result, None if payload is None
                                                 else self.payload_codec[0](payload)))
        self.waited_ns = self.transport.waited_ns
        return result, payload

    def take_uploads(self) -> list[Any]:
        """Rank 0: the uploads of the exchanges so far not taken, by round then rank. Call it
        when the results are needed (after launching the step, say); the next exchange keeps
        any left untaken for the call after it. Uploads are read (their records decoded and
        checked) here, on either path, so that no round waits for it."""
        got, self._carry = self._carry + self._take_posted(), []
        out = [self._decode(self.upload_codec, data, peer) for peer, data in got]
        if got and self.probe is not None:
            self.probe.mark("deserialise")
        return out

    def _exchange_shared(self, seq: int, values: list[int], upload: Any, payload: Any):
        """``exchange`` with the ints in shared memory. Rank 0's payload rides the segment's byte
        area (or, too big for it, ZMQ, sent before the ints are published so it is in flight
        once the others learn from them that it comes; the last int says which: 0 none, 1
        shared memory, -1 ZMQ). An upload is encoded and posted after its rank's ints are
        published (into the byte area, or over ZMQ), so no rank waits for it in the round."""
        leader, probe = self.rank == 0, self.probe
        blob = None if payload is None else self.payload_codec[0](payload)
        code = 0 if blob is None else 1 if len(blob) <= self._slots.blob_bytes - 8 else -1
        if leader and code < 0:
            self.transport.send_to_peers(wire.encode(EXCHANGE, seq, None, blob))
        if not leader:
            code = int(upload is not None)
        if probe is not None:
            probe.mark("serialise")

        def post() -> None:
            data = self._encode(upload)
            if len(data) > self._slots.blob_bytes - 8:
                self.transport.send_to_root(wire.encode(UPLOAD, seq, data))
                data = None
            self._slots.post(data)

        try:
            flat, slices = self._slots.gather((*values, code), self.transport.alive, blob if leader and code > 0 else None,
                                              post if not leader and upload is not None else None)
        except SlotsError as e:
            raise CommunicatorError(f"{e} (exchange #{seq})") from None
        except SlotsEnded as e:
            raise LeaderEnded(self.rank, e.status, f"exchange #{seq} ({e})") from None
        self.waited_ns = self._slots.waited_ns
        result = list(map(max, *map(flat.__getitem__, slices)))  # element-wise, no Python frame per rank
        codes = flat[len(values) + 1::len(values) + 2]  # each rank's last int
        del result[-1]
        if probe is not None:
            probe.mark("read")
        if leader:
            self._posting = (seq, [r for r in range(1, self.world_size) if codes[r]])
            self.plain_rounds += blob is None
            self._early += self.transport.take_waiting()  # for their collectives; strangers' frames dropped
            return result, payload
        if codes[0] == 0:
            self.plain_rounds += upload is None
            return result, None
        data = self._recv_from_root(seq, EXCHANGE)[1] if codes[0] < 0 else self._slots.blob(0)
        got = self._decode(self.payload_codec, data, 0)
        if probe is not None:
            probe.mark("deserialise")
        return result, got

    def _take_posted(self) -> list[tuple[int, Any]]:
        """Rank 0: (sender, bytes) of the uploads posted in the latest shared-memory round (each
        at most once), by rank."""
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
                got.append((r, data))
        if over_zmq:
            got += [(r, data) for r, (data,) in self._gather_at_root(seq, UPLOAD, set(over_zmq)).items()]
        return sorted(got, key=lambda x: x[0])

    def _encode(self, upload: Any) -> bytes | None:
        return None if upload is None else self.upload_codec[0](upload)

    def _decode(self, codec: Codec, data, sender: int) -> Any:
        """``codec``'s record of ``data`` from rank ``sender``: a rank of this job that sends bytes
        its codec cannot read is this job's bug, so it raises (it is never dropped silently)."""
        try:
            if type(data) is not bytes and not isinstance(data, memoryview):
                raise wire.WireError("bad field", "not bytes")
            return codec[1](data)
        except wire.WireError as e:
            raise CommunicatorError(f"rank {self.rank}: rank {sender} sent a record that does not decode ({e})") from None

    def broadcast_object(self, obj: Any = None, codec: Codec | None = None) -> Any:
        """Rank 0's ``obj`` on every rank (the others' arguments are ignored): a plain msgpack
        value (tuples arrive as lists), or anything ``codec`` = (encode, decode) turns into
        bytes and back."""
        seq = self._next_seq()
        if self.world_size == 1:
            return obj
        if self.rank == 0:
            self.transport.send_to_peers(wire.encode(BROADCAST, seq, obj if codec is None else codec[0](obj)))
            return obj
        (value,) = self._recv_from_root(seq, BROADCAST)
        return value if codec is None else self._decode(codec, value, 0)

    def all_reduce_max(self, values: list[int]) -> list[int]:
        """Element-wise max of every rank's ``values`` (all of one length), on every rank."""
        seq = self._next_seq()
        values = [int(v) for v in values]
        if self.world_size == 1:
            return values
        if self.rank != 0:
            self.transport.send_to_root(wire.encode(ALL_REDUCE_MAX, seq, values))
            return self._ints(self._recv_from_root(seq, ALL_REDUCE_MAX)[0], 0)
        result = values
        for peer, (theirs,) in self._gather_at_root(seq, ALL_REDUCE_MAX).items():
            theirs = self._ints(theirs, peer)
            if len(theirs) != len(result):
                raise CommunicatorError(
                    f"all_reduce_max #{seq}: rank {peer} sent {len(theirs)} values, rank 0 {len(result)}"
                )
            result = [max(a, b) for a, b in zip(result, theirs)]
        self.transport.send_to_peers(wire.encode(ALL_REDUCE_MAX, seq, result))
        return result

    def barrier(self) -> None:
        self.all_reduce_max([0])

    def announce_end(self, status: int) -> None:
        """Rank 0: the job ends with exit ``status`` (``job_end.announce``; not a collective)."""
        if self.rank == 0 and self.transport is not None:
            job_end.announce(self.transport, self._slots, self.world_size, status)

    def wait_for_end(self) -> int:
        """Another rank, done with its collectives: rank 0's exit status once it announces it."""
        if self.rank == 0 or self.transport is None:
            raise CommunicatorError(f"rank {self.rank}: only another rank of a live job waits for rank 0's end")
        return job_end.wait(self.transport)

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

    def _ints(self, values, sender: int) -> list[int]:
        try:
            return f.int_list(values, "values")
        except wire.WireError:
            raise CommunicatorError(f"rank {self.rank}: rank {sender} sent values that are not ints") from None

    def _check(self, mtype: wire.MessageType, fields: list, seq: int, want: wire.MessageType, sender: str) -> list:
        """The fields after the sequence number of a message that must be collective ``seq`` of type ``want``."""
        if mtype is not want or fields[0] != seq:
            raise CommunicatorError(
                f"rank {self.rank} is in {want.name} #{seq} but {sender} sent {mtype.name} #{fields[0]!r:.20}: "
                "the ranks diverged"
            )
        return fields[1:]

    def _recv_from_root(self, seq: int, want: wire.MessageType) -> list:
        what = f"{want.name} #{seq}"
        mtype, fields = self.transport.recv_from_root(what)
        if mtype is job_end.END:
            raise LeaderEnded(self.rank, int(fields[0]), what)
        return self._check(mtype, fields, seq, want, "rank 0")

    def _gather_at_root(self, seq: int, want: wire.MessageType, peers: set[int] | None = None) -> dict[int, list]:
        """One message from each of ``peers`` (default: every other rank). With shared memory a
        peer can be a round ahead: a message of its next collective that comes first waits in
        ``_early`` (a peer's messages arrive in the order it sent them)."""
        wanted = set(range(1, self.world_size)) if peers is None else peers
        got: dict[int, list] = {}
        early, self._early = self._early, []

        def take(peer: int, mtype: wire.MessageType, fields: list) -> None:
            if peer in wanted and peer not in got:
                got[peer] = self._check(mtype, fields, seq, want, f"rank {peer}")
            elif sum(p == peer for p, _, _ in self._early) < MAX_AHEAD:
                self._early.append((peer, mtype, fields))
            else:
                raise CommunicatorError(f"rank 0 is in {want.name} #{seq} but rank {peer} sent {MAX_AHEAD} messages "
                                        "of later collectives: the ranks diverged")

        for msg in early:
            take(*msg)
        while len(got) < len(wanted):
            for msg in self.transport.recv_from_peers(f"{want.name} #{seq}"):
                take(*msg)
        return got

    def __enter__(self) -> "ZMQCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
