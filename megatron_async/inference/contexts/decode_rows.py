"""The decode-only step snapshot, assembled with numpy over state kept per request.

The hot step of a serving engine is decode-only: every row one token that samples, no
drafts. Its snapshot columns are a handful of per-request values that change only when the
request is admitted, gains or loses a block, or is released, plus the row's position. So
each active request holds a row here (its block-table row and its constant sampling fields,
written at those events), and a decode-only step is a few gathers over the rows' slots
instead of ~40 Python list appends per row and a per-row block-table fill.

It writes exactly the bytes ``DynamicInferenceContext.initialize_attention_state``'s general
path writes (tests/unit_tests/inference/test_decode_rows.py compares them on random plans);
any plan it does not cover (prefill chunks, drafts, a request without a row, a value that
needs the general path's per-request error) goes to the general path."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_async.inference.contexts.kv_block_allocator import DUMMY_BLOCK
from megatron_async.inference.request import DynamicInferenceRequest

if TYPE_CHECKING:
    from megatron_async.inference.contexts.dynamic_context import StepShape
    from megatron_async.inference.engines.step_plan import StepPlan

_INT_FIELDS = ("seed", "top_k", "sampling_slot", "state_slot", "prompt_len", "min_tokens", "top_n")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence", "frequency", "repetition")
_FLAG_FIELDS = ("sampled", "use_k", "use_p", "use_mp", "log_probs")


class DecodeRows:
    """Per active request (a slot of ``max_requests``): block-table row and sampling fields."""

    def __init__(self, max_requests: int, max_blocks: int, block_size: int, padding_sampling_slot: int):
        self.block_size = block_size
        self.padding_sampling_slot = padding_sampling_slot
        self.table = np.full((max_requests, max_blocks), DUMMY_BLOCK, dtype=np.int32)
        self.num_blocks = np.zeros(max_requests, dtype=np.int64)
        for name in _INT_FIELDS:
            setattr(self, name, np.zeros(max_requests, dtype=np.int64))
        for name in _FLOAT_FIELDS:
            setattr(self, name, np.zeros(max_requests, dtype=np.float64))
        for name in _FLAG_FIELDS:
            setattr(self, name, np.zeros(max_requests, dtype=bool))
        self.slot_of: dict[int, int] = {}  # request id -> slot
        self._free = list(range(max_requests - 1, -1, -1))

    # ------------------------------------------------------------------ request events
    def assign(self, req: DynamicInferenceRequest) -> None:
        """At admission (after the request's state / sampling slots): take a slot and write the
        request's constant fields. A request whose values the arrays cannot hold gets no slot
        (its steps take the general path, which fails that request alone)."""
        if not self._free or req.request_id in self.slot_of:
            return
        sp, s = req.sampling_params, self._free[-1]
        greedy = sp.is_greedy
        try:
            self.seed[s] = req.seed
            self.top_k[s] = 1 if greedy else sp.top_k
            self.sampling_slot[s] = req.sampling_slot if req.sampling_slot >= 0 else self.padding_sampling_slot
            self.state_slot[s] = req.state_slot
            self.prompt_len[s] = len(req.prompt_tokens)
            self.min_tokens[s] = sp.min_tokens
            self.top_n[s] = sp.top_n_logprobs
            self.temperature[s] = 0.0 if greedy else float(sp.temperature)
            self.top_p[s] = 0.0 if greedy else sp.top_p
            self.min_p[s] = 0.0 if greedy else sp.min_p
            self.presence[s], self.frequency[s] = sp.presence_penalty, sp.frequency_penalty
            self.repetition[s] = sp.repetition_penalty
        except (OverflowError, TypeError, ValueError):
            return
        self.sampled[s] = not greedy
        self.use_k[s] = not greedy and sp.top_k > 1
        self.use_p[s] = not greedy and 0 < sp.top_p < 1
        self.use_mp[s] = not greedy and sp.min_p > 0
        self.log_probs[s] = sp.return_log_probs
        self._free.pop()
        self.slot_of[req.request_id] = s
        self.table[s] = DUMMY_BLOCK
        self.num_blocks[s] = 0
        self.sync_blocks(req)

    def sync_blocks(self, req: DynamicInferenceRequest) -> None:
        """After ``req.block_ids`` grew or shrank: write the changed part of its row."""
        s = self.slot_of.get(req.request_id)
        if s is None:
            return
        old, new = int(self.num_blocks[s]), len(req.block_ids)
        if new > old:
            self.table[s, old:new] = req.block_ids[old:]
        elif new < old:
            self.table[s, new:old] = DUMMY_BLOCK
        self.num_blocks[s] = new

    def free(self, req: DynamicInferenceRequest) -> None:
        s = self.slot_of.pop(req.request_id, None)
        if s is not None:
            self._free.append(s)

    # ------------------------------------------------------------------ the step
    def assemble(self, plan: StepPlan, v: dict[str, np.ndarray], mamba: bool) -> StepShape | None:
        """Fill host views ``v`` for a decode-only ``plan`` and advance its requests as the
        general path does; None (nothing written or advanced) when the plan is not covered."""
        rows = plan.rows
        R = len(rows)
        if R == 0 or not all(row.num_tokens == 1 and row.samples for row in rows):
            return None
        reqs = [row.request for row in rows]
        slot_of = self.slot_of
        try:
            slots = np.fromiter([slot_of[q.request_id] for q in reqs], np.int64, R)
        except KeyError:
            return None
        starts = np.fromiter([row.start for row in rows], np.int64, R)
        prevs = np.fromiter([row.prev_row for row in rows], np.int64, R)
        computed = np.fromiter([q.num_computed_tokens for q in reqs], np.int64, R)
        bs = self.block_size
        block_idx = starts // bs
        if not (np.array_equal(starts, computed) and (block_idx < self.num_blocks[slots]).all()):
            return None  # the general path raises for it, naming the request
        ids = np.zeros(R, dtype=np.int64)
        try:
            for r in np.flatnonzero(prevs < 0).tolist():  # input known on the host (serial decode, last prompt token)
                ids[r] = reqs[r].token_at(int(starts[r]))
        except Exception:  # noqa: BLE001 -- the general path raises it again, for that request alone
            return None
        positions1 = starts + 1
        rows_i = np.arange(R, dtype=np.int64)
        has_slot = self.sampling_slot[slots] != self.padding_sampling_slot
        columns = {
            "input_ids": ids,
            "prev_sample_idx": np.where(prevs >= 0, prevs, -1),
            "positions": starts,
            "slot_mapping": self.table[slots, block_idx].astype(np.int64) * bs + starts % bs,
            "token_to_row": rows_i,
            "cu_query_lens": np.arange(R + 1, dtype=np.int64),
            "kv_lens": positions1,
            "sample_token_idx": rows_i,
            "sample_position": positions1,
            "seed": self.seed[slots],
            "temperature": self.temperature[slots],
            "top_k": self.top_k[slots],
            "top_p": self.top_p[slots],
            "state_slots": self.state_slot[slots],
            "has_initial_state": starts > 0,
            "sampling_slot": self.sampling_slot[slots],
            "min_p": self.min_p[slots],
            "presence_penalty": self.presence[slots],
            "frequency_penalty": self.frequency[slots],
            "repetition_penalty": self.repetition[slots],
            "suppress_stop": has_slot & (positions1 - self.prompt_len[slots] < self.min_tokens[slots]),
        }
        if mamba:  # every row one token: the decode rows in row order (metadata.mamba_row_order)
            columns["mamba_row_order"] = rows_i
        for name, values in columns.items():
            v[name][: len(values)] = values
        v["block_table"][:R] = self.table[slots]
        for r, q in enumerate(reqs):  # what the general path advances (RowUndo restores the same)
            q.num_computed_tokens += 1
            q.num_inflight += 1
            q.inflight_row = r
            q.num_inflight_drafts = 0
        from megatron_async.inference.contexts.dynamic_context import StepShape

        filters = (bool(self.use_k[slots].any()), bool(self.use_p[slots].any()), bool(self.use_mp[slots].any()))
        return StepShape(R, R, 1, int(positions1.max()), True, bool(self.sampled[slots].any()), any(filters),
                         int(self.top_n[slots].max()), bool(self.log_probs[slots].any()),
                         any_penalties=bool(has_slot.any()), filters=filters, num_samples=R,
                         num_multi_rows=0 if mamba else -1)
