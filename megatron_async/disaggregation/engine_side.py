"""An engine's side of the hand-off, beside its coordinator link (dp_engine/link.py): the state
of each request it hands off or takes over, and the pair connections its KV travels on.

Prefill engine, per request: PREFILLING (queued with ``prefill``: capped at its first token) ->
READY (the token landed: it rode the step's outputs, without its text, which the decode engine
streams; kv_ready sent, the blocks kept) -> SENDING (kv_send: packed and queued on the pair's
connection) -> freed at kv_release (the decode engine holds it, or is gone). A request that
truly ends at its first token (EOS, a stop word, an abort) ends here as on a mixed engine.

Decode engine, per request: DEFERRED (kv_import while it has no request place or blocks: it
waits, in order; never allocates past its pool) -> RECEIVING (blocks allocated, the receive
queued, kv_accepted sent) -> admitted decoding (kv_imported), or freed (kv_cancel, a broken
connection: kv_failed).

A loop turn's hand-off work is bounded: one-time set-up happens at the engine's start (the
transfer kernel's variants compiled and loaded, its table built: ``KVLayout.warm_up``) or on a
connection's own thread (its group, proof and staging buffers), and a turn admits at most
``ADMITS_PER_TURN`` deferred imports and ``LANDS_PER_TURN`` ended ones (the rest wait for the next
turns, which poll without sleeping meanwhile). ``LoopTimes`` names what each turn spent its time on."""
from __future__ import annotations

import logging
import time
from collections import deque

import torch

from megatron_async.disaggregation import ipc_share
from megatron_async.disaggregation.ipc_import import SharedImports
from megatron_async.disaggregation.kv_import import (PrefillHold, admit_decoding, allocate, cached_prefix,
                                                     prefix_keys, room_for)
from megatron_async.disaggregation.kv_layout import KVLayout
from megatron_async.disaggregation.kv_stream import CHUNK_BYTES
from megatron_async.disaggregation.loop_times import LoopTimes
from megatron_async.disaggregation.transfer import PairChannel, Rendezvous, TransferTimes, resolve_backend, store_host
from megatron_async.inference.records import decode_sampling

log = logging.getLogger("megatron_async.disaggregation")
INBOUND = frozenset({"kv_import", "kv_send", "kv_release", "kv_cancel", "kv_shared"})
ADMITS_PER_TURN = 2
"""Deferred imports given blocks and a posted receive per loop turn (each costs host time in
proportion to its blocks: ~1-3 ms for an 8k-token prompt)."""
LANDS_PER_TURN = 2
"""Ended imports admitted decoding per loop turn (likewise)."""


def _tag(rid: int) -> int:
    return rid % (1 << 31)


