"""The speculative policy against a simulated device: decode steps of B rows whose cost is a
given function of (B, width), drafts accepted per position with a fixed probability. Runs the
policy's real decisions (plan_step, drafts_for, observe, observe_step) and counts tokens and
simulated seconds, so its throughput against plain decoding is a number, on a CPU."""
from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

from megatron_async import InferenceConfig
from megatron_async.inference.speculative.policy import SpecPolicy


def device_costs(plain_ms: float, per_extra_token_ms: float):
    """cost(B, W) = plain + per_extra_token * B * (W - 1): a verify step pays for its extra tokens."""
    return lambda rows, width: plain_ms + per_extra_token_ms * rows * (width - 1)


@dataclass
class SimRun:
    tokens: int
    seconds: float
    verify_steps: int
    steps: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def make_policy(k: int = 3, **cfg) -> SpecPolicy:
    return SpecPolicy(InferenceConfig(num_speculative_tokens=k, speculative_adaptive=True, **cfg).speculation())


def run(policy: SpecPolicy, cost, rows: int, acceptance: float, steps: int, seed: int = 0) -> SimRun:
    """``rows`` new requests decode for ``steps`` steps (all arrive at once, none finishes)."""
    rng = random.Random(seed)
    reqs = [SimpleNamespace(spec_acceptance=0.0, spec_drafts_fresh=True, banned_sequences=(),
                            sampling_params=SimpleNamespace(has_penalties=False, structured_outputs=None)) for _ in range(rows)]
    for r in reqs:
        policy.admit(r)
    tokens, seconds, verify = 0, 0.0, 0
    for _ in range(steps):
        policy.begin_step()
        policy.plan_step(reqs)
        drafts = [policy.drafts_for(r, rows, room=policy.k) for r in reqs]
        widest = max(drafts)
        for r, k in zip(reqs, drafts):
            accepted = 0
            while accepted < k and rng.random() < acceptance:
                accepted += 1
            policy.observe(r, k, accepted)
            tokens += 1 + accepted
        width = 1 if widest == 0 else next(w for w in policy.widths if w > widest)
        step_s = cost(rows, width) / 1e3
        seconds += step_s
        verify += widest > 0
        policy.observe_step(rows, widest, step_s)
    return SimRun(tokens, seconds, verify, steps)


def ratio_to_plain(cost, rows: int, acceptance: float, steps: int, runs: int = 2, **cfg) -> tuple[float, float]:
    """(first run, last run) tok/s over plain decoding's, one policy kept across ``runs`` runs
    (an engine serving one workload after another)."""
    policy = make_policy(**cfg)
    plain = rows * 1e3 / cost(rows, 1)
    out = [run(policy, cost, rows, acceptance, steps, seed=i).tok_s / plain for i in range(runs)]
    return out[0], out[-1]
