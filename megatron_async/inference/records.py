"""The engine's request records on the wire (communication/wire.py): sampling parameters, a
step's updates and a request's final output, written and read explicitly with the checked
conversions of wire_fields.py (no pickle; no value reaches an engine unchecked). The ranks'
exchange (engines/step_records.py) and the coordinator's messages (coordinator/messages.py)
both carry them. Imports no torch (the coordinator and clients use it).

Layouts (msgpack; "ints" = int64 little-endian bin, "floats" = float64 bin):
- SamplingParams: map {field: value} of the fields that differ from the defaults; the fields
  that are not scalars through ``_SP_STRUCTURED`` (``logit_bias`` as [ids ints, biases floats],
  ``structured_outputs`` as ``StructuredOutputs.as_fields()``), read back as admission
  normalizes them (tuples for lists).
- RequestOutput: [request_id, prompt ints, generated ints, text|nil, finish reason, log-probs
  floats|nil, top-n|nil, error|nil, weight versions ints|nil, prompt log-probs floats|nil,
  prompt top-n|nil, routed experts Array|nil]; top-n = [[ids ints, log-probs floats] per token].
- updates (a step's ``RequestUpdate``s as columns): [n, ints of (n ids, n token counts, the
  tokens), finished flags bin, texts [str|nil]|nil, [[index, finish reason]], [has-log-probs
  flags bin, log-probs floats]|nil, [[index, top-n]], [[index, prompt log-probs, prompt top-n]]]."""
from __future__ import annotations

import dataclasses
from itertools import accumulate, chain, compress, repeat
from operator import itemgetter

from megatron_async.inference.communication import wire
from megatron_async.inference.communication import wire_fields as f
from megatron_async.inference.request import FinishReason, RequestOutput, RequestUpdate, SamplingParams
from megatron_async.inference.structured.spec import StructuredOutputs

# ------------------------------------------------------------------ SamplingParams
_SP_DEFAULTS = {fl.name: fl.default for fl in dataclasses.fields(SamplingParams)}
_SCALARS = {"float": f.float_, "int": f.int_, "bool": f.bool_, "int | None": f.opt_int, "str | None": f.opt_str}
_SP_CHECKS = {fl.name: _SCALARS[fl.type] for fl in dataclasses.fields(SamplingParams) if fl.type in _SCALARS}
_REASONS = frozenset(r.value for r in FinishReason)
_OPT_STR = frozenset({str, type(None)})
_new_tuple = tuple.__new__


def _structured(v, name: str) -> StructuredOutputs:
    return StructuredOutputs(**{k: f.plain(x, name) for k, x in f.dict_(v, name).items()})


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
    "structured_outputs": (StructuredOutputs.as_fields, _structured),
    "logit_bias": (lambda d: [f.pack_ints(d.keys()), f.pack_floats(d.values())], _logit_bias),
    "allowed_token_ids": (list, lambda v, name: tuple(f.int_list(v, name))),
    "bad_words": (list, lambda v, name: tuple(f.str_(w, name) for w in f.list_(v, name))),
}
"""Every SamplingParams field that is not a scalar (test_step_records checks that none is missing)."""


_SP_DEFAULT_ITEMS = tuple(_SP_DEFAULTS.items())


def encode_sampling(sp: SamplingParams) -> dict:
    """The fields that differ from the defaults, in field order (a client encodes one per request:
    one pass over the defaults, no sets)."""
    d = vars(sp)
    out = {k: d[k] for k, default in _SP_DEFAULT_ITEMS if d[k] != default}
    for name, (to_wire, _) in _SP_STRUCTURED.items():
        if out.get(name) is not None:
            out[name] = to_wire(out[name])
    return out


def sampling_fields(v) -> dict:
    """The fields of an ``encode_sampling`` map, each name a field and each value of its field's
    kind (``WireError`` otherwise); ranges are admission's to check."""
    out = {}
    for name, value in f.dict_(v, "sampling_params").items():
        check = _SP_CHECKS.get(name)
        if check is not None:
            out[name] = check(value, name)
        elif name in _SP_STRUCTURED:
            out[name] = None if value is None else _SP_STRUCTURED[name][1](value, name)
        else:
            raise f.bad(f"sampling_params.{name[:40]}")
    return out


def decode_sampling(v, frozen: bool = True) -> SamplingParams:
    """Built as a frozen copy is (no ``__init__``): for the ranks of one job, whose rank 0 admitted
    the request (an engine admitting a request from elsewhere builds ``SamplingParams(**sampling_fields(v))``)."""
    state = {**_SP_DEFAULTS, **sampling_fields(v)}
    if frozen:
        state["_frozen"] = True
    sp = object.__new__(SamplingParams)
    sp.__dict__.update(state)
    return sp


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


class CheckedOutput:
    """A RequestOutput record as it travelled, every field checked as ``decode_output`` checks it
    and none converted: what a relay (the coordinator) reads, renumbers and passes on
    (``encode_output`` writes it back as it came). Its receiver decodes it."""

    __slots__ = ("fields",)

    def __init__(self, fields: list):
        self.fields = fields

    @property
    def request_id(self) -> int:
        return self.fields[0]

    @request_id.setter
    def request_id(self, rid: int) -> None:
        self.fields[0] = rid


