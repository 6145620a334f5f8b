"""The speculative policy against a simulated device, on a CPU: a batch of requests decodes to
a fixed length with step costs a function of (batch, verify width, tokens landed), drafts
accepted per position at a set rate, and the engine's step flow around the policy (plan_step,
drafts_for, may_any_draft_next, the plain / drafter steps of plain_steps.py, stale drafts after a
plain step, and, as under launch-ahead, a step's costs and acceptances reaching the policy one
step after the next step was planned). Its tok/s is compared with plain decoding's and with
drafting at a fixed width every step (the better fixed choice a policy must match).

``H100`` is calibrated on bench_speculative's H100 rows (qwen3-0.6b, bf16, batch-invariant, CUDA
graphs, 128-token prompts and outputs; plain and forced runs, which no rule decides; within 8 %:
test_spec_adaptive.py). A step's wall is the larger of
- the device's: plain decode 1.65 ms at batch 1 and 2.9 ms at 128, a verify step of width 4
  1.1x / 2.1x that, linear in the batch and the extra tokens, a step that runs the drafter
  without drafts 3 % more;
- the host's: 0.5 ms + 0.02 ms a row (3.1 ms at 128 rows: the plain engine is host-bound
  there), a verify step 0.01 ms a row and 0.012 ms an emitted token more (its landing), and
  ``host_rule_row`` a row for the adaptive rule's own work (0 in the tests: the rule's
  decisions alone; today's main at 0.006 reproduced its 0.76x at batch 128 / 0 %).
Requests arrive at once: prompts are prefilled 16 a step (8 ms a step at 2,048 tokens) while the
earlier ones decode, a prefill step that also verifies drafts costs 10 ms more (no graph:
eager), and requests then finish apart (the closed batch's tail). Every wall jitters by 3 %.
``DEVICE_BOUND`` is the device alone, every request decoding from the first step (the
simulation before calibration, plain 3.5 ms at batch 128), where drafting pays far more."""
from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

from megatron_async import InferenceConfig
from megatron_async.inference.speculative.policy import SpecPolicy

WIDTHS = (2, 4)


@dataclass(frozen=True)
class Device:
    plain_1: float = 1.65  # ms, the device's plain decode step at batch 1
    plain_128: float = 2.9  # and at 128
    wide_1: float = 1.1  # device cost(B, 4) / cost(B, 1)
    wide_128: float = 2.1
    drafter: float = 0.03  # a decode step that runs the drafter without drafts, over a plain one
    jitter: float = 0.03
    spike: int = 0  # one step in this many seems to take 30 times as long (a host hiccup in its wall; 0: none)
    # the host's step (launch-ahead hides it below the device's): ms per step, per row, and per
    # verify row and emitted token of a verify step, and the adaptive rule's per row (its gains pass)
    host_0: float = 0.5
    host_row: float = 0.020
    host_verify_row: float = 0.010
    host_token: float = 0.012
    host_rule_row: float = 0.0
    prefill: float = 8.0  # a prefill step of 2,048 tokens (mixed graph)
    eager: float = 10.0  # more when it also verifies drafts (no graph: eager)
    chunk_rows: int = 16  # prompts a prefill step holds: requests start decoding this many a step

    def ms(self, rows: int, width: int, drafter: bool = False, tokens: int = 0, rule: bool = False) -> float:
        f = (rows - 1) / 127
        plain = self.plain_1 + (self.plain_128 - self.plain_1) * f
        extra = (self.wide_1 - 1 + (self.wide_128 - self.wide_1) * f) * (width - 1) / 3
        device = plain * (1 + extra + (self.drafter if width == 1 and drafter else 0.0))
        host = self.host_0 + rows * (self.host_row + self.host_rule_row * rule)
        if width > 1:
            host += rows * self.host_verify_row + tokens * self.host_token
        return max(device, host)


H100 = Device()
"""Calibrated on the H100 rows of bench_speculative (qwen3-0.6b, bf16, batch-invariant, graphs):
see docs/PERFORMANCE.md, speculative decoding."""
DEVICE_BOUND = Device(host_0=0.0, host_row=0.0, host_verify_row=0.0, host_token=0.0, prefill=0.0, eager=0.0,
                      chunk_rows=1 << 30, plain_128=3.5)
"""The simulation before calibration: the device's costs alone, every request decoding from the start."""


@dataclass
class SimRun:
    tokens: int
    seconds: float
    steps: int
    verify_steps: int
    drafter_steps: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def make_policy(k: int = 3, **cfg) -> SpecPolicy:
    return SpecPolicy(InferenceConfig(num_speculative_tokens=k, speculative_adaptive=True, **cfg).speculation())


def _request() -> SimpleNamespace:
    return SimpleNamespace(spec_acceptance=0.0, spec_positions=0.0, spec_drafts_fresh=True, banned_sequences=(), left=0,
                           sampling_params=SimpleNamespace(has_penalties=False, structured_outputs=None))


