"""What the ranks' per-step exchange carries, on the wire (communication/wire.py): rank 0's news
down, a data-parallel rank's results up, and the outputs ``LLM.generate`` hands to every rank.
Each record is written and read explicitly, with the checked conversions of wire_fields.py: no
pickle, and no value reaches an engine unchecked.

Layouts (msgpack; "ints" = int64 little-endian bin, "floats" = float64 bin):
- SamplingParams: map {field: value} of the fields that differ from the defaults; the fields
  that are not scalars through ``_SP_STRUCTURED`` (``logit_bias`` as [ids ints, biases floats],
  ``structured_outputs`` as the map of its set fields), read back as admission normalizes them.
- NewRequest: [prompt ints, sampling map, stop sequences [ints], stop strings [str], eos ids ints,
  banned ids ints, request_id, seed, rank].
- payload (rank 0's news of one exchange): [[NewRequest], abort ids ints, quiet ids ints].
- RequestOutput: [request_id, prompt ints, generated ints, text|nil, finish reason, log-probs
  floats|nil, top-n|nil, error|nil, weight versions ints|nil, prompt log-probs floats|nil,
  prompt top-n|nil, routed experts Array|nil]; top-n = [[ids ints, log-probs floats] per token].
- updates (a step's ``RequestUpdate``s as columns): [n, ints of (n ids, n token counts, the
  tokens), finished flags bin, texts [str|nil]|nil, [[index, finish reason]], [has-log-probs
  flags bin, log-probs floats]|nil, [[index, top-n]], [[index, prompt log-probs, prompt top-n]]].
- upload: [updates, [RequestOutput]]."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import chain, repeat
from typing import NamedTuple

from megatron_async.inference.communication import wire
from megatron_async.inference.communication import wire_fields as f
from megatron_async.inference.engines.request_validation import ValidRequest
from megatron_async.inference.request import FinishReason, RequestOutput, RequestUpdate, SamplingParams
from megatron_async.inference.structured.spec import StructuredOutputs

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


class Upload(NamedTuple):
    """One rank's results handed up in one exchange (``StepResult``'s two lists)."""

    finished: list[RequestOutput]
    updates: list[RequestUpdate]


# ------------------------------------------------------------------ SamplingParams
_SP_DEFAULTS = {fl.name: fl.default for fl in dataclasses.fields(SamplingParams)}
_SCALARS = {"float": f.float_, "int": f.int_, "bool": f.bool_, "int | None": f.opt_int}
_SP_CHECKS = {fl.name: _SCALARS[fl.type] for fl in dataclasses.fields(SamplingParams) if fl.type in _SCALARS}
_SO_FIELDS = frozenset(fl.name for fl in dataclasses.fields(StructuredOutputs))
_REASONS = frozenset(r.value for r in FinishReason)


def _structured(v, name: str) -> StructuredOutputs:
    spec = f.dict_(v, name)
    if not spec.keys() <= _SO_FIELDS:
        raise f.bad(name)
    return StructuredOutputs(**{k: f.plain(x, name) for k, x in spec.items()})


def _stop_words(v, name: str):
    """As admission normalizes them: a str, or a tuple of str / tuples of token ids."""
    if v is None or type(v) is str:
        return v
    return tuple(w if type(w) is str else tuple(f.int_list(w, name)) for w in f.list_(v, name))


def _logit_bias(v, name: str) -> dict[int, float]:
    ids, biases = f.arity(v, 2, name)
    ids, biases = f.ints(ids, name), f.floats(biases, name)
    if len(ids) != len(biases):
        raise f.bad(name)
    return dict(zip(ids, biases))


_SP_STRUCTURED = {
    # field: (to the wire, back): the fields that are not scalars
    "stop_words": (lambda v: v if v is None or type(v) is str else [w if type(w) is str else list(w) for w in v],
                   _stop_words),
    "structured_outputs": (lambda so: {k: getattr(so, k) for k in _SO_FIELDS if getattr(so, k) is not None},
                           _structured),
    "logit_bias": (lambda d: [f.pack_ints(d.keys()), f.pack_floats(d.values())], _logit_bias),
    "allowed_token_ids": (list, lambda v, name: tuple(f.int_list(v, name))),
    "bad_words": (list, lambda v, name: tuple(f.str_(w, name) for w in f.list_(v, name))),
}
"""Every SamplingParams field that is not a scalar (test_step_records checks that none is missing)."""


def encode_sampling(sp: SamplingParams) -> dict:
    out = {k: v for k, v in vars(sp).items() if k in _SP_DEFAULTS and v != _SP_DEFAULTS[k]}
    for name in _SP_STRUCTURED.keys() & out.keys():
        if out[name] is not None:
            out[name] = _SP_STRUCTURED[name][0](out[name])
    return out


def decode_sampling(v, frozen: bool = True) -> SamplingParams:
    """Every name a field, every value of its field's kind; built as a frozen copy is (no
    ``__init__``: ranges were checked at admission on rank 0)."""
    state = dict(_SP_DEFAULTS)
    for name, value in f.dict_(v, "sampling_params").items():
        check = _SP_CHECKS.get(name)
        if check is not None:
            state[name] = check(value, name)
        elif name in _SP_STRUCTURED:
            state[name] = None if value is None else _SP_STRUCTURED[name][1](value, name)
        else:
            raise f.bad(f"sampling_params.{name[:40]}")
    if frozen:
        state["_frozen"] = True
    sp = object.__new__(SamplingParams)
    sp.__dict__.update(state)
    return sp


# ------------------------------------------------------------------ rank 0's news
def _new_request(n: NewRequest) -> list:
    v = n.valid
    return [f.pack_ints(v.prompt_tokens), encode_sampling(v.sampling_params),
            [f.pack_ints(s) for s in v.stop_sequences], list(v.stop_strings), f.pack_ints(sorted(v.eos_ids)),
            f.pack_ints(v.banned_ids), n.request_id, n.seed, n.rank]


def _read_new_request(v) -> NewRequest:
    prompt, sp, seqs, strs, eos, banned, rid, seed, rank = f.arity(v, 9, "new_request")
    valid = ValidRequest(f.ints(prompt, "prompt_tokens"), decode_sampling(sp),
                         [f.ints(s, "stop_sequences") for s in f.list_(seqs, "stop_sequences")],
                         [f.str_(s, "stop_strings") for s in f.list_(strs, "stop_strings")],
                         frozenset(f.ints(eos, "eos_ids")), tuple(f.ints(banned, "banned_ids")))
    return NewRequest(valid, f.int_(rid, "request_id"), f.int_(seed, "seed", 0), f.int_(rank, "rank", 0, 1 << 20))


def encode_payload(payload: tuple) -> bytes:
    """(news, aborts, quiet ids): rank 0's payload of one exchange."""
    news, aborts, quiet = payload
    return wire.pack([[_new_request(n) for n in news], f.pack_ints(aborts), f.pack_ints(quiet)])


