"""Launch-ahead releases a request whose in-flight sample reaches its length limit before the
next step is scheduled (``RequestBook.release_finishing``). The book walks the active requests
only when one it noted (at a commit, or when accepted drafts landed) qualifies: on every step of
real engine runs (plain and speculative, a small KV pool that pauses and evicts, EOS and
length stops) it releases exactly the requests a walk over every active request finds."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections import Counter  # noqa: E402

import pytest  # noqa: E402

from megatron_async import LLM, InferenceConfig  # noqa: E402
from megatron_async.inference.request import Status  # noqa: E402
from tests.helpers.engine_harness import run_arrivals  # noqa: E402
from tests.unit_tests.inference.test_decode_rows import _arrivals  # noqa: E402


def _qualifying(ctx) -> set[int]:
    """Every active request whose sample in flight reaches its limit (a walk over all)."""
    return {r.request_id for r in ctx.active.values() if r.num_inflight and r.status == Status.ACTIVE
            and len(r.generated_tokens) + r.num_inflight >= r.max_generated_tokens}


def _checked(llm, seen: Counter) -> None:
    book, ctx = llm.engine.book, llm.context
    release = book.release_finishing

    def check():
        want, before = _qualifying(ctx), set(ctx.active)
        release()
        assert before - set(ctx.active) == want, (want, before - set(ctx.active))
        seen["steps"] += 1
        seen["released"] += len(want)
        seen["walked"] += bool(want)

    book.release_finishing = check


def _run(arrivals, seen: Counter, drafter=None, **cfg) -> dict[int, list[int]]:
    config = InferenceConfig(block_size_tokens=4, num_kv_blocks=24, max_requests=8, max_tokens=40,
                             max_sequence_length=64, async_scheduling=True, **cfg)
    llm = LLM(None, inference_config=config, drafter=drafter)
    _checked(llm, seen)
    outs = {i: o.generated_tokens for i, o in run_arrivals(llm, arrivals).items()}
    stats = llm.engine.stats
    assert stats.paused + stats.evicted > 0, "the pool was meant to run short"
    seen["accepted"] += stats.spec_accepted_tokens
    return outs


@pytest.mark.parametrize("seed", [0, 1])
def test_noted_requests_release_what_a_walk_finds(seed):
    seen = Counter()
    arrivals = _arrivals(seed, 24, 1000)
    _run(arrivals, seen)
    assert seen["released"] >= 5 and seen["walked"] < seen["steps"], seen


def test_noted_requests_release_what_a_walk_finds_speculative():
    """Accepted drafts bring a request's limit within its next launch while it is in flight."""
    from megatron_async.inference.speculative.oracle import OracleDrafter

    arrivals = _arrivals(5, 20, 1000)
    plain = _run(arrivals, Counter())
    cont = {tuple(a.prompt): plain[i] for i, a in enumerate(arrivals)}
    seen = Counter()
    outs = _run(arrivals, seen, drafter=OracleDrafter(cont, 0.7, 1000, 64), num_speculative_tokens=3,
                speculative_min_acceptance=0.0)
    assert outs == plain
    assert seen["released"] >= 5 and seen["accepted"] > 0, seen
