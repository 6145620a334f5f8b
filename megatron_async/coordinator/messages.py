"""What the coordinator, its engines and its clients say to each other, as bytes: every message
is one msgpack array ``[kind, field, ...]`` (no pickle anywhere: a frame can build only msgpack's
plain values). ``kind`` is an int from ``KINDS``; the fields of the kinds that carry engine
records (sampling parameters, updates, outputs, an engine's registration) are converted here,
the others are plain values already (a client sends its sampling parameters as
``sampling_map``s).

``decode`` raises ``MessageError`` for anything that is not a well-formed message of a known kind
(undecodable bytes, an unknown kind, fields of the wrong shape): the receiver drops it. Sampling
parameters travel as the map of their non-default fields and are rebuilt (and range-checked)
only by the engine that admits them."""
from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from megatron_async.coordinator.engines import EngineInfo
from megatron_async.inference.request import RequestOutput, RequestUpdate, SamplingParams
from megatron_async.inference.structured.spec import StructuredOutputs

KINDS = {
    "hello": 1, "challenge": 2, "proof": 3, "welcome": 4,
    "submit": 32, "rejected": 34, "outputs": 35, "stream": 36, "finished": 37, "abort": 38, "abort_all": 39,
    "control": 48, "shutdown": 55, "control_done": 56, "info": 57, "engines": 58,
    "register": 64, "heartbeat": 65, "drain": 66, "leave": 67,
}
"""Message kind -> its value on the wire (values never reused)."""
_NAMES = {v: k for k, v in KINDS.items()}
MAX_FRAME_BYTES = 64 << 20


class MessageError(ValueError):
    """Bytes that are not a message this side takes."""


# ---------------------------------------------------------------------- records
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


def sampling_map(params: SamplingParams) -> dict:
    """The fields of ``params`` that differ from the defaults (a newer engine reads an older client's map)."""
    fields = {k: v for k, v in ((k, getattr(params, k)) for k in _DEFAULTS) if v != _DEFAULTS[k]}
    if "structured_outputs" in fields:
        fields["structured_outputs"] = fields["structured_outputs"].as_fields()
    return fields


def sampling_params(fields: dict) -> SamplingParams:
    """The engine side: raises TypeError / ValueError for a field it does not know (the request is refused)."""
    if not isinstance(fields, dict):
        raise TypeError("sampling parameters must be a map")
    unknown = sorted(set(fields) - set(_DEFAULTS))
    if unknown:
        raise TypeError(f"unknown sampling parameters {unknown}")
    if isinstance(fields.get("structured_outputs"), dict):
        fields = {**fields, "structured_outputs": StructuredOutputs(**fields["structured_outputs"])}
    return SamplingParams(**fields)


def _top_n(entries) -> list | None:
    return None if entries is None else [[list(d), list(d.values())] for d in entries]


def _top_n_back(entries) -> tuple | None:
    return None if entries is None else tuple(dict(zip(ids, lps)) for ids, lps in entries)


def update_fields(u: RequestUpdate) -> list:
    return [u.request_id, list(u.new_tokens), u.new_text, u.finished, u.finish_reason,
            None if u.new_log_probs is None else list(u.new_log_probs), _top_n(u.new_top_n_logprobs),
            None if u.prompt_log_probs is None else list(u.prompt_log_probs), _top_n(u.prompt_top_n_logprobs)]


def update_of(f: list) -> RequestUpdate:
    return RequestUpdate(f[0], tuple(f[1]), f[2], f[3], f[4], None if f[5] is None else tuple(f[5]), _top_n_back(f[6]),
                         None if f[7] is None else tuple(f[7]), _top_n_back(f[8]))


