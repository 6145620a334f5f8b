"""How many drafts a decode row verifies: speculation switches itself off where it does not pay.

Host-side and cheap: the scheduler asks once per decode row. A request's acceptance is a
moving average of accepted / drafted over its bookkept verify rows (a row weighs as many
drafts as it verified); below ``speculative_min_acceptance`` the request decodes plainly and
probes with one draft every ``speculative_probe_interval`` steps. The probes of all
switched-off requests fall on the same steps (a step clock, not a per-request count): one
probing row makes the whole step a verify step (a verify graph pads every row to 2 tokens),
so staggered probes made every step of a large batch a verify step (batch 128, 0 %
acceptance: 0.47x plain decode with graphs). Steps with more decode rows than
``speculative_max_batch_size`` run plainly (verify work grows with the batch while the
saving does not). Requests with penalties or ``min_tokens`` never draft: their device token
counts advance by every sample of a row, rejected ones included; nor do requests with a grammar
(structured outputs): their masks come from the host, one per row. Every row that could have
drafted but did not is counted by cause (EngineStats reads these counters).

A request starts from the engine's recent acceptance (``recent_acceptance``: the same kind of
average over every request's verify rows, slower; 1.0 before any), not from 1.0: at 0 %
acceptance each new request would otherwise pay 2-4 wide verify rows before switching off,
and a batch of them as many wide verify steps (batch 128 / 0 %). A request that
starts switched off drafts from its first probe on if drafts land.

Drafts for a row come from the drafter's run in the request's previous launch. A step without
drafts (decode rows, prefill chunks) after which no row can draft runs the plain engine's step,
drafter and spec state untouched (``may_any_draft_next`` guesses; plain_steps.py decides the
step): a request whose latest launch was such a step has no drafts for its next row
(``spec_drafts_fresh`` False) and decodes that row plainly, counted as "stale"; that row's step
runs the drafter again.

Adaptive mode (``speculative_adaptive``, on for CUDA): before a step's decode rows draft,
``plan_step`` caps the drafts of every row of the step by the kind of step that costs least per
generated token at this batch, measured (step_choice.py; the switch-off by
``speculative_min_acceptance`` and its probes do not apply, the rule's trials and probes take
their place). A step that carries prefill chunks drafts nothing (cause "prefill"): under CUDA
graphs drafts would make it eager; nor does the step before it run the drafter
(``chunks_next``). A step the rule runs plain counts its rows' causes in one
pass (``count_undrafted``), not a ``drafts_for`` call per row. Tokens never depend on the
choice (drafts only ever save steps)."""
from __future__ import annotations

from collections import Counter

from megatron_async.config import Speculation
from megatron_async.inference.request import DynamicInferenceRequest
from megatron_async.inference.speculative.step_choice import StepChoice

_EMA = 0.25  # weight of the newest draft in a request's acceptance average
_ENGINE_EMA = 1 / 16  # in the engine average (new requests start from it): ~40 rejected drafts take it from 1 to 0.1


