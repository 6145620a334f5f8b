"""What the coordinator, its engines and its clients say to each other: message types of the one
wire (communication/wire.py, the control plane's values 32-95), each with its writer and its
checked reader here. Engine records (sampling parameters, updates, outputs) are records.py's.

    frame = encode("abort", rid)                    # a name of ``TYPES``, the fields as below
    name, fields = read(mtype, raw_fields)          # checked fields; WireError: drop and count

A reader raises ``WireError`` for a field of the wrong kind (the receiver drops the message and
counts it); values an engine must judge (a client's sampling parameters, its prompt's tokens)
are checked for kind here and for range by the engine that admits them, which refuses that
request alone. Who sends what (``ENGINE_SENDS``, ``CLIENT_SENDS``, ``COORDINATOR_SENDS``) is
checked by the receiver: anything else is dropped as "wrong role".

Fields after the type (ids are ints; "ints" = int64 little-endian bin):
- client -> coordinator: submit [first id, prompt (str | ints: read as they travel, passed on
  packed), [sampling map], stream, prompt
  block digests bin (32 bytes each) | nil, key epoch], abort [id], abort_all [], control [op id, op, args map], drain
  [op id, engine index], shutdown [op id], engines [op id], reply_at [the ipc:// endpoint its engines
  answer on: client/replies.py].
- coordinator -> engine: route [rid, submission number, prompt, sampling map, stream, prompt block
  digests bin (b"": none), direct reply [client endpoint, client's id] | nil], abort
  [rid], control [op id, op, args], drain [], rejected [-1, message] (registration refused, or declared dead),
  info [map].
- engine -> coordinator: register [[name, max requests, KV capacity in blocks, block size, cache
  key, prefix caching, role ("mixed" | "prefill" | "decode"), KV store address "host:port" | "", KV
  transfer backend, [LoRA adapter names]]], outputs [last submission seen, updates, [output] (read as checked
  records, ``records.CheckedOutput``: the coordinator renumbers them and passes them on), rejected [[rid,
  message]], failed [[rid, message]], evicted keys ints, load, free blocks, new cache key | nil,
  delivered (rids whose output went to their client directly) ints], heartbeat [load, free blocks],
  control_done [op id, status, body map], leave [].
- coordinator -> client: info [map], stream [updates], finished [[output]], rejected [id,
  message], control_done [op id, status, body].
- engine -> client (its reply socket): finished [[output]] (ids the client's).
- the prefill / decode hand-off's (prefill, kv_*): disaggregation/messages.py."""
from __future__ import annotations

from typing import Any, Callable

from megatron_async.coordinator.engines import ROLES, EngineInfo
from megatron_async.disaggregation import messages as handoff
from megatron_async.inference import records
from megatron_async.inference.communication import wire
from megatron_async.inference.communication import wire_fields as f
from megatron_async.inference.contexts.kv_block_allocator import DIGEST_BYTES

MAX_FRAME_BYTES = 64 << 20
MAX_ARGS_DEPTH = 8
"""Nesting of a control operation's arguments or answer (an engine's counters are nested maps)."""

_WRITERS: dict[str, tuple[wire.MessageType, Callable | None]] = {}
TYPES: dict[str, wire.MessageType] = {}


def _type(name: str, value: int, arity, reader: Callable[[list], list] | None = None,
          writer: Callable[..., list] | None = None) -> None:
    TYPES[name] = mt = wire.message_type(name, value, arity, reader)
    _WRITERS[name] = (mt, writer)


def encode(name: str, *fields: Any) -> bytes:
    mt, writer = _WRITERS[name]
    return wire.encode(mt, *(writer(*fields) if writer else fields))


def read(mtype: wire.MessageType, fields: list) -> tuple[str, list]:
    """(name, checked fields) of a decoded message (``WireError`` for a bad one)."""
    return mtype.name, mtype.read(fields)


def decode(frame: bytes, max_bytes: int = MAX_FRAME_BYTES) -> tuple[str, list]:
    """``read`` of one frame (``WireError`` for anything that is not a message of a known type)."""
    return read(*wire.decode(frame, max_bytes))