def run(policy: SpecPolicy | None, rows: int, acceptance: float, length: int = 128, device: Device = H100,
        seed: int = 0, fixed_width: int = 0) -> SimRun:
    """``rows`` requests of ``length`` tokens each decode to the end under ``policy`` (None with
    ``fixed_width`` W: every row drafts W - 1 every step; None with 0: plain decoding)."""
    rng = random.Random(seed)
    reqs = [_request() for _ in range(rows)]
    for r in reqs:  # whether a draft of each position lands: the same for every policy
        r.left, r.hits = length, [rng.random() < acceptance for _ in range(length + 1)]
        if policy is not None:
            policy.admit(r)
    tokens = steps = verify = drafter_steps = 0
    seconds, landing, had_drafts = 0.0, None, False
    chunk_steps = -(-rows // device.chunk_rows) if rows > device.chunk_rows else 0
    for i, r in enumerate(reqs):  # prefill chunks: requests start decoding a step group after another
        r.start = i // device.chunk_rows if chunk_steps else -1
    while True:
        live = [r for r in reqs if r.left > 0 and r.start < steps]
        if not live and steps >= chunk_steps:
            break
        B, chunks = len(live), steps < chunk_steps
        if policy is not None:
            policy.begin_step()
            policy.plan_step(live, chunks)
            drafts = [policy.drafts_for(r, B, room=min(policy.k, r.left - 1)) for r in live]
        else:
            drafts = [min(fixed_width - 1, r.left - 1) if fixed_width else 0 for r in live]
        widest = max(drafts, default=0)
        # plain_steps.py: the machinery runs for drafts, after a launch with drafts, or when the
        # next step may draft; a request whose launch ran without it has stale drafts
        machinery = widest > 0 or had_drafts or (policy is not None and policy.may_any_draft_next(live))
        for r in live:
            r.spec_drafts_fresh = machinery
        width = 1 if widest == 0 else next(w for w in WIDTHS if w > widest)
        accepted = []
        for r, k in zip(live, drafts):
            a, at = 0, length - r.left + 1
            while a < k and r.hits[at + a]:
                a += 1
            accepted.append(a)
        emitted = len(live) + sum(accepted)
        wall = device.ms(B, width, machinery, emitted, policy is not None and policy.adaptive) if B else 0.0
        if chunks:
            wall += device.prefill + (device.eager if widest else 0.0)
        wall *= (1 + device.jitter * rng.gauss(0, 1)) / 1e3
        seen = wall * 30 if device.spike and rng.randrange(device.spike) == 0 else wall
        for r, a in zip(live, accepted):
            r.left -= 1 + a
            tokens += 1 + a
        seconds += wall
        steps += 1
        verify += widest > 0
        drafter_steps += machinery and widest == 0
        had_drafts = widest > 0
        if landing is not None:  # launch-ahead: the previous step lands after this one is planned
            _land(policy, *landing)
        landing = (live, drafts, accepted, seen, machinery, not chunks)
    if landing is not None:
        _land(policy, *landing)
    return SimRun(tokens, seconds, steps, verify, drafter_steps)


def _land(policy: SpecPolicy | None, live, drafts, accepted, wall, machinery, decode_only) -> None:
    if policy is None:
        return
    for r, k, a in zip(live, drafts, accepted):
        policy.observe(r, k, a)
    if decode_only and live:
        policy.observe_step(len(live), max(drafts), wall, drafter=machinery)


def forced_run(rows: int, acceptance: float, length: int = 128, device: Device = H100, seed: int = 0) -> SimRun:
    """bench_speculative's "forced" row: every row drafts k every step (prefill steps too)."""
    policy = make_policy()
    policy.adaptive, policy.min_acceptance = False, 0.0
    return run(policy, rows, acceptance, length, device, seed)


def fixed_choices(rows: int, acceptance: float, length: int = 128, device: Device = H100, seed: int = 0
                  ) -> dict[int, float]:
    """tok/s of each fixed choice: 0 plain decoding, W drafting at width W every step."""
    return {w: run(None, rows, acceptance, length, device, seed, fixed_width=w).tok_s for w in (0, *WIDTHS)}


def best_fixed(rows: int, acceptance: float, length: int = 128, device: Device = H100, seed: int = 0) -> float:
    """tok/s of the better fixed choice: plain decoding or drafting at one width every step."""
    return max(fixed_choices(rows, acceptance, length, device, seed).values())


def bench_sequence(rows: int, acceptances, length: int = 128, device: Device = H100, seed: int = 0,
                   forced: bool = False, **cfg) -> dict[float, tuple[float, float]]:
    """One policy (one engine) serves an untimed workload at 0 % acceptance, then one workload
    per acceptance in turn (``forced``: as bench_speculative runs a batch, each after a workload
    with drafting forced, the non-adaptive rule at minimum acceptance 0). Per acceptance: (the
    adaptive rule's tok/s over the better fixed choice's, over plain decoding's)."""
    policy = make_policy(**cfg)
    run(policy, rows, 0.0, length, device, seed)
    out = {}
    for i, acc in enumerate(acceptances):
        if forced:
            policy.adaptive, policy.min_acceptance = False, 0.0
            run(policy, rows, acc, length, device, seed + i + 1)
            policy.adaptive = True
        got = run(policy, rows, acc, length, device, seed + i + 1).tok_s
        fixed = fixed_choices(rows, acc, length, device, seed + i + 1)
        out[acc] = got / max(fixed.values()), got / fixed[0]
    return out
