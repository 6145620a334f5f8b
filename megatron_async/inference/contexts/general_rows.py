"""The general step snapshot: any step (prefill chunks, verify rows, mixed), its tables written
row by row into one host buffer of the context's ring. Decode-only steps usually take the numpy
path instead (decode_rows.py), which a test compares byte for byte with this one. Assembly only
writes the buffer: the request book commits the step (positions, in-flight counts) after it."""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np

from megatron_async.forward_batch import longest_first, mamba_row_order
from megatron_async.inference.contexts.kv_block_allocator import DUMMY_BLOCK
from megatron_async.inference.contexts.step_errors import RequestStepError, row_of_bad_value
from megatron_async.inference.request import DynamicInferenceRequest
from megatron_async.inference.sampling_params import GRAMMAR, LOG_PROBS, MIN_P, SAMPLED, TOP_K, TOP_P
from megatron_async.step_shape import StepShape

if TYPE_CHECKING:
    from megatron_async.inference.step_plan import StepPlan


def assemble_rows(plan: StepPlan, v: dict[str, np.ndarray], bs: int, verify_width: int,
                  spec_padding_slot: int | None, sampling_padding_slot: int, has_mamba: bool) -> StepShape:
    """Write ``plan``'s tables into host views ``v`` (block size ``bs``); no request changes.
    ``spec_padding_slot`` is None without speculative decoding. Raises RequestStepError when one
    request's values break the step (see ``DynamicInferenceContext.initialize_attention_state``
    for ``verify_width``)."""
    spec = spec_padding_slot is not None
    if verify_width and not spec:
        raise ValueError("a uniform verify layout needs speculative decoding")
    tokens, rows = _TokenColumns(bs, spec), _RowColumns(v["block_table"])
    samples = _SampleColumns(sampling_padding_slot)
    spec_rows = _SpecRowColumns(spec_padding_slot) if spec else None
    r = 0
    try:
        for r, row in enumerate(plan.rows):
            assert row.start == row.request.num_computed_tokens
            # a row's input token comes from the spec state when its predecessor in flight verified drafts
            inflight = spec and row.prev_row >= 0 and plan.inflight_verified
            tokens.add(row, r, inflight)
            pad = _verify_padding(row, verify_width)
            tokens.pad(row, r, pad)
            row_first = rows.cu[-1]
            if spec_rows is not None:
                spec_rows.add(row, inflight, len(samples.idx))
            samples.add(row, r, row_first, pad)
            rows.add(row, r, pad)
        r = None
        tokens.finish()
        columns = _columns(tokens, rows, samples)
        num_multi = -1
        if has_mamba:
            columns["mamba_row_order"], num_multi = mamba_row_order(
                rows.cu, [k > 0 for k in spec_rows.num_drafts] if spec else None)
        any_lora = "lora_slot" in v
        if any_lora:  # each token its row's adapter slot (contexts/lora_rows.py)
            lora_rows = np.fromiter((row.request.lora_slot for row in plan.rows), np.int32, len(plan.rows))
            columns["lora_slot"] = lora_rows[np.asarray(tokens.tok_row, dtype=np.int64)]
            any_lora = bool((lora_rows >= 0).any())
        if spec:
            columns.update(spec_src=tokens.src, spec_slot=spec_rows.slot, spec_owner_slot=spec_rows.owner,
                           spec_inflight=spec_rows.inflight, num_drafts=spec_rows.num_drafts,
                           sample_base=spec_rows.sample_base, sample_to_row=samples.row)
        for name, values in columns.items():
            v[name][: len(values)] = values
    except Exception as e:
        if r is None:
            r = row_of_bad_value(v, columns, tokens.tok_row)
        bad = plan.rows[r if r is not None else -1].request
        raise RequestStepError(bad, e) from e
    bits = samples.bits
    filters = (bool(bits & TOP_K), bool(bits & TOP_P), bool(bits & MIN_P))
    any_sampling, any_lp = bool(bits & SAMPLED), bool(bits & LOG_PROBS)
    decode_only = plan.is_decode_only and not verify_width
    return StepShape(len(tokens.ids), len(plan.rows), rows.max_q, rows.max_kv, decode_only, any_sampling, any(filters),
                     samples.max_top_n, any_lp, any_penalties=samples.pen.any, filters=filters,
                     num_samples=len(samples.idx), sample_base=spec_rows.sample_base if spec else None,
                     num_drafts=spec_rows.num_drafts if spec else None, num_multi_rows=num_multi,
                     verify_width=verify_width, any_grammar=bool(bits & GRAMMAR), any_lora=any_lora)


