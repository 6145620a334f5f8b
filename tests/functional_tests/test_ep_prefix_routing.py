"""Rank 0 of a data-parallel job (``expert_parallel_size``) routes by ``InferenceConfig.dp_routing``:
on CPU, gloo + ZMQ, spawned ranks of the built-in tiny Qwen3-MoE with prefix caching.

A multi-turn workload (every conversation's turn t at once, shuffled; each prompt = the previous
prompt + its answer + new tokens): ``longest_prefix`` and ``scored`` keep nearly the prefix hits of
one engine holding everything, ``load_balanced`` loses about half; the samples of one prompt
(a GRPO group) stay on one rank; routing changes no token. With a small KV pool, what a rank's
cache reclaimed reaches rank 0 (rank 1's through its uploads, rank 0's from its own allocator) and
routing no longer sends that prompt's next turn where it is gone."""
from __future__ import annotations

import random

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from tests.helpers.multiprocess import run_ranks

CONFIG = dict(block_size_tokens=4, num_kv_blocks=128, max_requests=8, max_tokens=64, max_sequence_length=128,
              enable_prefix_caching=True)
ANSWER = SamplingParams(top_k=1, num_tokens_to_generate=4, ignore_eos=True)


def multi_turn(llm: LLM, conversations: int = 8, turns: int = 4, seed: int = 0) -> list[list[int]]:
    """Every rank runs it (``generate`` is collective); the outputs' tokens, turn by turn."""
    rng = random.Random(seed)
    convs = [[rng.randrange(1, 500) for _ in range(16)] for _ in range(conversations)]
    tokens = []
    for _ in range(turns):
        order = rng.sample(range(conversations), conversations)
        for c, out in zip(order, llm.generate([convs[c] for c in order], ANSWER)):
            tokens.append(out.generated_tokens)
            convs[c] = convs[c] + out.generated_tokens + [rng.randrange(1, 500) for _ in range(8)]
    groups = [[rng.randrange(500, 1000) for _ in range(13)] for _ in range(2)]
    for out in llm.generate([groups[0]] * 4 + [groups[1]] * 4, ANSWER):  # two groups of 4 samples
        tokens.append(out.generated_tokens)
    return tokens


def _admitted(llm: LLM) -> list[tuple[int, ...]]:
    """The prompts this rank admits, in order (a spy on the engine's admission)."""
    eng, seen = llm.engine, []
    admit = eng._admit

    def spy(new):
        seen.append(tuple(new.valid.prompt_tokens))
        admit(new)

    eng._admit = spy
    return seen


