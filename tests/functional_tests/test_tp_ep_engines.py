"""TP x EP engines on CPU (gloo + ZMQ, 4 spawned ranks): 2 data-parallel engines, each a TP=2
group (attention and dense layers split 2 ways, experts split 2 ways by EP and each expert 2
ways by TP). Tokens equal one engine's for every request whichever replica served it (greedy and
seeded, async and serial, staggered arrivals); the TP ranks of a replica are exact copies (same
requests, steps, dummy forwards); a replica left idle runs dummy forwards on both its ranks."""
from __future__ import annotations

from megatron_async import LLM, InferenceConfig, SamplingParams
from tests.functional_tests.test_data_parallel_engines import CONFIG, PROMPTS, run_all
from tests.helpers.multiprocess import run_ranks

LONG = SamplingParams(top_k=1, num_tokens_to_generate=12, ignore_eos=True)


def _worker(rank: int, world: int) -> dict:
    llm = LLM(None, inference_config=InferenceConfig(**CONFIG), default_model="tiny-moe", tensor_parallel_size=2,
              expert_parallel_size=2)
    try:
        par = llm.parallel
        assert (par.tp_rank, par.ep_rank, par.dp_rank) == (rank % 2, rank // 2, rank // 2)
        result = run_all(llm, rank)
        before = llm.engine.stats.dummy_steps
        result["idle"] = llm.generate([PROMPTS[0]], LONG)[0].generated_tokens  # one request: one replica idles
        eng, result["outputs_seen"] = llm.engine, 0
        if rank == 0:  # one request per replica: rank 0 must see each output once (not once per TP rank)
            for prompt in PROMPTS[1:3]:
                eng.add_request(prompt, LONG)
        while eng.has_unfinished_requests():
            result["outputs_seen"] += len(eng.step().finished)
        st = llm.engine.stats
        result.update(idle_dummies=st.dummy_steps - before, steps=st.steps, dummy=st.dummy_steps,
                      exchange_path=llm.communicator.exchange_path)
        return result
    finally:
        llm.close()


def test_tp2_x_ep2_tokens_equal_one_engine():
    one = LLM(None, inference_config=InferenceConfig(**CONFIG), default_model="tiny-moe")
    expected = run_all(one, 0)
    expected["idle"] = one.generate([PROMPTS[0]], LONG)[0].generated_tokens
    ranks = run_ranks(_worker, 4, timeout_s=400)
    for rank, got in enumerate(ranks):
        for case in ("async_greedy", "serial_greedy", "async_seeded", "serial_seeded", "idle"):
            assert got[case] == expected[case], f"rank {rank}, {case}"
    assert ranks[0]["staggered"] == expected["staggered"]  # rank 0 reports every replica's outputs
    assert all(r["staggered"] == {} for r in ranks[1:])
    assert [r["outputs_seen"] for r in ranks] == [2, 0, 0, 0]
    assert [r["exchange_path"] for r in ranks] == ["shared_memory"] * 4
    for a, b in ((0, 1), (2, 3)):  # TP peers: replicas of one engine
        for key in ("served", "steps", "dummy", "idle_dummies", "overlapped"):
            assert ranks[a][key] == ranks[b][key], (a, b, key)
    assert ranks[0]["served"] + ranks[2]["served"] == expected["served"] and ranks[2]["served"] > 0
    assert ranks[2]["idle_dummies"] >= 11 and ranks[0]["idle_dummies"] == 0  # replica 1 idled