def output_fields(o: RequestOutput) -> list:
    experts = None
    if o.routed_experts is not None:
        arr = o.routed_experts
        experts = [arr.astype("<i2").tobytes(), list(arr.shape)]
    top, ptop = _top_n(o.generated_top_n_logprobs), _top_n(o.prompt_top_n_logprobs)
    return [o.request_id, list(o.prompt_tokens), list(o.generated_tokens), o.generated_text, o.finish_reason,
            o.generated_log_probs, top, o.error, o.weight_versions, o.prompt_log_probs, ptop, experts]


def output_of(f: list) -> RequestOutput:
    experts = None
    if f[11] is not None:
        import numpy as np

        experts = np.frombuffer(f[11][0], dtype="<i2").reshape(f[11][1]).copy()
    top, ptop = _top_n_back(f[6]), _top_n_back(f[10])
    return RequestOutput(f[0], f[1], f[2], f[3], f[4], f[5], None if top is None else list(top), f[7], f[8], f[9],
                         None if ptop is None else list(ptop), experts)


def info_fields(i: EngineInfo) -> list:
    return [i.name, i.max_requests, i.capacity_blocks, i.block_size, i.hash_key, i.prefix_caching]


# ---------------------------------------------------------------------- per kind
def _enc_outputs(seen, updates, finished, rejected, failed, evicted, load, free, key):
    return [seen, [update_fields(u) for u in updates], [output_fields(o) for o in finished], rejected, failed,
            list(evicted), load, free, key]


def _dec_outputs(f):
    seen, updates, finished, rejected, failed, evicted, load, free, key = f
    return [seen, [update_of(u) for u in updates], [output_of(o) for o in finished], [tuple(r) for r in rejected],
            [tuple(r) for r in failed], evicted, load, free, key]


_ENCODE = {
    "outputs": _enc_outputs,
    "stream": lambda updates: [[update_fields(u) for u in updates]],
    "finished": lambda outputs: [[output_fields(o) for o in outputs]],
    "register": lambda info: [info_fields(info)],
}
_DECODE = {
    "outputs": _dec_outputs,
    "stream": lambda f: [[update_of(u) for u in f[0]]],
    "finished": lambda f: [[output_of(o) for o in f[0]]],
    "register": lambda f: [EngineInfo(*f[0])],
}
_ARITY = {"hello": 4, "challenge": 2, "proof": 1, "welcome": 1, "submit": (5, 6), "rejected": 2, "outputs": 9,
          "stream": 1, "finished": 1, "abort": 1, "abort_all": 0, "control": 3, "shutdown": 1, "control_done": 3,
          "info": 1, "engines": 1, "register": 1, "heartbeat": 2, "drain": (0, 2), "leave": 0}


def encode(kind: str, *fields: Any) -> bytes:
    enc = _ENCODE.get(kind)
    return msgpack.packb([KINDS[kind], *(enc(*fields) if enc else fields)], use_bin_type=True)


def decode(frame: bytes, max_bytes: int = MAX_FRAME_BYTES, allowed: frozenset[str] | None = None) -> tuple[str, list]:
    """(kind, fields) of a frame; ``allowed``: the only kinds taken (others raise before the body is built)."""
    if len(frame) > max_bytes:
        raise MessageError("oversized")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)  # lengths bounded by the frame
    except Exception:  # noqa: BLE001 -- any failure of the unpacker is one kind of bad frame
        raise MessageError("undecodable") from None
    if not isinstance(msg, list) or not msg or type(msg[0]) is not int or msg[0] not in _NAMES:
        raise MessageError("unknown kind")
    kind, fields = _NAMES[msg[0]], msg[1:]
    if allowed is not None and kind not in allowed:
        raise MessageError(f"unexpected {kind}")
    arity = _ARITY[kind]
    if len(fields) not in (arity if isinstance(arity, tuple) else (arity,)):
        raise MessageError(f"{kind} with {len(fields)} fields")
    dec = _DECODE.get(kind)
    try:
        return kind, dec(fields) if dec else fields
    except Exception as e:  # noqa: BLE001 -- a record of the wrong shape
        raise MessageError(f"bad {kind}: {type(e).__name__}") from None
