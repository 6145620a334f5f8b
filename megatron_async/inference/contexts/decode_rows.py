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
needs the general path's per-request error) goes to the general path.

Speculative engines use it for their decode steps without drafts (a plain step
of a speculative engine costs what a plain engine's step costs): the spec columns of such a
step are the request's spec slot (constant), no drafts, one sample per row, and, for a row
continuing a launch that verified drafts, input and correction from the spec state."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from megatron_async.forward_batch import longest_first
from megatron_async.inference.contexts.kv_block_allocator import DUMMY_BLOCK
from megatron_async.inference.request import DynamicInferenceRequest
from megatron_async.inference.sampling_params import GRAMMAR, LOG_PROBS, MIN_P, SAMPLED, TOP_K, TOP_P
from megatron_async.step_shape import StepShape

if TYPE_CHECKING:
    from megatron_async.inference.step_plan import StepPlan

# Per slot, besides: prompt length, min_tokens, the request's sampling features
# (SamplingParams.features: a step's are the OR over its rows) and top-n log-probs (the step's: max).
_PROMPT_LEN, _MIN_TOKENS, _FLAG_BITS, _TOP_N = range(4)
# Snapshot fields whose per-row value is the request's, constant while it is active: kept
# per slot in the snapshot's own dtype and gathered straight into the host buffer.
GATHERED = ("seed", "temperature", "top_k", "top_p", "state_slots", "sampling_slot", "min_p", "presence_penalty",
            "frequency_penalty", "repetition_penalty")
SPEC_GATHERED = ("spec_slot", "spec_owner_slot")  # speculative engines: a sampling row's slot is its request's
LORA_GATHERED = ("lora_slot",)  # LoRA engines: a per-token field, and in a decode-only step token r is row r
# The rest of what a decode-only step writes: per step (from the rows' positions), and per set
# of requests in the rows (``_write_constant``). With GATHERED these declare every snapshot
# field this path fills; ``DecodeRows`` refuses a layout with any other field, so a field added
# to the snapshot (which the general path writes) cannot be left stale here.
PER_STEP = ("input_ids", "prev_sample_idx", "positions", "slot_mapping", "kv_lens", "attention_row_order",
            "sample_position", "has_initial_state", "block_table", "suppress_stop")
PER_ROW_SET = ("token_to_row", "sample_token_idx", "cu_query_lens", "mamba_row_order")
SPEC_PER_STEP = ("spec_inflight", "spec_src", "num_drafts", "sample_base", "sample_to_row")


class DecodeRows:
    """Per active request (a slot of ``max_requests``): block-table row and sampling fields."""

    def __init__(self, max_requests: int, block_size: int, padding_sampling_slot: int, views: dict[str, np.ndarray]):
        """``views``: host views of a snapshot buffer (their dtypes and block-table width)."""
        self.block_size = block_size
        self.padding_sampling_slot = padding_sampling_slot
        self.spec = "spec_slot" in views
        """The snapshot has speculative decoding's columns."""
        self.gathered = GATHERED + (SPEC_GATHERED if self.spec else ()) + (LORA_GATHERED if "lora_slot" in views else ())
        written = self.gathered + PER_STEP + PER_ROW_SET + (SPEC_PER_STEP if self.spec else ())
        unknown = sorted(set(views) - set(written))
        if unknown:
            raise ValueError(f"the decode-only snapshot path does not write the snapshot fields {unknown}: "
                             "declare and write them in contexts/decode_rows.py (the general path writes every field)")
        n = max_requests
        self.table = np.full((n, views["block_table"].shape[1]), DUMMY_BLOCK, dtype=views["block_table"].dtype)
        self.num_blocks = np.zeros(n, dtype=np.int64)
        # one [slot, field] matrix per snapshot dtype: a step gathers each with one take
        by_dtype: dict[np.dtype, list[str]] = {}
        for name in self.gathered:
            by_dtype.setdefault(views[name].dtype, []).append(name)
        self.groups = [(np.zeros((n, len(names)), dtype=dt), names) for dt, names in by_dtype.items()]
        self.column = {name: (m, j) for m, names in self.groups for j, name in enumerate(names)}
        self.meta = np.zeros((n, 4), dtype=np.int64)
        self._epoch = 0  # admissions so far: a slot's constant values change only at one
        self._constant: dict[int, _Constant] = {}  # ring buffer -> its constant columns
        self._arange = np.arange(n + 2, dtype=np.int64)
        self._free = list(range(max_requests - 1, -1, -1))
        self.assembled = 0
        """Steps this path assembled (EngineStats.fast_decode_snapshots)."""

    # ------------------------------------------------------------------ request events
    def assign(self, req: DynamicInferenceRequest) -> None:
        """At admission (after the request's state / sampling slots): take a slot and write the
        request's constant fields. A request whose values the arrays cannot hold gets no slot
        (its steps take the general path, which fails that request alone)."""
        if not self._free or req.decode_slot >= 0:
            return
        sp, s = req.sampling_params, self._free[-1]
        temperature, top_k, top_p, min_p = sp.row_filters()
        values = {  # what the general path writes for the request's sampling row
            "seed": req.seed, "temperature": temperature, "top_k": top_k, "top_p": top_p,
            "state_slots": req.state_slot,
            "sampling_slot": req.sampling_slot if req.sampling_slot >= 0 else self.padding_sampling_slot,
            "min_p": min_p, "presence_penalty": sp.presence_penalty,
            "frequency_penalty": sp.frequency_penalty, "repetition_penalty": sp.repetition_penalty,
        }
        if self.spec:
            values.update(spec_slot=req.spec_slot, spec_owner_slot=req.spec_slot)
        if "lora_slot" in self.column:
            values["lora_slot"] = req.lora_slot
        bits = sp.features()
        try:
            for name, value in values.items():
                m, j = self.column[name]
                m[s, j] = value
            self.meta[s] = (len(req.prompt_tokens), sp.min_tokens, bits, sp.top_n_logprobs)
        except (OverflowError, TypeError, ValueError):
            return
        self._free.pop()
        req.decode_slot = s
        self._epoch += 1
        self.table[s] = DUMMY_BLOCK
        self.num_blocks[s] = 0
        self.sync_blocks(req)

    def sync_blocks(self, req: DynamicInferenceRequest) -> None:
        """After ``req.block_ids`` grew or shrank: write the changed part of its row."""
        s = req.decode_slot
        if s < 0:
            return
        old, new = int(self.num_blocks[s]), len(req.block_ids)
        if new > old:
            self.table[s, old:new] = req.block_ids[old:]
        elif new < old:
            self.table[s, new:old] = DUMMY_BLOCK
        self.num_blocks[s] = new

    def free(self, req: DynamicInferenceRequest) -> None:
        s = req.decode_slot
        if s >= 0:
            self._free.append(s)
            req.decode_slot = -1

    # ------------------------------------------------------------------ the step
    def invalidate(self, buffer: int) -> None:
        """Something else (the general path) wrote host buffer ``buffer``."""
        self._constant.pop(buffer, None)

    def assemble(self, plan: StepPlan, v: dict[str, np.ndarray], buffer: int, mamba: bool) -> StepShape | None:
        """Fill host views ``v`` (of ring buffer ``buffer``) for a decode-only ``plan``; None
        (nothing written) when the plan is not covered. Like the general path, it changes no
        request (the request book commits the step)."""
        rows = plan.rows
        R = len(rows)
        bs = self.block_size
        if plan.plain_decode:  # the scheduler's columns: positions computed, KV places reserved
            starts_l, prevs_l, slots_l = plan.decode_columns
            slots = np.array(slots_l, dtype=np.int64)
            if slots.min() < 0:
                return None  # a request without a slot here
            starts = np.array(starts_l, dtype=np.int64)
            prevs = np.array(prevs_l, dtype=np.int64)
            block_idx = starts // bs
        else:
            if R == 0 or not all(row.num_tokens == 1 and row.samples for row in rows):
                return None
            slots = np.fromiter([row.request.decode_slot for row in rows], np.int64, R)
            starts = np.fromiter([row.start for row in rows], np.int64, R)
            prevs = np.fromiter([row.prev_row for row in rows], np.int64, R)
            computed = np.fromiter([row.request.num_computed_tokens for row in rows], np.int64, R)
            block_idx = starts // bs
            if slots.min() < 0 or (starts != computed).any() or (block_idx >= self.num_blocks[slots]).any():
                return None  # the general path raises for it, naming the request
        ids = np.zeros(R, dtype=np.int64)
        if prevs.min() < 0:  # some input known on the host (serial decode, a last prompt token)
            try:
                for r in np.flatnonzero(prevs < 0).tolist():
                    ids[r] = rows[r].request.token_at(int(starts[r]))
            except Exception:  # noqa: BLE001 -- the general path raises it again, for that request alone
                return None
            prevs[prevs < 0] = -1
        if self.spec:  # rows continuing a launch that verified drafts: input and correction from the spec state
            inflight = prevs >= 0 if plan.inflight_verified else np.zeros(R, dtype=bool)
            v["spec_inflight"][:R] = inflight
            v["spec_src"][:R] = np.where(inflight, 0, -1)
            prevs[inflight] = -1
        constant = self._write_constant(v, buffer, slots)
        v["block_table"][:R] = np.take(self.table, slots, axis=0)
        slot_mapping = v["slot_mapping"][:R]
        slot_mapping[:] = self.table[slots, block_idx]
        slot_mapping *= bs
        slot_mapping += starts % bs
        positions1 = starts + 1
        v["input_ids"][:R] = ids
        v["prev_sample_idx"][:R] = prevs
        v["positions"][:R] = starts
        v["kv_lens"][:R] = positions1
        v["attention_row_order"][:R] = longest_first(positions1)
        v["sample_position"][:R] = positions1
        v["has_initial_state"][:R] = starts > 0
        if constant.any_penalties:  # min_tokens: stop ids suppressed while the output is short
            meta = np.take(self.meta, slots, axis=0)
            has_slot = v["sampling_slot"][:R] != self.padding_sampling_slot
            v["suppress_stop"][:R] = has_slot & (positions1 - meta[:, _PROMPT_LEN] < meta[:, _MIN_TOKENS])
        self.assembled += 1
        bits = constant.bits
        filters = (bool(bits & TOP_K), bool(bits & TOP_P), bool(bits & MIN_P))
        spec = self.spec
        return StepShape(R, R, 1, int(positions1.max()), True, bool(bits & SAMPLED), any(filters), constant.top_n,
                         bool(bits & LOG_PROBS), any_penalties=constant.any_penalties, filters=filters,
                         num_samples=R, sample_base=list(range(R)) if spec else None,
                         num_drafts=[0] * R if spec else None, num_multi_rows=0 if mamba else -1,
                         any_grammar=bool(bits & GRAMMAR), any_lora=constant.any_lora)

    def _write_constant(self, v: dict[str, np.ndarray], buffer: int, slots: np.ndarray) -> _Constant:
        """The columns that depend only on which requests sit in which rows (their sampling
        fields, the row / sample indices). A buffer that already holds them for the same slots
        (no admission since: a slot's values change only then) keeps them: padding for a graph
        writes only past the real rows, and the general path invalidates the buffer."""
        R = len(slots)
        key = (self._epoch, slots.tobytes())
        known = self._constant.get(buffer)
        if known is not None and known.key == key:
            return known
        for m, names in self.groups:
            got = np.take(m, slots, axis=0)
            for j, name in enumerate(names):
                v[name][:R] = got[:, j]
        rows_i = self._arange[:R]
        v["token_to_row"][:R] = rows_i
        v["sample_token_idx"][:R] = rows_i
        v["cu_query_lens"][: R + 1] = self._arange[: R + 1]
        if "mamba_row_order" in v:  # every row one token: the rows in row order (metadata.mamba_row_order)
            v["mamba_row_order"][:R] = rows_i
        if self.spec:  # no drafts: one sample per row, at the row's index
            v["num_drafts"][:R] = 0
            v["sample_base"][:R] = rows_i
            v["sample_to_row"][:R] = rows_i
        meta = np.take(self.meta, slots, axis=0)
        any_penalties = bool((v["sampling_slot"][:R] != self.padding_sampling_slot).any())
        if not any_penalties:
            v["suppress_stop"][:R] = False
        any_lora = "lora_slot" in v and bool((v["lora_slot"][:R] >= 0).any())
        known = self._constant[buffer] = _Constant(key, int(np.bitwise_or.reduce(meta[:, _FLAG_BITS])),
                                                   int(meta[:, _TOP_N].max()), any_penalties, any_lora)
        return known


@dataclass
class _Constant:
    """What ``_write_constant`` wrote into one buffer, and the step flags that follow from it."""

    key: tuple
    bits: int
    top_n: int
    any_penalties: bool
    any_lora: bool
    """Some row's request has a LoRA adapter (slot >= 0)."""
