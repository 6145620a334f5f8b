"""What the ranks' per-step exchange carries, on the wire (communication/wire.py): rank 0's news
down, a data-parallel rank's results up, and the outputs ``LLM.generate`` hands to every rank.
Each record is written and read explicitly, with the checked conversions of wire_fields.py: no
pickle, and no value reaches an engine unchecked.

Layouts (msgpack; "ints" = int64 little-endian bin; sampling parameters, outputs and updates
as records.py writes them):
- NewRequest: [prompt ints, sampling map, stop sequences [ints], stop strings [str], eos ids ints,
  banned ids ints, banned sequences [ints], request_id, seed, rank, prompt block digests bin
  (32 bytes each, empty unless rank 0 hashed the prompt to route it)].
- payload (rank 0's news of one exchange): [[NewRequest], abort ids ints, quiet ids ints].
- upload: [updates, [RequestOutput], dp_rank, requests received, evicted routing keys ints];
  generate's slots: [request_id | RequestOutput]; its outputs: [RequestOutput]."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from megatron_async.inference.communication import wire
from megatron_async.inference.communication import wire_fields as f
from megatron_async.inference.contexts.kv_block_allocator import DIGEST_BYTES
from megatron_async.inference.engines.request_validation import ValidRequest
from megatron_async.inference.records import decode_output, decode_sampling, decode_updates, encode_output, encode_sampling, encode_updates
from megatron_async.inference.request import RequestOutput, RequestUpdate

MAX_RECORD_BYTES = 64 << 20
"""Largest record read back (the sockets refuse larger frames before this is reached)."""


@dataclass(frozen=True)
class NewRequest:
    valid: ValidRequest
    request_id: int
    seed: int
    """The seed rank 0 drew (or the request's own), so every rank samples the same stream."""
    rank: int = 0
    """The data-parallel rank that serves it (every TP rank of it; always 0 under tensor parallelism alone)."""
    digests: bytes = b""
    """The chained digests of the prompt's blocks (``prefix_digests``, 32 bytes each) where rank 0
    (or a client of the coordinator) computed them to route it: the serving rank takes them instead
    of hashing the prompt again."""


class Upload(NamedTuple):
    """One rank's results handed up in one exchange (``StepResult``'s two lists), and what its
    prefix cache reclaimed (rank_router.py)."""

    finished: list[RequestOutput]
    updates: list[RequestUpdate]
    dp_rank: int = 0
    """The data-parallel rank it comes from."""
    received: int = 0
    """Requests routed to that rank it had received when it took ``evicted``."""
    evicted: bytes = b""
    """The routing keys (``dp_routing.packed_keys``, 8 bytes each) of the cached blocks it reclaimed."""


# ------------------------------------------------------------------ rank 0's news
def _new_request(n: NewRequest) -> list:
    v = n.valid
    return [f.pack_ints(v.prompt_tokens), encode_sampling(v.sampling_params),
            [f.pack_ints(s) for s in v.stop_sequences], list(v.stop_strings), f.pack_ints(sorted(v.eos_ids)),
            f.pack_ints(v.banned_ids), [f.pack_ints(s) for s in v.banned_sequences], n.request_id, n.seed, n.rank,
            n.digests]


def _read_new_request(v) -> NewRequest:
    prompt, sp, seqs, strs, eos, banned, words, rid, seed, rank, digests = f.arity(v, 11, "new_request")
    prompt = f.ints(prompt, "prompt_tokens")
    if type(digests) is not bytes or len(digests) % DIGEST_BYTES or len(digests) // DIGEST_BYTES > len(prompt):
        raise f.bad("digests")
    valid = ValidRequest(prompt, decode_sampling(sp),
                         [f.ints(s, "stop_sequences") for s in f.list_(seqs, "stop_sequences")],
                         [f.str_(s, "stop_strings") for s in f.list_(strs, "stop_strings")],
                         frozenset(f.ints(eos, "eos_ids")), tuple(f.ints(banned, "banned_ids")),
                         tuple(tuple(f.ints(w, "banned_sequences")) for w in f.list_(words, "banned_sequences")))
    return NewRequest(valid, f.int_(rid, "request_id"), f.int_(seed, "seed", 0), f.int_(rank, "rank", 0, 1 << 20),
                      digests)


def encode_payload(payload: tuple) -> bytes:
    """(news, aborts, quiet ids): rank 0's payload of one exchange."""
    news, aborts, quiet = payload
    return wire.pack([[_new_request(n) for n in news], f.pack_ints(aborts), f.pack_ints(quiet)])


@wire.reader
def decode_payload(data) -> tuple[list[NewRequest], list[int], list[int]]:
    news, aborts, quiet = f.arity(wire.unpack(data, MAX_RECORD_BYTES), 3, "payload")
    return [_read_new_request(n) for n in f.list_(news, "news")], f.ints(aborts, "aborts"), f.ints(quiet, "quiet")


# ------------------------------------------------------------------ uploads
def encode_upload(up) -> bytes:
    """An ``Upload``, or a ``StepResult`` (its outputs and updates; nothing evicted)."""
    rank, received, evicted = (up.dp_rank, up.received, up.evicted) if type(up) is Upload else (0, 0, b"")
    return wire.pack([encode_updates(up.updates), [encode_output(o) for o in up.finished], rank, received, evicted])


@wire.reader
def decode_upload(data) -> Upload:
    updates, finished, dp_rank, received, evicted = f.arity(wire.unpack(data, MAX_RECORD_BYTES), 5, "upload")
    if type(evicted) is not bytes or len(evicted) % 8:
        raise f.bad("evicted")
    return Upload([decode_output(o) for o in f.list_(finished, "finished")], decode_updates(updates),
                  f.int_(dp_rank, "dp_rank", 0, 1 << 20), f.int_(received, "received", 0), evicted)


# ------------------------------------------------------------------ LLM.generate's slots and outputs
def encode_slots(slots: list) -> bytes:
    """``generate``'s slots: per prompt, its request id or the RequestOutput of its refusal."""
    return wire.pack([s if type(s) is int else encode_output(s) for s in slots])


@wire.reader
def decode_slots(data) -> list:
    return [s if type(s) is int else decode_output(s) for s in f.list_(wire.unpack(data, MAX_RECORD_BYTES), "slots")]


def encode_outputs(done: dict) -> bytes:
    """{request id: RequestOutput} (ids are the outputs' own)."""
    return wire.pack([encode_output(o) for o in done.values()])


@wire.reader
def decode_outputs(data) -> dict:
    outs = [decode_output(o) for o in f.list_(wire.unpack(data, MAX_RECORD_BYTES), "outputs")]
    return {o.request_id: o for o in outs}


SLOTS_CODEC = (encode_slots, decode_slots)
OUTPUTS_CODEC = (encode_outputs, decode_outputs)
"""``broadcast_object`` codecs of ``LLM.generate``'s slots and outputs."""