def _check_top(v, name: str) -> None:
    for pair in () if v is None else f.list_(v, name):
        ids, lps = f.arity(pair, 2, name)
        if len(f.packed(ids, name)) != len(f.packed(lps, name)):
            raise f.bad(name)


def check_output(v) -> CheckedOutput:
    """``decode_output``'s checks, nothing built (``WireError`` exactly where it raises)."""
    rid, prompt, gen, text, reason, lps, top, err, versions, plps, ptop, experts = f.arity(v, 12, "output")
    if type(reason) is not str or reason not in _REASONS:
        raise f.bad("finish_reason")
    f.int_(rid, "request_id"), f.packed(prompt, "prompt_tokens"), f.packed(gen, "generated_tokens")
    f.opt_str(text, "generated_text"), f.opt_str(err, "error")
    for x, name in ((lps, "generated_log_probs"), (versions, "weight_versions"), (plps, "prompt_log_probs")):
        _opt(x, f.packed, name)
    _check_top(top, "generated_top_n_logprobs"), _check_top(ptop, "prompt_top_n_logprobs")
    _opt(experts, lambda x, n: f.arr(x, n, ("int16", "int32", "int64")), "routed_experts")
    return CheckedOutput(v)


def encode_output(o: RequestOutput | CheckedOutput) -> list:
    if type(o) is CheckedOutput:
        return o.fields
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


_first = itemgetter(0)
_NO_UPDATES = [0, b"", b"", None, [], None, [], []]


def encode_updates(updates: list[RequestUpdate]) -> list:
    n = len(updates)
    if not n:
        return [0, b"", b"", None, [], None, [], []]  # (== _NO_UPDATES)
    ids, toks, texts, done, reasons, lps, tops, plps, ptops = zip(*updates)  # columns, built in C
    counts = [*map(len, toks)]
    tokens = map(_first, toks) if counts.count(1) == n else chain.from_iterable(toks)  # decode steps: the first
    return [n, f.pack_ints([*ids, *counts, *tokens]), bytes(done),
            None if texts.count(None) == n else list(texts),
            [[i, r] for i, r in enumerate(reasons) if r is not None] if reasons.count(None) < n else [],
            [bytes(x is not None for x in lps), f.pack_floats([x for lp in lps if lp is not None for x in lp])]
            if lps.count(None) < n else None,
            [[i, _top(t)] for i, t in enumerate(tops) if t is not None] if tops.count(None) < n else [],
            [[i, f.pack_floats(p), _top(pt)] for i, (p, pt) in enumerate(zip(plps, ptops)) if p is not None]
            if plps.count(None) < n else []]


def decode_updates(v) -> list[RequestUpdate]:
    """Every column checked (kinds, lengths against ``n``, token and log-prob counts), then the
    updates built without a Python call per update: their tuples come from C (``zip``, slices)
    and each ``RequestUpdate`` from ``tuple.__new__`` (its generated ``__new__`` is Python)."""
    if type(v) is list and v == _NO_UPDATES and type(v[0]) is int and type(v[1]) is bytes is type(v[2]):
        return []  # (encode_updates' record of none: every message of an engine's step without updates)
    n, packed, done, texts, reasons, lps, tops, prompts = f.arity(v, 8, "updates")
    n, packed = f.int_(n, "updates", 0, 1 << 24), f.ints(packed, "updates")
    ids, counts, tokens = packed[:n], packed[n:2 * n], packed[2 * n:]
    if len(counts) != n or type(done) is not bytes or len(done) != n or min(counts, default=0) < 0 \
            or sum(counts) != len(tokens):
        raise f.bad("updates")
    if texts is None:
        texts = repeat(None)
    elif type(texts) is not list or len(texts) != n or not _OPT_STR.issuperset(map(type, texts)):
        raise f.bad("new_text")
    lp_of = repeat(None) if lps is None else _log_probs(lps, n, counts)
    if len(tokens) == n and counts.count(1) == n:  # decode steps: one token each
        toks = zip(tokens)
    else:
        at = list(accumulate(counts, initial=0))
        toks = map(tuple(tokens).__getitem__, map(slice, at, at[1:]))
    none = repeat(None)  # (RequestUpdate's 9 fields, in order)
    out = list(map(_new_tuple, repeat(RequestUpdate),
                   zip(ids, toks, texts, map(bool, done), none, lp_of, none, none, none)))
    if not reasons == tops == prompts == []:  # (all three empty lists: nothing rare to read)
        _read_rare(out, n, reasons, tops, prompts)
    return out


def _log_probs(lps, n: int, counts: list[int]) -> list[tuple[float, ...] | None]:
    """Per update, its tokens' log-probs (None where its flag is 0): [flags bin, floats]."""
    with_lp, lp = f.arity(lps, 2, "new_log_probs")
    lp = f.floats(lp, "new_log_probs")
    if type(with_lp) is not bytes or len(with_lp) != n or len(lp) != sum(compress(counts, with_lp)):
        raise f.bad("updates")
    lp, out, at = tuple(lp), [], 0
    for c, w in zip(counts, with_lp):
        if w:
            out.append(lp[at:at + c])
            at += c
        else:
            out.append(None)
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