def _turns_worker(rank: int, world: int, policy: str, alpha: float, tp: int) -> dict:
    llm = LLM(None, inference_config=InferenceConfig(**CONFIG, dp_routing=policy, dp_routing_alpha=alpha),
              default_model="tiny-moe", tensor_parallel_size=tp, expert_parallel_size=world // tp)
    try:
        admitted = _admitted(llm)
        tokens = multi_turn(llm)
        st = llm.engine.stats
        return {"tokens": tokens, "hits": st.prefix_hit_tokens, "served": st.finished_requests,
                "groups": [p for p in admitted if p[0] >= 500], "tp_rank": llm.parallel.tp_rank}
    finally:
        llm.close()


def _job(policy: str, alpha: float = 0.5, world: int = 2, tp: int = 1) -> dict:
    """Hits and served requests summed over the data-parallel ranks (one TP rank of each)."""
    ranks = [r for r in run_ranks(_turns_worker, world, policy, alpha, tp, timeout_s=120) if r["tp_rank"] == 0]
    return {"tokens": ranks[0]["tokens"], "hits": sum(r["hits"] for r in ranks),
            "served": [r["served"] for r in ranks], "groups": [r["groups"] for r in ranks]}


@pytest.fixture(scope="module")
def one_engine() -> dict:
    """One engine holding what the two ranks hold together."""
    llm = LLM(None, inference_config=InferenceConfig(**{**CONFIG, "num_kv_blocks": 2 * CONFIG["num_kv_blocks"]}),
              default_model="tiny-moe")
    return {"tokens": multi_turn(llm), "hits": llm.engine.stats.prefix_hit_tokens}


def test_prefix_routing_keeps_one_engines_hits_and_changes_no_token(one_engine):
    lb = _job("load_balanced")
    assert lb["tokens"] == one_engine["tokens"]
    assert lb["hits"] < 0.75 * one_engine["hits"], (lb["hits"], one_engine["hits"])  # turns spread: hits lost
    assert any(len(set(g)) == 2 for g in lb["groups"])  # the groups' samples spread over both ranks
    for policy, alpha in (("longest_prefix", 0.5), ("scored", 0.5)):
        got = _job(policy, alpha)
        assert got["tokens"] == lb["tokens"], policy  # greedy: routing changes no token
        assert got["hits"] >= 0.9 * one_engine["hits"], (policy, got["hits"], lb["hits"], one_engine["hits"])
        assert max(got["served"]) <= 1.5 * min(got["served"]), (policy, got["served"])
        # each group of 4 samples of one prompt on one rank (4 of a rank's 8 slots are free)
        assert sorted(len(g) for g in got["groups"]) == [4, 4] and all(len(set(g)) == 1 for g in got["groups"])


def test_tp2_x_ep2_routes_to_data_parallel_ranks(one_engine):
    """The routing unit is the data-parallel rank: its TP ranks admit the same requests."""
    got = _job("longest_prefix", world=4, tp=2)
    assert got["tokens"] == one_engine["tokens"]
    assert got["hits"] >= 0.9 * one_engine["hits"], (got["hits"], one_engine["hits"])


SMALL = dict(block_size_tokens=4, num_kv_blocks=20, max_requests=4, max_tokens=64, max_sequence_length=64,
             enable_prefix_caching=True, dp_routing="longest_prefix")


def _eviction_worker(rank: int, world: int) -> dict:
    """A on rank 0, B on rank 1; fillers with short prompts and long answers make both caches
    reclaim A's and B's blocks (while the view's capacity bound keeps their keys); then B's next
    turn alone goes to rank 0 (no rank holds it: the lowest of equal loads), and A's next turn,
    behind a request X on rank 0, to rank 1 (the less loaded)."""
    llm = LLM(None, inference_config=InferenceConfig(**SMALL), default_model="tiny-moe", expert_parallel_size=world)
    try:
        admitted, rng = _admitted(llm), random.Random(1)
        a, b = ([rng.randrange(1, 500) for _ in range(17)] for _ in range(2))
        out_a, out_b = llm.generate([a, b], ANSWER)
        fillers = [[600 + i] + [rng.randrange(1, 500) for _ in range(7)] for i in range(8)]
        llm.generate(fillers, SamplingParams(top_k=1, num_tokens_to_generate=24, ignore_eos=True))
        b2 = b + out_b.generated_tokens + [7, 8, 9, 10]
        llm.generate([b2], ANSWER)
        a2, x = a + out_a.generated_tokens + [7, 8, 9, 10], [900] * 9
        llm.generate([x, a2], SamplingParams(top_k=1, num_tokens_to_generate=8, ignore_eos=True))
        where = {name: tuple(p) in admitted for name, p in (("a", a), ("b", b), ("a2", a2), ("b2", b2), ("x", x))}
        router = llm.engine.ranks.router
        return {"where": where, "reported": router.evicted_keys if router is not None else 0}
    finally:
        llm.close()


def test_evictions_reported_by_the_ranks_remove_affinity():
    r0, r1 = run_ranks(_eviction_worker, 2, timeout_s=120)
    assert r0["where"]["a"] and r1["where"]["b"]  # first placements: A on rank 0, B on rank 1
    assert r0["reported"] > 0
    assert r0["where"]["b2"] and not r1["where"]["b2"], "rank 1 reclaimed B: its next turn goes by load"
    assert r0["where"]["x"] and r1["where"]["a2"], "rank 0 reclaimed A: its next turn goes to the less loaded"