class EngineHandOffs:
    INBOUND = INBOUND

    def __init__(self, link, role: str, backend: str, coordinator_address: str, one_launch: bool = False):
        engine = link.engine
        self.link, self.engine, self.role = link, engine, role
        device = engine.context.kv_caches[0].device if engine.context.kv_caches else engine.context.device.device
        self.device = device
        self.backend = resolve_backend(backend, device)
        self.layout = KVLayout(engine.context, one_launch=None if one_launch else False)  # (None: where it can)
        self.rendezvous = Rendezvous(store_host(coordinator_address)) if role == "decode" else None
        if self.backend == "ipc" and device.type == "cpu":
            ipc_share.prepare_host_sharing()
        self.shared: dict[int, object] = {}  # rid -> the packed blocks an "ipc" pair shares
        self.warmup_seconds = self.layout.warm_up() if device.type == "cuda" else 0.0
        """The start's one-time set-up of the transfer kernel (never inside a loop turn)."""
        self.hold = PrefillHold(engine, self.layout) if role == "prefill" else None
        self.channels: dict[str, PairChannel] = {}
        self.spent: dict[str, str] = {}
        """Pair keys whose connection was refused or broke -> why: a transfer still coming with one
        (sent before the coordinator heard and gave the pair a new key) fails at once."""
        self.handed: list[int] = []  # engine ids that stopped at their first token, kv_ready not yet sent
        self.ready: dict[int, int] = {}  # rid -> engine id, blocks kept (READY, SENDING)
        self.unsent: set[int] = set()  # rids announced (kv_ready) whose kv_send has not come (mid_step.py)
        self.sending: dict[tuple[str, int], int] = {}  # (connection, tag) -> blocks of a send not yet seen to end
        self.deferred: deque[list] = deque()  # kv_import fields waiting for room
        self.waiting: deque[list] = deque()  # prefill submissions waiting for room beside the kept blocks
        self.receiving: dict[int, tuple[list, list[int], int]] = {}  # rid -> (kv_import fields, blocks, cached)
        self.cancelled: set[int] = set()  # rids cancelled while their receive was queued
        self.arrived: deque[tuple[int, object, str | None]] = deque()  # (rid, fill, error): ended, not yet admitted
        self.admits_capped = False  # the last turn left deferred imports it could have admitted
        self.kv_sent_blocks = self.kv_received_blocks = self.kv_cached_blocks = self.deferred_imports = 0
        self.times = TransferTimes()
        """The transfers' own time: this prefill engine's sends, this decode engine's ipc copies."""
        self.shared_imports = SharedImports(self.layout, CHUNK_BYTES, self.times)
        self.loop = LoopTimes()
        """The engine loop's own time in hand-off work (what its steps wait for)."""
        self.posted_at: dict[int, float] = {}  # rid -> when its receive was posted (decode side)
        self.keys: dict[int, list] = {}  # rid -> its prompt's block keys, while its import is deferred
        self.chunk_bytes = CHUNK_BYTES
        """The staging chunk of this engine's connections (both ends of a pair chunk alike)."""
        self.transfer_hook = None
        """A test's hook, run on a connection's thread before a transfer is handed back (PairChannel)."""
        self.mid_step = None
        """A prefill engine's kv_sends started while a step runs (mid_step.py; set by dp_engine/link.py)."""

    @property
    def kv_address(self) -> str:
        return self.rendezvous.address if self.rendezvous is not None else ""

    def in_flight(self) -> bool:
        """Transfers queued on a connection (the loop polls them instead of sleeping)."""
        return (bool(self.shared_imports) or bool(self.arrived) or self.admits_capped
                or any(channel.pending for channel in self.channels.values()))

    # ---------------------------------------------------------------- prefill side
    def prefill(self, fields: list) -> None:
        """A ``prefill`` submission: queued as a route's is (link.py), capped at its first token,
        once the blocks this engine keeps for transfers leave room for its whole prompt (else it
        waits here, in order: kept blocks must never starve the prompts being computed)."""
        self.waiting.append(fields)
        self._admit_prefills()

    def _admit_prefills(self) -> None:
        while self.waiting and self.hold.fits(self.waiting[0][2]):
            fields = self.waiting.popleft()
            self.hold.submit(lambda: self.link.submit(*fields))

    def admit_waiting(self, rid: int | None = None) -> int | None:
        """Queue the waiting ``prefill`` of ``rid`` (None: every one) now, uncapped, to be
        aborted (its end reported as any other's); its engine id."""
        local = None
        for fields in [f for f in self.waiting if rid is None or f[0] == rid]:
            self.waiting.remove(fields)
            local = self.link.submit(*fields)
        return local

    def landed(self, res) -> None:
        """A step's outputs: requests that stopped at their first token leave ``res.finished``
        (they continue elsewhere) and their update is an unfinished one without text."""
        if self.hold is None or not res.finished:
            return
        handed = {out.request_id for out in res.finished
                  if self.hold.handed(out.request_id, out.finish_reason, len(out.generated_tokens))}
        if not handed:
            return
        res.finished[:] = [o for o in res.finished if o.request_id not in handed]
        res.updates[:] = [u._replace(finished=False, finish_reason=None, new_text=None) if u.request_id in handed
                          else u for u in res.updates]
        self.handed += handed

    def _send(self, rid: int, pair, cached: int = 0) -> None:
        """Queue the blocks after ``cached`` on the pair's connection (gathered there, on its stream)."""
        self.unsent.discard(rid)
        local = self.ready.get(rid)
        if local is None:
            self.link.channel.send("kv_failed", rid, "the prefill engine holds no blocks for it")
            return
        blocks = self.hold.num_blocks(local) - cached
        if (why := self._spent(pair)) is not None:
            self.link.channel.send("kv_failed", rid, why)
            return
        if pair[3] == "ipc":
            try:
                self.shared[rid], payload = ipc_share.share(self.hold.pack(local, cached))
            except Exception as e:  # noqa: BLE001 -- this transfer fails alone
                self.link.channel.send("kv_failed", rid, f"could not share the blocks: {type(e).__name__}: {e}")
                return
            self.kv_sent_blocks += blocks
            self.link.channel.send("kv_shared", rid, payload)
            return
        channel = self._channel(pair)
        self.sending[(channel.key, _tag(rid))] = blocks  # (counted when seen to end: after kv_release, maybe)
        block_ids, state = self.hold.kept[local]
        # (waits for the step that wrote them, not for the prompts' steps launched since)
        channel.send_blocks(_tag(rid), self.layout, block_ids[cached:], state, self.hold.written.get(local))

    def _release(self, rid: int) -> None:
        self.unsent.discard(rid)
        local = self.ready.pop(rid, None)
        if local is not None:
            self.hold.release(local)
        self.shared.pop(rid, None)

    # ---------------------------------------------------------------- decode side
    def _try_imports(self) -> None:
        admitted, self.admits_capped = 0, False
        while self.deferred:
            if admitted == ADMITS_PER_TURN:
                self.admits_capped = True
                return
            fields = self.deferred[0]
            blocks = fields[10]
            if fields[11][3] == "local":
                if not room_for(self.engine, 0, len(self.receiving)):
                    return
                self.deferred.popleft()
                self._adopt(fields)
                admitted += 1
                continue
            if (why := self._spent(fields[11])) is not None:  # (nothing allocated, no receive posted)
                self.deferred.popleft()
                self.link.channel.send("kv_failed", fields[0], why)
                continue
            keys = self.keys.get(fields[0])
            if keys is None:
                keys = self.keys[fields[0]] = prefix_keys(self.engine, fields[2], fields[5], blocks)
            cached = cached_prefix(self.engine, keys)
            if not room_for(self.engine, blocks - len(cached), len(self.receiving)):
                return
            self.deferred.popleft()
            self.keys.pop(fields[0], None)
            block_ids = allocate(self.engine, blocks, cached)
            if fields[11][3] != "ipc":  # (an ipc pair's blocks arrive as kv_shared)
                self._channel(fields[11]).recv_blocks(_tag(fields[0]), self.layout, block_ids[len(cached):])
            self.posted_at[fields[0]] = time.perf_counter()
            self.receiving[fields[0]] = (fields, block_ids, len(cached))
            self.kv_cached_blocks += len(cached)
            self.link.channel.send("kv_accepted", fields[0], len(cached))
            admitted += 1

    def _imported(self, rid: int, fill, error: str | None) -> None:
        """The receive of ``rid`` ended: ``fill(slot)`` puts what is not in its blocks yet into the
        admitted request (its Mamba state)."""
        fields, block_ids, cached = self.receiving.pop(rid, (None, None, 0))
        if fields is None:
            return
        posted = self.posted_at.pop(rid, None)
        if posted is not None and error is None:
            self.loop.imported(time.perf_counter() - posted)
        if error is None and rid not in self.cancelled:
            rid, seq, prompt, sampling, stream, digests, reply, tokens, lps, version, blocks, _ = fields
            try:
                params = decode_sampling(sampling, frozen=False)
                local = admit_decoding(self.engine, prompt, params, digests, tokens, lps, version, block_ids, fill)
            except Exception as e:  # noqa: BLE001 -- refused alone: its blocks go back
                error = f"the decode engine could not admit it: {type(e).__name__}: {e}"
            else:
                self.kv_received_blocks += blocks - cached
                self.link.track(rid, seq, local, stream, reply)
                self.link.channel.send("kv_imported", rid, blocks - cached)
                return
        self.engine.context.allocator.release(block_ids)
        if rid not in self.cancelled:
            self.link.channel.send("kv_failed", rid, error)
        self.cancelled.discard(rid)

    def _adopt(self, fields: list) -> None:
        """No decode engine is left: this prefill engine decodes the request with the blocks it kept."""
        rid, seq, prompt, sampling, stream, digests, reply, tokens, lps, version, blocks, _ = fields
        self.unsent.discard(rid)
        local = self.ready.pop(rid, None)
        if local is None:
            self.link.channel.send("kv_failed", rid, "the prefill engine holds no blocks for it")
            return
        block_ids, state = self.hold.take(local)
        try:
            new = admit_decoding(self.engine, prompt, decode_sampling(sampling, frozen=False), digests, tokens, lps,
                                 version, block_ids, lambda slot: self.layout.put_state(state, slot))
        except Exception as e:  # noqa: BLE001 -- refused alone: its blocks go back
            self.engine.context.allocator.release(block_ids)
            self.link.channel.send("kv_failed", rid, f"could not decode it here: {type(e).__name__}: {e}")
            return
        self.link.track(rid, seq, new, stream, reply)
        self.link.channel.send("kv_imported", rid, 0)

    def _mapped(self, rid: int, payload: dict) -> None:
        """An "ipc" pair's blocks: mapped, then copied into its blocks off the compute stream
        (ipc_import.py: the transfer, timed); the request lands at a later poll."""
        if rid not in self.receiving or rid in self.shared_imports:
            return
        fields, block_ids, cached = self.receiving[rid]
        try:
            shared = ipc_share.open_shared(payload, self.layout.nbytes(len(block_ids) - cached))
        except Exception as e:  # noqa: BLE001 -- this import fails alone
            self._imported(rid, None, f"could not map the shared blocks: {type(e).__name__}: {e}")
            return
        self.shared_imports.start(rid, shared, block_ids[cached:])

    def _cancel(self, rid: int) -> None:
        for fields in self.deferred:
            if fields[0] == rid:
                self.deferred.remove(fields)
                self.keys.pop(rid, None)
                return
        if rid in self.receiving:
            self.cancelled.add(rid)  # its blocks go back when its receive ends (the buffer is the transfer's)
            if self.receiving[rid][0][11][3] == "ipc" and rid not in self.shared_imports:  # (no copy: now)
                self._imported(rid, None, "cancelled")
            return
        self.link.handle("abort", (rid,))  # already decoding here

    # ---------------------------------------------------------------- both
    def handle(self, kind: str, fields: list) -> None:
        self.loop.messages += 1
        with self.loop.timed(), self.loop.part("message"):
            self._handle(kind, fields)

    def handle_now(self, kind: str, fields: list) -> None:
        """A message handled inside a step (mid_step.py): not a loop turn's work."""
        self._handle(kind, fields)

    def _handle(self, kind: str, fields: list) -> None:
        if kind == "kv_import":
            self.deferred.append(fields)
            if len(self.deferred) > 1 or not room_for(self.engine, fields[10], len(self.receiving)):
                self.deferred_imports += 1
        elif kind == "kv_send":
            self._send(*fields)
        elif kind == "kv_release":
            self._release(fields[0])
        elif kind == "kv_cancel":
            self._cancel(fields[0])
        elif kind == "kv_shared":
            self._mapped(*fields)

    def poll(self) -> None:
        """Once a loop turn, after the step's outputs were sent: announce the requests that
        stopped at their first token, admit deferred imports, land finished transfers (those
        whose end event passed: the request joins the next step)."""
        with self.loop.timed():
            self._poll()

    def _poll(self) -> None:
        with self.loop.part("announce"):
            for local in self.handed:
                rid = self.link.detach(local)
                if rid is None:  # (not the coordinator's: freed)
                    self.hold.release(local)
                    continue
                self.ready[rid] = local
                self.unsent.add(rid)
                self.link.channel.send("kv_ready", rid, self.hold.num_blocks(local), self.engine.weight_version)
            self.handed.clear()
            if self.waiting:
                self._admit_prefills()
        if self.deferred:
            with self.loop.part("admit"):
                self._try_imports()
        for rid, state in self.shared_imports.landed():
            self.arrived.append((rid, lambda slot, state=state: self._put_state(state, slot), None))
        for channel in list(self.channels.values()):
            for tag, buf, error, seconds in channel.take_done():
                self._landed(channel.key, tag, buf, error, seconds)
            if channel.error is not None and not channel.pending:  # (refused or broken: its transfers all ended)
                channel.close()
                self.channels.pop(channel.key, None)
                self.spent[channel.key] = channel.error
        if self.arrived:
            with self.loop.part("land"):
                for _ in range(min(LANDS_PER_TURN, len(self.arrived))):
                    self._imported(*self.arrived.popleft())
        self.times.settle()

    def _landed(self, key: str, tag: int, buf, error: str | None, seconds: float = 0.0) -> None:
        if self.role == "decode":
            rid = next((r for r in self.receiving if _tag(r) == tag), None)
            if rid is not None:  # (admitted by a later part of the turn, a few a turn)
                self.arrived.append((rid, lambda slot, buf=buf: self._put_state(buf, slot), error))
            return
        # A send is matched by its own entry, not by the blocks kept for it: the decode engine's
        # import, and so the coordinator's kv_release, may come before this loop sees the send end.
        blocks = self.sending.pop((key, tag), None)
        if blocks is None:
            return
        if error is None:  # (kv_sent_blocks: blocks whose send completed)
            self.kv_sent_blocks += blocks
            self.times.add(self.layout.nbytes(blocks), seconds)
        # else: its decode engine died (the coordinator places the transfer again, and this engine
        # sends again on a new connection) or the group broke (its receive fails too: kv_failed)

    def _put_state(self, buf, slot: int) -> None:
        """A received Mamba state (bytes the connection's stream wrote, ended) into ``slot``."""
        self.layout.unpack_state(buf, slot)
        if buf is not None and buf.is_cuda:  # (read on this stream: not reused by the connection's before)
            buf.record_stream(torch.cuda.current_stream(buf.device))

    def _spent(self, pair) -> str | None:
        """Why ``pair``'s key can carry no transfer (its connection was refused or broke), or None."""
        channel = self.channels.get(pair[0])
        error = channel.error if channel is not None else self.spent.get(pair[0])
        return None if error is None else f"the pair's KV transfer connection was refused or broke: {error}"

    def _channel(self, pair) -> PairChannel:
        key, address, rank, backend = pair
        channel = self.channels.get(key)
        if channel is None:
            with self.loop.part("connect"):  # (its group, proof and buffers: on its own thread)
                channel = self.channels[key] = PairChannel(key, address, rank, backend, self.device,
                                                           self.rendezvous if rank == 1 else None, self.chunk_bytes,
                                                           self.transfer_hook)
        return channel

    def counters(self) -> dict:
        return {"kv_sent_blocks": self.kv_sent_blocks, "kv_received_blocks": self.kv_received_blocks,
                "kv_cached_blocks": self.kv_cached_blocks,
                "kv_deferred_imports": self.deferred_imports, "kv_blocks_held": sum(
                    self.hold.num_blocks(local) for local in self.ready.values()) if self.hold else 0,
                "kv_warmup_seconds": self.warmup_seconds,
                "kv_connect_max_seconds": max((c.setup_seconds for c in self.channels.values()), default=0.0),
                **self.times.counters(), **self.loop.counters(),
                **(self.mid_step.counters() if self.mid_step else {"kv_sends_mid_step": 0, "kv_mid_step_seconds": 0.0})}

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
