"""What the engine's process and its HTTP front-end processes say to each other (bridge.py,
frontend.py). First the ``FrontendConfig``: one JSON document written to the child's stdin pipe
and read once before it serves; plain values only (no pickle): the tokenizer travels as its
``tokenizer.json`` text and EOS ids, the secret as hex; keys travel in this pipe, never on a
command line. Then messages of the one wire (inference/communication/wire.py: a msgpack array of a
registered type, the server front-ends' values 96-111, each read by a checked reader), over ZMQ
ipc:// sockets in a private directory. A frame that is oversized, does not decode, has an
unknown type or a type its socket does not carry is dropped and counted (``WireStats``), never
unpickled.

Front-end -> engine process: one DEALER per front-end, connected to the bridge's ROUTER, which
it joins through the handshake (communication/handshake.py, role "frontend", its index as the
name, the server's per-run secret from its stdin) before it sends anything:
- ready [];  abort [sid];  query [sid, "metrics" | "health" | "adapters"];  admin [sid, op, args map];
- add [sid, arrival, prompts [ints], choices [[prompt index, sampling map]]] (a prompt that
  several choices share travels once; sampling maps: records.encode_sampling).
Bridge -> front-end (on its DEALER): reply [sid, bytes | bool] (adapters: a JSON list of names).
``sid``: a number the front-end gives each submission, admin call and query.

Engine thread -> front-end (a PUSH per front-end, connected to the PULL the front-end binds, so
that what is sent before the front-end is up waits in ZMQ's queue): ONE step message per engine
step holding every entry of that front-end's submissions, in order, each ``(sid, kind,
payload)`` as the engine loop's outbox has it ("admitted", "rejected", "event", "admin"):
- step [sids ints, choice indices ints, updates, others]: the events that hold only an update
  (every streamed token) as columns, ``updates`` in records.encode_updates' layout; every other
  entry in ``others`` as [position among all entries, sid, kind, ...]: admitted [request ids
  ints], rejected ["invalid" | "blocked" | "error", message], event [choice index, update
  (records.encode_updates of one) | nil, output (records.encode_output) | nil, error | nil],
  admin [status, body map]. python -m benchmarks ipc-encode measures a step."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import zmq

from megatron_async.inference import records
from megatron_async.inference.communication import wire
from megatron_async.inference.communication import wire_fields as f
from megatron_async.inference.request import InvalidRequestError, SamplingParams
from megatron_async.serve.http_guard import HttpPolicy
from megatron_async.serve.submission import Choice, ChoiceEvent, GenerationBlockedError

ROLE = "frontend"
"""The handshake role of a front-end process (communication/handshake.py)."""
MAX_ARGS_DEPTH = 8
MAX_STEP_BYTES = 1 << 31
"""A step message the front-end reads (its sender is the engine thread; outputs with prompt
log-probs can be large)."""


def max_frame_bytes(max_request_bytes: int) -> int:
    """The largest message a front-end sends the engine's process: what a body of at most
    ``max_request_bytes`` can become (a token is at least 1 body byte and travels as 8; a prompt
    that several choices share travels once). A front-end refuses a larger one itself."""
    return 16 * max_request_bytes + (1 << 20)


# ---------------------------------------------------------------------- front-end -> engine
@wire.reader
def _read_add(v: list) -> list:
    sid, arrival, prompts, choices = v
    prompts = [f.ints(p, "prompt_tokens") for p in f.list_(prompts, "prompts")]
    out = []
    for pair in f.list_(choices, "choices"):
        at, sampling = f.arity(pair, 2, "choice")
        out.append(Choice(prompts[f.int_(at, "prompt index", 0, len(prompts) - 1)],
                          SamplingParams(**records.sampling_fields(sampling))))
    if not out:
        raise f.bad("choices")
    return [f.int_(sid, "sid"), f.float_(arrival, "arrival"), out]


def _sid(v: list) -> list:
    return [f.int_(v[0], "sid")]


READY = wire.message_type("frontend ready", 96, arity=0, reader=lambda v: [])
ADD = wire.message_type("frontend add", 97, arity=4, reader=_read_add)
ABORT = wire.message_type("frontend abort", 98, arity=1, reader=_sid)
ADMIN = wire.message_type("frontend admin", 99, arity=3, reader=lambda v: [
    f.int_(v[0], "sid"), f.str_(v[1], "op", 64), f.plain(f.dict_(v[2], "args"), "args", MAX_ARGS_DEPTH)])
QUERY = wire.message_type("frontend query", 100, arity=2, reader=lambda v: [
    f.int_(v[0], "sid"), f.str_(v[1], "query", 16)])
FRONTEND_SENDS = frozenset({READY, ADD, ABORT, ADMIN, QUERY})
"""What the bridge takes from a front-end (anything else: dropped as "wrong role")."""


def encode_add(sid: int, choices: list[Choice], arrival: float) -> bytes:
    prompts, at = [], {}
    for c in choices:
        if id(c.prompt_tokens) not in at:
            at[id(c.prompt_tokens)] = len(prompts)
            prompts.append(f.pack_ints(c.prompt_tokens))
    return wire.encode(ADD, sid, arrival, prompts,
                       [[at[id(c.prompt_tokens)], records.encode_sampling(c.params)] for c in choices])


# ---------------------------------------------------------------------- bridge -> front-end
def _read_reply(v: list) -> list:
    sid, value = v
    if type(value) not in (bytes, bool):
        raise f.bad("reply")
    return [f.int_(sid, "sid"), value]


REPLY = wire.message_type("frontend reply", 101, arity=2, reader=_read_reply)


# ---------------------------------------------------------------------- engine thread -> front-end
_REJECTIONS = {"invalid": InvalidRequestError, "blocked": GenerationBlockedError, "error": RuntimeError}


def _rejection_kind(e: BaseException) -> str:
    return "invalid" if isinstance(e, InvalidRequestError) else "blocked" if isinstance(e, GenerationBlockedError) \
        else "error"


def _write_other(pos: int, sid: int, kind: str, payload) -> list:
    if kind == "admitted":
        return [pos, sid, kind, f.pack_ints(payload)]
    if kind == "rejected":
        return [pos, sid, kind, _rejection_kind(payload), str(payload)]
    if kind == "admin":
        status, body = payload
        return [pos, sid, kind, status, body]
    index, update, output, error = payload
    return [pos, sid, "event", index, None if update is None else records.encode_updates([update]),
            None if output is None else records.encode_output(output), error]


def _read_other(v) -> tuple[int, tuple[int, str, Any]]:
    pos, sid, kind, *rest = f.list_(v, "entry")
    pos, sid = f.int_(pos, "position", 0), f.int_(sid, "sid")
    if kind == "admitted":
        (ids,) = f.arity(rest, 1, kind)
        return pos, (sid, kind, f.ints(ids, "request ids"))
    if kind == "rejected":
        why, message = f.arity(rest, 2, kind)
        return pos, (sid, kind, _REJECTIONS[f.str_(why, "rejection")](f.str_(message, "message")))
    if kind == "admin":
        status, body = f.arity(rest, 2, kind)
        return pos, (sid, kind, (f.int_(status, "status", 100, 599), f.plain(f.dict_(body, "body"), "body",
                                                                               MAX_ARGS_DEPTH)))
    if kind != "event":
        raise f.bad("entry kind")
    index, update, output, error = f.arity(rest, 4, kind)
    if update is not None:
        update = records.decode_updates(update)
        if len(update) != 1:
            raise f.bad("update")
        update = update[0]
    return pos, (sid, kind, ChoiceEvent(f.int_(index, "choice index", 0), update,
                                        None if output is None else records.decode_output(output),
                                        f.opt_str(error, "error")))


_new = tuple.__new__  # a NamedTuple built in C, every field given


@wire.reader
def _read_step(v: list) -> list[tuple[int, str, Any]]:
    sids, indices, updates, others = v
    sids, indices, updates = f.ints(sids, "sids"), f.ints(indices, "choice indices"), records.decode_updates(updates)
    if len(sids) != len(updates) or len(indices) != len(updates) or min(indices, default=0) < 0:
        raise f.bad("step")
    plain = list(zip(sids, repeat("event"), map(_new, repeat(ChoiceEvent), zip(indices, updates, repeat(None),
                                                                               repeat(None)))))
    if not others:
        return plain
    out, at = [], 0
    for entry in f.list_(others, "entries"):
        pos, entry = _read_other(entry)
        take = pos - len(out)  # the updates before this entry (positions only grow)
        if take < 0 or at + take > len(plain):
            raise f.bad("position")
        out += plain[at:at + take]
        out.append(entry)
        at += take
    return out + plain[at:]


STEP = wire.message_type("frontend step", 102, arity=4, reader=_read_step)


def encode_entries(entries: list[tuple[int, str, Any]]) -> bytes:
    """One step's ``(sid, kind, payload)`` entries for one front-end, as one step message."""
    sids, indices, updates, others = [], [], [], []
    for sid, kind, payload in entries:  # (one pass, nothing allocated per update)
        if kind == "event" and payload[2] is None and payload[3] is None and payload[1] is not None:
            sids.append(sid)
            indices.append(payload[0])
            updates.append(payload[1])
        else:
            others.append(_write_other(len(sids) + len(others), sid, kind, payload))
    return wire.encode(STEP, f.pack_ints(sids), f.pack_ints(indices), records.encode_updates(updates), others)


