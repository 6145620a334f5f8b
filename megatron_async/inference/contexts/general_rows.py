"""The general step snapshot: any step (prefill chunks, verify rows, mixed), its tables written
row by row into one host buffer of the context's ring. Decode-only steps usually take the numpy
path instead (decode_rows.py), which a test compares byte for byte with this one. Assembly only
writes the buffer: the request book commits the step (positions, in-flight counts) after it."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_async.forward_batch import longest_first, mamba_row_order
from megatron_async.inference.contexts.kv_block_allocator import DUMMY_BLOCK
from megatron_async.inference.contexts.step_errors import RequestStepError, row_of_bad_value
from megatron_async.inference.request import LOG_PROBS, MIN_P, SAMPLED, TOP_K, TOP_P, DynamicInferenceRequest
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
    ids, prev, pos, slots, tok_row, src = [], [], [], [], [], []
    cu, kv_lens, sample_idx, sample_pos, sample_row = [0], [], [], [], []
    seeds, temps, topk, topp, state_slots, has_init = [], [], [], [], [], []
    spec_slot, spec_owner, spec_inflight, num_drafts, sample_base = [], [], [], [], []
    pen = _PenaltyColumns(sampling_padding_slot)
    max_q = max_kv = 0
    bits = max_top_n = 0  # the sampling rows' features (SamplingParams.features), OR-ed
    bt = v["block_table"]
    r = 0
    if verify_width and not spec:
        raise ValueError("a uniform verify layout needs speculative decoding")
    try:
        for r, row in enumerate(plan.rows):
            req, start, n, k = row.request, row.start, row.num_tokens, row.num_drafts
            assert start == req.num_computed_tokens
            # a row's input token comes from the spec state when its predecessor in flight verified drafts
            inflight = spec and row.prev_row >= 0 and plan.inflight_verified
            if not spec and k == 0:  # a plain row (the prefill chunks): its columns by slices, not per token
                _plain_row_tokens(req, start, n, row.prev_row, r, bs, ids, prev, pos, slots, tok_row)
            else:
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
            pad = verify_width - n if verify_width else 0
            if pad < 0 or pad and not row.samples:
                raise ValueError(f"a uniform verify layout of {verify_width} tokens per row cannot hold a row "
                                 f"of {n} tokens (samples: {row.samples})")
            ids += [0] * pad
            prev += [-1] * pad
            src += [-2] * pad
            pos += [start + n - 1] * pad
            slots += [DUMMY_BLOCK * bs] * pad
            tok_row += [r] * pad
            row_first = cu[-1]
            cu.append(cu[-1] + n + pad)
            kv_lens.append(start + n)
            sp = req.sampling_params
            temperature, top_k, top_p, min_p = sp.row_filters()
            if spec:
                spec_slot.append(req.spec_slot if row.samples else spec_padding_slot)
                spec_owner.append(req.spec_slot)
                spec_inflight.append(inflight)
                num_drafts.append(k)
                sample_base.append(len(sample_idx))
            for j in range(k, -1, -1):  # the row's sampled positions: one, or one per draft plus one
                sample_idx.append(row_first + n - 1 - j)
                sample_pos.append(start + n - j)
                sample_row.append(r)
                seeds.append(req.seed)
                temps.append(temperature)
                topk.append(top_k)
                topp.append(top_p)
                pen.add(req, row.samples, min_p, start + n - j)
            for q in range(pad):  # padding samples: greedy, no sampling slot, never read
                sample_idx.append(row_first + n + q)
                sample_pos.append(start + n)
                sample_row.append(r)
                seeds.append(0)
                temps.append(0.0)
                topk.append(1)
                topp.append(0.0)
                pen.add(req, False, 0.0, start + n)
            if row.samples:
                bits |= sp.features()
                max_top_n = max(max_top_n, sp.top_n_logprobs)
            state_slots.append(req.state_slot)
            has_init.append(start > 0)
            nb = len(req.block_ids)
            bt[r, :nb] = req.block_ids
            bt[r, nb:] = DUMMY_BLOCK
            max_q, max_kv = max(max_q, n + pad), max(max_kv, start + n)
        r = None
        columns = {
            "input_ids": ids, "prev_sample_idx": prev, "positions": pos, "slot_mapping": slots,
            "token_to_row": tok_row, "cu_query_lens": cu, "kv_lens": kv_lens, "attention_row_order": longest_first(kv_lens),
            "sample_token_idx": sample_idx,
            "sample_position": sample_pos, "seed": seeds, "temperature": temps, "top_k": topk, "top_p": topp,
            "state_slots": state_slots, "has_initial_state": has_init, **pen.columns(),
        }
        num_multi = -1
        if has_mamba:
            columns["mamba_row_order"], num_multi = mamba_row_order(cu, [k > 0 for k in num_drafts] if spec else None)
        if spec:
            columns.update(spec_src=src, spec_slot=spec_slot, spec_owner_slot=spec_owner, spec_inflight=spec_inflight,
                           num_drafts=num_drafts, sample_base=sample_base, sample_to_row=sample_row)
        for name, values in columns.items():
            v[name][: len(values)] = values
    except Exception as e:
        if r is None:
            r = row_of_bad_value(v, columns, tok_row)
        bad = plan.rows[r if r is not None else -1].request
        raise RequestStepError(bad, e) from e
    T, R = len(ids), len(plan.rows)
    filters = (bool(bits & TOP_K), bool(bits & TOP_P), bool(bits & MIN_P))
    any_sampling, any_lp = bool(bits & SAMPLED), bool(bits & LOG_PROBS)
    decode_only = plan.is_decode_only and not verify_width
    return StepShape(T, R, max_q, max_kv, decode_only, any_sampling, any(filters), max_top_n, any_lp,
                     any_penalties=pen.any, filters=filters, num_samples=len(sample_idx),
                     sample_base=sample_base if spec else None, num_drafts=num_drafts if spec else None,
                     num_multi_rows=num_multi, verify_width=verify_width)


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