class SpecPolicy:
    def __init__(self, config: Speculation):
        self.k = config.num_speculative_tokens
        self.min_acceptance = config.speculative_min_acceptance
        self.probe_interval = config.speculative_probe_interval
        self.max_batch = config.speculative_max_batch_size
        self.recent_acceptance = 1.0
        """Acceptance average over every request's verify rows (weighted per draft, as
        ``observe``): where a new request's ``spec_acceptance`` starts (``admit``)."""
        self.step = 0
        """Steps scheduled so far: switched-off requests probe when it is a multiple of the interval."""
        self.off_rows: Counter = Counter()
        """Decode rows run without drafts, by cause: "penalties", "grammar", "batch", "acceptance", "cost", "prefill", "stale"."""
        self.adaptive = bool(config.speculative_adaptive) and self.k > 0
        K = self.k
        self.widths = sorted({w for w in (config.cuda_graph_verify_widths or (2, K + 1)) if 2 <= w <= K + 1}
                             | {K + 1}) if K else []
        """Verify widths the step may choose (the verify graphs' widths)."""
        self.choice = StepChoice(self.widths)
        self.costs = self.choice.costs
        self.step_cap = K
        """Drafts a row of the step being scheduled may verify at most (``plan_step``)."""
        self._cap_cause = "cost"  # why ``step_cap`` is 0: "cost" (the rule) or "prefill" (chunks in the step)
        self.chunks_next = False
        """The step after the one just scheduled will carry prefill chunks (a chunk of it does not
        end its prompt, or a waiting request may be admitted): the scheduler's guess, so that
        adaptive ``may_any_draft_next`` answers no without asking the rule."""
        self._undrafted: tuple = (None, Counter())  # (rows' key, causes) of the latest ``count_undrafted``

    @property
    def enabled(self) -> bool:
        return self.k > 0

    def begin_step(self) -> None:
        self.step += 1

    def drafts_for(self, req: DynamicInferenceRequest, num_decode_rows: int, room: int) -> int:
        """Drafts for ``req``'s next decode row; ``room``: the most its length limits and the
        step's token budget allow."""
        if self.k == 0 or room <= 0:
            return 0
        cause = _row_cause(req, bool(self.max_batch) and num_decode_rows > self.max_batch)
        if cause is not None:
            self.off_rows[cause] += 1
            return 0
        if req.spec_acceptance < self.min_acceptance and not self.adaptive:
            if self.step % self.probe_interval:
                self.off_rows["acceptance"] += 1
                return 0
            drafts = 1  # probe: one draft tells whether drafts land again, at the least cost
        else:
            drafts = min(self.k, room)
        if self.step_cap == 0:
            self.off_rows[self._cap_cause] += 1
            return 0
        return self._fresh(req, min(drafts, self.step_cap))

    def count_undrafted(self, requests: list[DynamicInferenceRequest], rooms: list[int], spare: int) -> None:
        """``drafts_for`` of every decode row of a step whose ``step_cap`` is 0 (adaptive: a plain
        step), in one pass without a call per row: each row counted by the cause ``drafts_for``
        would count (``rooms``: the rows' token rooms; ``spare``: the step's tokens to spare)."""
        if self.k == 0 or spare <= 0:
            return
        # the same rows as the latest plain step, none at its length limit: the same causes
        key = (len(requests), sum(map(id, requests)), self.choice.admitted, self._cap_cause)
        if key != self._undrafted[0] or min(rooms, default=2) <= 1:
            counts: Counter = Counter()
            batch = bool(self.max_batch) and len(requests) > self.max_batch
            for req, room in zip(requests, rooms):
                if room <= 1:
                    continue
                counts[_row_cause(req, batch) or self._cap_cause] += 1
            self._undrafted = (key, counts)
        self.off_rows.update(self._undrafted[1])

    def _fresh(self, req: DynamicInferenceRequest, drafts: int) -> int:
        if req.spec_drafts_fresh:
            return drafts
        self.off_rows["stale"] += 1  # its latest launch ran without the drafter: nothing to verify
        return 0

    def may_any_draft_next(self, requests: list[DynamicInferenceRequest]) -> bool:
        """Could a row of ``requests`` (the sampling rows of the step being launched: decode
        rows, prompts' last chunks) draft in the next step? A guess from what is known now (the
        next step's rows as these, ``chunks_next``), for deciding whether this step runs the
        drafter: wrong only in cost (a wasted drafter run, or a row decoded plainly as "stale"),
        never in tokens: ``drafts_for`` checks ``spec_drafts_fresh``."""
        if self.k == 0 or self.max_batch and len(requests) > self.max_batch:
            return False
        if self.adaptive:
            if self.chunks_next:  # the next step drafts nothing ("prefill")
                return False
            return self.choose_cap(requests, self.step + 1, commit=False) > 0 and any(
                not _never_drafts(req) for req in requests)
        probe = (self.step + 1) % self.probe_interval == 0
        m = self.min_acceptance
        return any((probe or req.spec_acceptance >= m) and not _never_drafts(req) for req in requests)

    def plan_step(self, requests: list[DynamicInferenceRequest], chunks: bool = False) -> None:
        """The step being scheduled has ``requests`` as its decode rows (``chunks``: and prefill
        chunks): set ``step_cap``. Adaptive: a step with prefill chunks verifies nothing (with
        drafts it would run eager instead of replaying a mixed graph: under batch-invariant
        numerics on the H100 such a step of 2,048 tokens costs several decode steps, and the
        probes of a new batch's rows fell on every other prefill step)."""
        if not self.adaptive:
            self.step_cap = self.k
        elif chunks and requests:
            self.step_cap, self._cap_cause = 0, "prefill"
        else:
            self.step_cap, self._cap_cause = self.choose_cap(requests, self.step), "cost"

    def choose_cap(self, requests: list[DynamicInferenceRequest], step: int, commit: bool = True) -> int:
        """The adaptive rule (step_choice.py): the most drafts a row of a step of ``requests`` at
        scheduler step ``step`` verifies (0: the step runs without drafts). ``commit`` False: a
        look ahead (``StepChoice.choose``)."""
        if not requests:
            return self.k
        return min(self.k, self.choice.choose(requests, step, _may_draft, commit))

    def observe_step(self, rows: int, drafts: int, seconds: float, drafter: bool = False) -> None:
        """A landed decode step of ``rows`` rows whose widest row verified ``drafts`` drafts took
        ``seconds`` (the wall time of the engine's ``step()`` that landed it); ``drafter``: it ran
        the speculative machinery (a step without drafts then is not a plain step)."""
        if not self.adaptive:
            return
        width = 1 if drafts == 0 else next((w for w in self.widths if w >= drafts + 1), drafts + 1)
        self.choice.observe_step(rows, width, seconds, drafter, self.step)

    def admit(self, req: DynamicInferenceRequest) -> None:
        """A new request (not a recompute after eviction) starts from the engine's recent
        acceptance (adaptive: with no evidence of its own, so it follows the engine's)."""
        if self.adaptive:
            req.spec_acceptance, req.spec_positions = self.choice.acceptance, 0.0
            self.choice.admitted += 1
        else:
            req.spec_acceptance = self.recent_acceptance

    def observe(self, req: DynamicInferenceRequest, drafted: int, accepted: int) -> None:
        """Fold one bookkept verify row into the request's acceptance average, weighted as its
        ``drafted`` drafts one by one: a row of k rejected drafts is k pieces of evidence (at
        k = 3 and 0 % acceptance a request switches off after 2 verify rows instead of 5, each
        of which costs a (k + 1)-token row), a probe one; and into the engine's average.
        Adaptive mode counts positions instead (the a of the gain 1 + a + a^2 + ...: a row
        tried ``accepted`` positions that were accepted and, when it stopped short, one rejected
        one; step_choice.py)."""
        if drafted <= 0:
            return
        if self.adaptive:
            self.choice.observe_row(req, drafted, accepted)
            self.recent_acceptance = self.choice.acceptance
        else:
            rate = accepted / drafted
            req.spec_acceptance += (1.0 - (1.0 - _EMA) ** drafted) * (rate - req.spec_acceptance)
            self.recent_acceptance += (1.0 - (1.0 - _ENGINE_EMA) ** drafted) * (rate - self.recent_acceptance)


def _may_draft(req: DynamicInferenceRequest) -> bool:
    return not _never_drafts(req)


def _never_drafts(req: DynamicInferenceRequest) -> bool:
    """Penalties count every sample of a row on the device, rejected ones too; a grammar's masks
    come from the host, one per row."""
    sp = req.sampling_params
    return sp.has_penalties or sp.structured_outputs is not None


def _row_cause(req: DynamicInferenceRequest, batch: bool) -> str | None:
    """Why ``req``'s row drafts nothing whatever the step (``batch``: the decode rows exceed
    ``speculative_max_batch_size``), or None."""
    sp = req.sampling_params
    if sp.has_penalties:
        return "penalties"
    if sp.structured_outputs is not None:
        return "grammar"
    if req.banned_sequences:  # its bans follow its newest tokens, one at a time
        return "bad_words"
    return "batch" if batch else None