# ---------------------------------------------------------------------- fields
def _id(v, name: str = "id") -> int:
    return f.int_(v, name)


def _prompt(v):
    """Text, or token ids (ints bin): their values are the engine's to check."""
    return v if type(v) is str else f.ints(v, "prompt")


def _prompt_out(p) -> str | bytes:
    """Token ids packed (a prompt read by the coordinator is already: passed on as it came)."""
    return p if type(p) is str or type(p) is bytes else f.pack_ints(p)


def _prompt_relayed(v) -> str | bytes:
    """A submission's prompt as the coordinator keeps it: text, or its token ids as they travelled
    (int64 bin, checked as ``ints`` checks it; ``requests.prompt_tokens`` unpacks it where read)."""
    return v if type(v) is str else f.packed(v, "prompt")


def _args(v, name: str) -> dict:
    return f.plain(f.dict_(v, name), name, MAX_ARGS_DEPTH)


def _messages(v, name: str) -> list[tuple[int, str]]:
    if type(v) is list and not v:  # (a step's message: mostly none)
        return v
    return [(f.int_(rid, name), f.str_(msg, name)) for rid, msg in (f.arity(p, 2, name) for p in f.list_(v, name))]


def _sampling_map(v) -> dict:
    """A client's sampling parameters as it sent them (records.encode_sampling's map): kinds are
    checked by the engine (records.sampling_fields), which refuses that request alone."""
    return f.plain(f.dict_(v, "sampling_params"), "sampling_params")


# ---------------------------------------------------------------------- client -> coordinator
def _digests(v) -> bytes:
    """Block digests, 32 bytes each (their values are only ever compared: an engine still
    compares a block's tokens, and reads digests only where the first one is its own)."""
    if type(v) is not bytes or len(v) % DIGEST_BYTES:
        raise f.bad("digests")
    return v


def _read_submit(v: list) -> list:
    first, prompt, samplings, stream, digests, epoch = v
    samplings = [_sampling_map(s) for s in f.list_(samplings, "sampling_params")]
    if not samplings:
        raise f.bad("sampling_params")
    return [_id(first), _prompt_relayed(prompt), samplings, f.bool_(stream, "stream"),
            None if digests is None else _digests(digests), f.int_(epoch, "key_epoch")]


_type("submit", 32, 6, _read_submit,
      lambda first, prompt, samplings, stream, digests, epoch: [first, _prompt_out(prompt), samplings, stream,
                                                                digests, epoch])
_type("abort", 38, 1, lambda v: [_id(v[0])])
_type("abort_all", 39, 0)
_type("control", 48, 3, lambda v: [_id(v[0]), f.str_(v[1], "op", 64), _args(v[2], "args")])
_type("drain", 66, (0, 2), lambda v: [_id(x) for x in v])
_type("shutdown", 55, 1, lambda v: [_id(v[0])])
_type("engines", 58, 1, lambda v: [_id(v[0])])
MAX_ENDPOINT_LEN = 256


def _endpoint(v) -> str:
    """A client's reply socket: ipc:// only (a same-host Unix socket; engines check its directory)."""
    if type(v) is not str or not v.startswith("ipc://") or len(v) > MAX_ENDPOINT_LEN:
        raise f.bad("endpoint")
    return v


_type("reply_at", 40, 1, lambda v: [_endpoint(v[0])])


# ---------------------------------------------------------------------- coordinator -> engine / client
def _read_route(v: list) -> list:
    """The sampling map is the coordinator's copy of a client's, read there as ``_sampling_map``;
    the engine's admission reads every field of it (``records.decode_sampling``) and refuses that
    request alone: not walked a second time here."""
    rid, seq, prompt, sampling, stream, digests, reply = v
    if reply is not None:
        endpoint, client_rid = f.arity(reply, 2, "reply")
        reply = (_endpoint(endpoint), _id(client_rid))
    return [_id(rid), _id(seq), _prompt(prompt), f.dict_(sampling, "sampling_params"), f.bool_(stream, "stream"),
            _digests(digests), reply]


_type("route", 33, 7, _read_route,
      lambda rid, seq, prompt, sampling, stream, digests, reply=None: [rid, seq, _prompt_out(prompt), sampling, stream,
                                                                       digests, reply])