def _columns(tokens: _TokenColumns, rows: _RowColumns, samples: _SampleColumns) -> dict[str, list]:
    """Snapshot field name -> the step's values, for every step (the spec and Mamba columns aside)."""
    return {
        "input_ids": tokens.ids, "prev_sample_idx": tokens.prev, "positions": tokens.pos,
        "slot_mapping": tokens.slots, "token_to_row": tokens.tok_row, "cu_query_lens": rows.cu,
        "kv_lens": rows.kv_lens, "attention_row_order": longest_first(rows.kv_lens), "sample_token_idx": samples.idx,
        "sample_position": samples.pos, "seed": samples.seeds, "temperature": samples.temps, "top_k": samples.topk,
        "top_p": samples.topp, "state_slots": rows.state_slots, "has_initial_state": rows.has_init,
        **samples.pen.columns(),
    }


def _verify_padding(row, verify_width: int) -> int:
    """Tokens that pad ``row`` to the uniform verify layout's ``verify_width`` (0 without one)."""
    pad = verify_width - row.num_tokens if verify_width else 0
    if pad < 0 or pad and not row.samples:
        raise ValueError(f"a uniform verify layout of {verify_width} tokens per row cannot hold a row "
                         f"of {row.num_tokens} tokens (samples: {row.samples})")
    return pad


LONG_ROW = 64
"""Tokens from which a row without drafts takes numpy arrays for its token columns instead of
Python ints (an 8,192-token step's column costs ~0.3 ms to convert from a list)."""