@wire.reader
def decode_payload(data) -> tuple[list[NewRequest], list[int], list[int]]:
    news, aborts, quiet = f.arity(wire.unpack(data, MAX_RECORD_BYTES), 3, "payload")
    return [_read_new_request(n) for n in f.list_(news, "news")], f.ints(aborts, "aborts"), f.ints(quiet, "quiet")


# ------------------------------------------------------------------ outputs
def _top(top) -> list | None:
    return None if top is None else [[f.pack_ints(d.keys()), f.pack_floats(d.values())] for d in top]


def _read_top(v, name: str) -> list[dict[int, float]] | None:
    if v is None:
        return None
    out = []
    for pair in f.list_(v, name):
        ids, lps = f.arity(pair, 2, name)
        ids, lps = f.ints(ids, name), f.floats(lps, name)
        if len(ids) != len(lps):
            raise f.bad(name)
        out.append(dict(zip(ids, lps)))
    return out


def _opt(v, conv, name):
    return None if v is None else conv(v, name)


def encode_output(o: RequestOutput) -> list:
    experts = o.routed_experts
    return [o.request_id, f.pack_ints(o.prompt_tokens), f.pack_ints(o.generated_tokens), o.generated_text,
            str(getattr(o.finish_reason, "value", o.finish_reason)),
            None if o.generated_log_probs is None else f.pack_floats(o.generated_log_probs),
            _top(o.generated_top_n_logprobs), o.error,
            None if o.weight_versions is None else f.pack_ints(o.weight_versions),
            None if o.prompt_log_probs is None else f.pack_floats(o.prompt_log_probs),
            _top(o.prompt_top_n_logprobs), None if experts is None else wire.Array.of(experts)]


def decode_output(v) -> RequestOutput:
    rid, prompt, gen, text, reason, lps, top, err, versions, plps, ptop, experts = f.arity(v, 12, "output")
    if reason not in _REASONS:
        raise f.bad("finish_reason")
    experts = _opt(experts, lambda x, n: f.arr(x, n, ("int16", "int32", "int64")), "routed_experts")
    return RequestOutput(f.int_(rid, "request_id"), f.ints(prompt, "prompt_tokens"), f.ints(gen, "generated_tokens"),
                         f.opt_str(text, "generated_text"), reason, _opt(lps, f.floats, "generated_log_probs"),
                         _read_top(top, "generated_top_n_logprobs"), f.opt_str(err, "error"),
                         _opt(versions, f.ints, "weight_versions"), _opt(plps, f.floats, "prompt_log_probs"),
                         _read_top(ptop, "prompt_top_n_logprobs"), None if experts is None else experts.numpy().copy())