_type("rejected", 34, 2, lambda v: [_id(v[0]), f.str_(v[1], "message")])
_type("info", 57, 1, lambda v: [_args(v[0], "info")])
_type("stream", 36, 1, lambda v: [records.decode_updates(v[0])], lambda updates: [records.encode_updates(updates)])
_type("finished", 37, 1, lambda v: [[records.decode_output(o) for o in f.list_(v[0], "finished")]],
      lambda outputs: [[records.encode_output(o) for o in outputs]])
_type("control_done", 56, 3, lambda v: [_id(v[0]), f.int_(v[1], "status"), f.plain(v[2], "body", MAX_ARGS_DEPTH)])


# ---------------------------------------------------------------------- engine -> coordinator
def _read_register(v: list) -> list:
    name, max_requests, capacity, block_size, key, caching, role, kv_address, kv_backend, loras = f.arity(
        v[0], 10, "register")
    role, kv_backend = f.str_(role, "role", 16), f.str_(kv_backend, "kv_backend", 8)
    if role not in ROLES or kv_backend not in handoff.BACKENDS:
        raise f.bad("role")
    return [EngineInfo(f.str_(name, "name", 256), f.int_(max_requests, "max_requests", 1),
                       f.int_(capacity, "capacity_blocks", 0), f.int_(block_size, "block_size", 1),
                       f.bytes_(key, "hash_key"), f.bool_(caching, "prefix_caching"), role,
                       f.str_(kv_address, "kv_address", 256), kv_backend,
                       tuple(f.str_(n, "loras", 256) for n in f.list_(loras, "loras")))]


def _write_register(i: EngineInfo) -> list:
    return [[i.name, i.max_requests, i.capacity_blocks, i.block_size, i.hash_key, i.prefix_caching, i.role,
             i.kv_address, i.kv_backend, list(i.loras)]]


def _read_outputs(v: list) -> list:
    seen, updates, finished, rejected, failed, evicted, load, free, key, delivered = v
    return [_id(seen), records.decode_updates(updates), [records.check_output(o) for o in f.list_(finished, "finished")],
            _messages(rejected, "rejected"), _messages(failed, "failed"),
            [] if evicted == b"" and type(evicted) is bytes else f.ints(evicted, "evicted"),
            f.int_(load, "load", 0), f.int_(free, "free_blocks"), None if key is None else f.bytes_(key, "hash_key"),
            [] if delivered == b"" and type(delivered) is bytes else f.ints(delivered, "delivered")]


def _write_outputs(seen, updates, finished, rejected, failed, evicted, load, free, key, delivered=()) -> list:
    return [seen, records.encode_updates(updates), [records.encode_output(o) for o in finished],
            [list(r) for r in rejected] if rejected else [], [list(r) for r in failed] if failed else [],
            f.pack_ints(evicted) if evicted else b"", load, free, key,
            f.pack_ints(delivered) if delivered else b""]  # (a step's message: mostly empty)


_type("register", 64, 1, _read_register, _write_register)
for _name, _value, _arity, _reader, _writer in handoff.SPECS:  # the hand-off's (disaggregation/messages.py)
    _type(_name, _value, _arity, _reader or (_read_route if _name == "prefill" else None),
          _writer or (_WRITERS["route"][1] if _name == "prefill" else None))
_type("outputs", 35, 10, _read_outputs, _write_outputs)
_type("heartbeat", 65, 2, lambda v: [f.int_(v[0], "load", 0), f.int_(v[1], "free_blocks")])
_type("leave", 67, 0)

CLIENT_SENDS = frozenset({"submit", "abort", "abort_all", "control", "drain", "shutdown", "engines", "reply_at"})
ENGINE_SENDS = frozenset({"register", "outputs", "heartbeat", "control_done", "leave"}) | handoff.ENGINE_SENDS
COORDINATOR_SENDS = frozenset({"route", "abort", "control", "drain", "rejected", "info", "stream", "finished",
                               "control_done"}) | handoff.COORDINATOR_SENDS
ENGINE_REPLIES = frozenset({"finished"})
"""What an engine sends on a client's reply socket."""
