"""Shared helpers of the speculative-decoding tests: plain vs speculative runs of one workload."""
from __future__ import annotations

from megatron_async.inference.speculative.oracle import OracleDrafter
from tests.helpers.engine_harness import Arrival, make_llm, run_arrivals


def oracle_for(plain_outs: dict, arrivals: list[Arrival], rate: float, vocab: int = 256) -> OracleDrafter:
    """An oracle drafter that knows the plain run's continuation of every prompt."""
    cont = {tuple(a.prompt): plain_outs[i].generated_tokens for i, a in enumerate(arrivals)}
    return OracleDrafter(cont, rate, vocab, max_generated=256)


def assert_same_outputs(plain: dict, spec: dict, log_prob_tol: float = 1e-4) -> None:
    """Tokens and finish reasons equal; log-probs equal up to the rounding of a (k + 1)-token
    row's logits against a 1-token row's (bit-equal needs batch_invariant)."""
    assert plain.keys() == spec.keys()
    for i in plain:
        a, b = plain[i], spec[i]
        assert a.generated_tokens == b.generated_tokens, (i, a.generated_tokens, b.generated_tokens)
        assert a.finish_reason == b.finish_reason, (i, a.finish_reason, b.finish_reason)
        if a.generated_log_probs is not None:
            assert len(a.generated_log_probs) == len(b.generated_log_probs)
            diff = max((abs(x - y) for x, y in zip(a.generated_log_probs, b.generated_log_probs)), default=0.0)
            assert diff <= log_prob_tol, (i, diff)


def run_plain_and_spec(path, arrivals: list[Arrival], k: int = 3, drafter_rate: float | None = 0.3,
                       method: str = "ngram", async_modes=(False, True), **cfg):
    """Run the workload plainly, then with speculation in each mode; returns
    {async_mode: (plain_outs, spec_outs, spec_stats)}. ``drafter_rate``: oracle drafter with
    that corruption rate; None: the config's ``method``."""
    results = {}
    for mode in async_modes:
        plain = run_arrivals(make_llm(path, async_scheduling=mode, **cfg), arrivals)
        drafter = oracle_for(plain, arrivals, drafter_rate) if drafter_rate is not None else None
        cfg_spec = dict(cfg, num_speculative_tokens=k, speculative_method=method)
        cfg_spec.setdefault("speculative_min_acceptance", 0.0)
        llm = make_llm(path, drafter, async_scheduling=mode, **cfg_spec)
        spec = run_arrivals(llm, arrivals)
        assert_same_outputs(plain, spec)
        st = llm.engine.stats
        assert llm.context.gpu_view.num_copies == st.steps  # still one H2D copy per step
        if mode:
            assert st.overlapped_steps > 0, st.as_dict()
        results[mode] = (plain, spec, st)
    return results


def assert_partial_acceptance(st) -> None:
    """Every accept / reject path ran: some drafts accepted, some rejected, at every depth."""
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens, st.as_dict()
    assert all(0 < a < d for a, d in zip(st.spec_accepted_tokens_per_depth, st.spec_draft_tokens_per_depth)), \
        st.as_dict()