class _TokenColumns:
    """The per-token columns: input ids, where an id comes from (the launch in flight, a draft),
    positions, KV slots, rows. Lists while rows are added (a long plain row's arrays and the lists
    before it are kept in order in ``_runs``); ``finish`` joins them."""

    def __init__(self, bs: int, spec: bool):
        self.bs, self.spec = bs, spec
        self.ids, self.prev, self.pos, self.slots, self.tok_row, self.src = [], [], [], [], [], []
        self._runs: list[tuple] = []

    def _flush(self) -> None:
        if self.ids:
            self._runs.append((self.ids, self.prev, self.pos, self.slots, self.tok_row, self.src))
            self.ids, self.prev, self.pos, self.slots, self.tok_row, self.src = [], [], [], [], [], []

    def finish(self) -> None:
        """The columns in row order: numpy arrays where some row took arrays, else the lists."""
        if not self._runs:
            return
        self._flush()
        cols = [np.concatenate([np.asarray(run[i], dtype=np.int64) for run in self._runs])
                for i in range(6 if self.spec else 5)]
        self.ids, self.prev, self.pos, self.slots, self.tok_row = cols[:5]
        if self.spec:
            self.src = cols[5]
        self._runs = []

    def add(self, row, r: int, inflight: bool) -> None:
        """Row ``r``'s tokens (``inflight``: its first token comes from the spec state)."""
        req, start, n, k, bs = row.request, row.start, row.num_tokens, row.num_drafts, self.bs
        if k == 0 and not inflight and n >= LONG_ROW:  # a prefill chunk: numpy ranges
            self._flush()
            self._runs.append(_long_row_tokens(req, start, n, row.prev_row, r, bs, self.spec))
        elif k == 0 and not inflight:  # a plain row (decode, short chunks): its columns by slices, not per token
            _plain_row_tokens(req, start, n, row.prev_row, r, bs, self.ids, self.prev, self.pos, self.slots,
                              self.tok_row)
            if self.spec:  # no id from the spec state: a speculative engine's prefill chunks take
                self.src += [-1] * n  # the slices too (token by token they took twice a plain engine's host time)
        else:
            ids, prev, src, spec = self.ids, self.prev, self.src, self.spec
            pos, slots, tok_row = self.pos, self.slots, self.tok_row
            for p in range(start, start + n):
                j = p - start
                if j == 0 and row.prev_row >= 0 and not inflight:
                    ids.append(0)
                    prev.append(row.prev_row)
                elif j > 0 and j <= k or j == 0 and inflight:
                    ids.append(0)
                    prev.append(-1)
                else:
                    ids.append(req.token_at(p))
                    prev.append(-1)
                if spec:
                    src.append(j if j <= k and (j > 0 or inflight) else -1)
                pos.append(p)
                slots.append(req.block_ids[p // bs] * bs + p % bs)
                tok_row.append(r)

    def pad(self, row, r: int, pad: int) -> None:
        """``pad`` padding tokens after row ``r`` (never read: they write the dummy block)."""
        self.ids += [0] * pad
        self.prev += [-1] * pad
        self.src += [-2] * pad
        self.pos += [row.start + row.num_tokens - 1] * pad
        self.slots += [DUMMY_BLOCK * self.bs] * pad
        self.tok_row += [r] * pad


class _RowColumns:
    """The per-row columns: query and KV extents, state slots, the block table (written in place)."""

    def __init__(self, block_table: np.ndarray):
        self.block_table = block_table
        self.cu, self.kv_lens, self.state_slots, self.has_init = [0], [], [], []
        self.max_q = self.max_kv = 0

    def add(self, row, r: int, pad: int) -> None:
        req, start, n = row.request, row.start, row.num_tokens
        self.cu.append(self.cu[-1] + n + pad)
        self.kv_lens.append(start + n)
        self.state_slots.append(req.state_slot)
        self.has_init.append(start > 0)
        nb = len(req.block_ids)
        self.block_table[r, :nb] = req.block_ids
        self.block_table[r, nb:] = DUMMY_BLOCK
        self.max_q, self.max_kv = max(self.max_q, n + pad), max(self.max_kv, start + n)


class _SpecRowColumns:
    """The per-row columns of speculative decoding: spec-state slots, drafts, where samples start."""

    def __init__(self, padding_slot: int):
        self.padding_slot = padding_slot
        self.slot, self.owner, self.inflight, self.num_drafts, self.sample_base = [], [], [], [], []

    def add(self, row, inflight: bool, sample_base: int) -> None:
        req = row.request
        self.slot.append(req.spec_slot if row.samples else self.padding_slot)
        self.owner.append(req.spec_slot)
        self.inflight.append(inflight)
        self.num_drafts.append(row.num_drafts)
        self.sample_base.append(sample_base)


class _SampleColumns:
    """The per-sample columns (one sample per row, or one per draft plus one) and the sampling
    features the step needs."""

    def __init__(self, padding_slot: int):
        self.idx, self.pos, self.row, self.seeds, self.temps, self.topk, self.topp = [], [], [], [], [], [], []
        self.pen = _PenaltyColumns(padding_slot)
        self.bits = self.max_top_n = 0  # the sampling rows' features (SamplingParams.features), OR-ed

    def add(self, row, r: int, row_first: int, pad: int) -> None:
        """Row ``r``'s samples (its tokens start at ``row_first``), then one greedy sample per
        padding token (no sampling slot, never read)."""
        req, start, n, k = row.request, row.start, row.num_tokens, row.num_drafts
        sp = req.sampling_params
        temperature, top_k, top_p, min_p = sp.row_filters()
        for j in range(k, -1, -1):  # the row's sampled positions: one, or one per draft plus one
            self._add(row_first + n - 1 - j, start + n - j, r, req.seed, temperature, top_k, top_p)
            self.pen.add(req, row.samples, min_p, start + n - j)
        for q in range(pad):
            self._add(row_first + n + q, start + n, r, 0, 0.0, 1, 0.0)
            self.pen.add(req, False, 0.0, start + n)
        if row.samples:
            self.bits |= sp.features()
            self.max_top_n = max(self.max_top_n, sp.top_n_logprobs)

    def _add(self, idx: int, pos: int, r: int, seed: int, temperature: float, top_k: int, top_p: float) -> None:
        self.idx.append(idx)
        self.pos.append(pos)
        self.row.append(r)
        self.seeds.append(seed)
        self.temps.append(temperature)
        self.topk.append(top_k)
        self.topp.append(top_p)


def _plain_row_tokens(req: DynamicInferenceRequest, start: int, n: int, prev_row: int, r: int, bs: int,
                      ids: list, prev: list, pos: list, slots: list, tok_row: list) -> None:
    """The per-token columns of a row without drafts, as the general loop writes them: its
    first token comes from the launch in flight when ``prev_row`` >= 0, the rest are known."""
    end = start + n
    first = 0
    if prev_row >= 0 and n:
        ids.append(0)
        prev.append(prev_row)
        first = 1
    known = req.tokens_between(start + first, end)
    if len(known) != end - start - first:
        raise IndexError(f"positions {start + first}-{end - 1} of a request with {req.num_known_tokens} known tokens")
    ids.extend(known)
    prev.extend([-1] * (n - first))
    pos.extend(range(start, end))
    tok_row.extend([r] * n)
    p = start
    while p < end:  # one range per KV block
        b, o = req.block_ids[p // bs], p % bs
        m = min(bs - o, end - p)
        slots.extend(range(b * bs + o, b * bs + o + m))
        p += m


def _long_row_tokens(req: DynamicInferenceRequest, start: int, n: int, prev_row: int, r: int, bs: int,
                     spec: bool) -> tuple:
    """``_plain_row_tokens``' columns of one row (n > 0) as int64 arrays: (ids, prev, pos, slots,
    tok_row, src) (src only with ``spec``: -1, no id from the spec state)."""
    end, first = start + n, int(prev_row >= 0)
    known = req.tokens_between(start + first, end)
    blocks = np.asarray(req.block_ids[start // bs:(end - 1) // bs + 1], dtype=np.int64)
    o = start % bs
    slots = (blocks[:, None] * bs + np.arange(bs)).ravel()[o:o + n]
    if len(known) != end - start - first or len(slots) != n:
        raise IndexError(f"positions {start}-{end - 1} of a request with {req.num_known_tokens} known tokens "
                         f"and {len(req.block_ids)} blocks")
    ids = np.fromiter(itertools.chain((0,), known) if first else known, dtype=np.int64, count=n)
    prev = np.full(n, -1, dtype=np.int64)
    prev[:first] = prev_row
    return (ids, prev, np.arange(start, end, dtype=np.int64), slots, np.full(n, r, dtype=np.int64),
            np.full(n, -1, dtype=np.int64) if spec else None)


class _PenaltyColumns:
    """Collects the per-row penalty / min-p / min_tokens columns of one snapshot."""

    def __init__(self, padding_slot: int):
        self.padding_slot = padding_slot
        self.slot, self.min_p, self.pres, self.freq, self.rep, self.suppress = [], [], [], [], [], []
        self.any = False

    def add(self, req: DynamicInferenceRequest, samples: bool, min_p: float, sample_position: int) -> None:
        sp = req.sampling_params
        has_slot = samples and req.sampling_slot >= 0  # rows that sample nothing count nothing
        self.any |= has_slot
        self.slot.append(req.sampling_slot if has_slot else self.padding_slot)
        self.min_p.append(min_p)
        self.pres.append(sp.presence_penalty)
        self.freq.append(sp.frequency_penalty)
        self.rep.append(sp.repetition_penalty)
        self.suppress.append(has_slot and sample_position - len(req.prompt_tokens) < sp.min_tokens)

    def columns(self) -> dict[str, list]:
        """Snapshot field name -> this step's per-row values."""
        return {"sampling_slot": self.slot, "min_p": self.min_p, "presence_penalty": self.pres,
                "frequency_penalty": self.freq, "repetition_penalty": self.rep, "suppress_stop": self.suppress}