def encode_updates(updates: list[RequestUpdate]) -> list:
    n = len(updates)
    if not n:
        return [0, b"", b"", None, [], None, [], []]
    ids, toks, texts, done, reasons, lps, tops, plps, ptops = zip(*updates)  # columns, built in C
    return [n, f.pack_ints([*ids, *map(len, toks), *chain.from_iterable(toks)]), bytes(done),
            None if texts.count(None) == n else list(texts),
            [[i, r] for i, r in enumerate(reasons) if r is not None] if reasons.count(None) < n else [],
            [bytes(x is not None for x in lps), f.pack_floats([x for lp in lps if lp is not None for x in lp])]
            if lps.count(None) < n else None,
            [[i, _top(t)] for i, t in enumerate(tops) if t is not None] if tops.count(None) < n else [],
            [[i, f.pack_floats(p), _top(pt)] for i, (p, pt) in enumerate(zip(plps, ptops)) if p is not None]
            if plps.count(None) < n else []]


def decode_updates(v) -> list[RequestUpdate]:
    n, packed, done, texts, reasons, lps, tops, prompts = f.arity(v, 8, "updates")
    n, packed = f.int_(n, "updates", 0, 1 << 24), f.ints(packed, "updates")
    ids, counts, tokens = packed[:n], packed[n:2 * n], packed[2 * n:]
    if len(counts) != n or type(done) is not bytes or len(done) != n or min(counts, default=0) < 0 \
            or sum(counts) != len(tokens):
        raise f.bad("updates")
    texts = [None] * n if texts is None else [f.opt_str(t, "new_text") for t in f.list_(texts, "texts", n)]
    with_lp, lp = (bytes(n), []) if lps is None else f.arity(lps, 2, "new_log_probs")
    lp = f.floats(lp, "new_log_probs") if lps is not None else lp
    if len(texts) != n or type(with_lp) is not bytes or len(with_lp) != n \
            or len(lp) != sum(c for c, w in zip(counts, with_lp) if w):
        raise f.bad("updates")
    if len(tokens) == n and counts.count(1) == n:  # decode steps: one token each, tuples built in C
        it = zip(lp)
        lp_of = repeat(None) if lps is None else [next(it) if w else None for w in with_lp]
        out = list(map(RequestUpdate, ids, zip(tokens), texts, map(bool, done), repeat(None), lp_of))
    else:
        out, at, at_lp = [], 0, 0
        for i in range(n):
            c, lps_i = counts[i], None
            if with_lp[i]:
                lps_i, at_lp = tuple(lp[at_lp:at_lp + c]), at_lp + c
            out.append(RequestUpdate(ids[i], tuple(tokens[at:at + c]), texts[i], done[i] != 0, None, lps_i))
            at += c
    _read_rare(out, n, reasons, tops, prompts)
    return out


def _read_rare(out: list[RequestUpdate], n: int, reasons, tops, prompts) -> None:
    """The columns few updates have: finish reasons, top-n, prompt log-probs."""
    for pair in f.list_(reasons, "reasons"):
        i, r = f.arity(pair, 2, "reasons")
        if r not in _REASONS:
            raise f.bad("finish_reason")
        i = f.int_(i, "reasons", 0, n - 1)
        out[i] = out[i]._replace(finish_reason=r)
    for pair in f.list_(tops, "top_n"):
        i, top = f.arity(pair, 2, "top_n")
        i = f.int_(i, "top_n", 0, n - 1)
        out[i] = out[i]._replace(new_top_n_logprobs=tuple(_read_top(top, "top_n") or ()))
    for triple in f.list_(prompts, "prompt_log_probs"):
        i, plp, ptop = f.arity(triple, 3, "prompt_log_probs")
        i = f.int_(i, "prompt_log_probs", 0, n - 1)
        ptop = _read_top(ptop, "prompt_top_n")
        out[i] = out[i]._replace(prompt_log_probs=tuple(f.floats(plp, "prompt_log_probs")),
                                 prompt_top_n_logprobs=None if ptop is None else tuple(ptop))


def encode_upload(result) -> bytes:
    """A ``StepResult`` (or ``Upload``): its finished outputs and updates."""
    return wire.pack([encode_updates(result.updates), [encode_output(o) for o in result.finished]])


@wire.reader
def decode_upload(data) -> Upload:
    updates, finished = f.arity(wire.unpack(data, MAX_RECORD_BYTES), 2, "upload")
    return Upload([decode_output(o) for o in f.list_(finished, "finished")], decode_updates(updates))


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