def decode_entries(message: bytes | memoryview, max_bytes: int = MAX_STEP_BYTES) -> list[tuple[int, str, Any]]:
    """``encode_entries``' entries back, in order; ``WireError`` for any frame that is not a
    valid step message (its ``reason`` names the counter it is dropped into)."""
    mtype, fields = wire.decode(message, max_bytes)
    if mtype is not STEP:
        raise wire.WireError("wrong role", mtype.name)
    return STEP.read(fields)


# ---------------------------------------------------------------------- sockets
def socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    """A socket of either side: no send or receive limit (a slow front-end buffers; the engine
    thread never blocks on it), nothing kept at close."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


class Endpoints:
    """The sockets' addresses: ipc:// paths in a directory of their own, only this user may enter
    (``create`` makes one with mkdtemp: 0700, ``remove`` deletes it); a front-end process is
    told its ``directory``."""

    def __init__(self, directory: str):
        self.directory = directory

    @classmethod
    def create(cls) -> Endpoints:
        return cls(tempfile.mkdtemp(prefix="megatron-async-"))

    @property
    def bridge(self) -> str:
        return f"ipc://{os.path.join(self.directory, 'bridge')}"

    @property
    def job(self) -> bytes:
        """The handshake's listener id (not secret): this server's directory."""
        return self.directory.encode()

    def events(self, frontend: int) -> str:
        return f"ipc://{os.path.join(self.directory, f'events-{frontend}')}"

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


# ---------------------------------------------------------------- the front-end's start-up
@dataclass
class FrontendConfig:
    index: int
    directory: str
    """The ipc sockets' private directory (ipc.Endpoints)."""
    secret: bytes
    """What the front-end proves to the engine process's bridge (communication/handshake.py)."""
    fd: int
    """Its listening socket, inherited (its own, or the one all front-ends share: launch.bind_group)."""
    parent_pid: int
    model_name: str
    tokenizer: Any
    """models/tokenizer.py's ``Tokenizer``, or None."""
    chat_template: tuple[str, dict] | None
    """(source, special tokens) of the ChatTemplate."""
    max_model_len: int
    max_requests: int
    max_request_bytes: int
    created: int
    tool_call_parser: str | None
    reasoning_parser: str | None
    admin_endpoints: bool
    grammars: tuple | None = None
    """The engine's ``Grammars.settings()`` (None: structured outputs off): the front-end checks
    a request's constraint with a ``Grammars`` of its own."""
    policy: HttpPolicy = HttpPolicy()
    """Keys, limits, TLS."""
    log_level: str = "warning"
    http: str = "auto"
    loop: str = "auto"

    def to_json(self) -> bytes:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        tok = self.tokenizer
        out.update(secret=self.secret.hex(), policy=dataclasses.asdict(self.policy), tokenizer=None if tok is None else {
            "json": tok.backend_tokenizer.to_str(), "eos_token_ids": list(tok.eos_token_ids)})
        return json.dumps(out).encode()

    @classmethod
    def from_json(cls, data: bytes) -> FrontendConfig:
        """``to_json``'s config back (ValueError / TypeError / KeyError for anything else)."""
        fields = json.loads(data)
        if type(fields) is not dict:
            raise ValueError("a front-end's configuration is a JSON object")
        policy = fields.pop("policy")
        policy["allowed_origins"] = tuple(policy["allowed_origins"])
        tok = fields.pop("tokenizer")
        if tok is not None:
            import tokenizers

            from megatron_async.models.tokenizer import Tokenizer

            tok = Tokenizer(tokenizers.Tokenizer.from_str(tok["json"]), tuple(tok["eos_token_ids"]))
        secret, template, grammars = fields.pop("secret"), fields.pop("chat_template"), fields.pop("grammars")
        return cls(**fields, secret=bytes.fromhex(secret), policy=HttpPolicy(**policy), tokenizer=tok,
                   chat_template=None if template is None else tuple(template),
                   grammars=None if grammars is None else (tuple(grammars[0]), *grammars[1:]))
