"""Data-parallel engines (``expert_parallel_size``) on CPU, gloo + ZMQ, 2 and 4 spawned ranks.

Every rank runs its own engine over the requests rank 0 routes to it; tokens must equal the
single engine's for every request whichever rank served it (greedy and seeded sampling,
staggered arrivals, launch-ahead and serial); a rank with no requests runs dummy forwards and
does not hang; a killed rank makes the others fail clearly. The built-in tiny Qwen3-MoE (8
experts split 2 / 4 ways, tokens exchanged every MoE layer, so a rank without work MUST run
dummy forwards or the others hang); the dense built-in for data-parallel engines alone."""
from __future__ import annotations

import json
import os

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.cli.main_job import main
from tests.helpers.engine_harness import run_leader_arrivals
from tests.helpers.multiprocess import run_ranks

CONFIG = dict(block_size_tokens=4, num_kv_blocks=128, max_requests=4, max_tokens=16, max_sequence_length=128)
PROMPTS = [[3, 17, 42, 9, 100, 7], [250, 1, 2], [5] * 11, [60, 61, 62, 63, 64, 65, 66, 67, 68], [8, 9],
           [11, 12, 13], [40] * 7, [7, 8, 9, 10]]
GREEDY = [SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True) for n in (6, 9, 4, 7, 5, 8, 3, 6)]
# seed None: rank 0 draws it (in arrival order, as the single engine does) and sends it along
SAMPLED = [SamplingParams(temperature=0.9, top_p=0.8, num_tokens_to_generate=7, ignore_eos=True,
                          seed=None if i % 2 else 1000 + i) for i in range(len(PROMPTS))]
ARRIVALS = [0, 0, 1, 3, 3, 6, 10, 11]
MIXED = [GREEDY[i] if i % 2 else SAMPLED[i] for i in range(len(PROMPTS))]


def staggered(llm: LLM, rank: int) -> dict[int, list[int]]:
    return run_leader_arrivals(llm, rank, list(zip(ARRIVALS, PROMPTS, MIXED)))


def run_all(llm: LLM, rank: int) -> dict:
    stats = llm.engine.stats
    result = {}
    for mode in ("async", "serial"):
        llm.engine.async_scheduling = mode == "async"
        result[f"{mode}_greedy"] = [o.generated_tokens for o in llm.generate(PROMPTS, GREEDY)]
        seeded = llm.generate(PROMPTS, SAMPLED)
        result[f"{mode}_seeded"] = [o.generated_tokens for i, o in enumerate(seeded) if SAMPLED[i].seed is not None]
    llm.engine.async_scheduling = True
    result["staggered"] = staggered(llm, rank)
    result["served"] = stats.finished_requests
    result["overlapped"] = stats.overlapped_steps
    return result


def _count_handed_up(llm: LLM) -> dict[str, int]:
    """Updates this rank hands up to rank 0, inside ``generate`` (rank 0 reads none of them
    there) and elsewhere (``step()`` callers read them)."""
    eng, handed, where = llm.engine, {"generate": 0, "step": 0}, ["step"]
    upload, generate = eng.ranks._upload, llm.generate

    def counted():
        up = upload()
        if up is not None:
            handed[where[0]] += len(up.updates)
        return up

    def generating(*args, **kwargs):
        where[0] = "generate"
        try:
            return generate(*args, **kwargs)
        finally:
            where[0] = "step"

    eng.ranks._upload, llm.generate = counted, generating
    return handed


def _dp_worker(rank: int, world: int, model: str) -> dict:
    llm = LLM(None, inference_config=InferenceConfig(**CONFIG), default_model=model, expert_parallel_size=world)
    try:
        assert llm.parallel.dp_size == world and llm.parallel.ep_rank == rank
        handed = _count_handed_up(llm)
        result = run_all(llm, rank)
        st = llm.engine.stats
        result["rounds"], result["steps"] = st.consensus_rounds, st.steps
        result["plain"], result["in_flight"], result["handed"] = (st.consensus_plain_rounds,
                                                                  st.consensus_overlapped_rounds, handed)
        result["exchange_path"] = llm.communicator.exchange_path
        if rank != 0:
            with pytest.raises(RuntimeError, match="data-parallel rank .* cannot add requests"):
                llm.engine.add_request([1, 2, 3])
        return result
    finally:
        llm.close()


@pytest.mark.parametrize("model,world", [("tiny-moe", 2), ("tiny-moe", 4), ("tiny", 2)])
def test_dp_engines_match_one_engine_whichever_rank_serves(model, world):
    expected = run_all(LLM(None, inference_config=InferenceConfig(**CONFIG), default_model=model), 0)
    assert expected["async_greedy"] == expected["serial_greedy"]
    assert expected["async_seeded"] == expected["serial_seeded"]
    ranks = run_ranks(_dp_worker, world, model, timeout_s=240)
    for rank, got in enumerate(ranks):
        for case in ("async_greedy", "serial_greedy", "async_seeded", "serial_seeded"):
            assert got[case] == expected[case], f"rank {rank}, {case}"
        assert got["served"] > 0 and got["overlapped"] > 0, f"rank {rank} served nothing or never overlapped"
        assert got["rounds"] >= 1
        assert got["exchange_path"] == "shared_memory"  # ranks on one host: the default path
        # rounds that moved only the int record, and ones with a launch in flight (launch-ahead)
        assert 0 < got["plain"] < got["rounds"] and got["in_flight"] > 0, (rank, got["plain"], got["rounds"])
        if rank:  # nobody reads per-step updates inside generate(): none built; step() callers get them
            assert got["handed"]["generate"] == 0 and got["handed"]["step"] > 0, (rank, got["handed"])
    assert ranks[0]["staggered"] == expected["staggered"]  # rank 0 reports every rank's outputs
    assert sum(r["served"] for r in ranks) == expected["served"]  # each request ran on exactly one rank
    for got in ranks[1:]:
        assert got["staggered"] == {}  # the others hand theirs up


def _idle_worker(rank: int, world: int) -> dict:
    llm = LLM(None, inference_config=InferenceConfig(**CONFIG), default_model="tiny-moe", expert_parallel_size=world)
    try:
        outs = llm.generate([PROMPTS[0]], SamplingParams(top_k=1, num_tokens_to_generate=40, ignore_eos=True))
        st = llm.engine.stats
        return {"tokens": outs[0].generated_tokens, "dummy": st.dummy_steps, "steps": st.steps,
                "served": st.finished_requests, "rounds": st.consensus_rounds}
    finally:
        llm.close()


def test_a_rank_without_requests_runs_dummy_steps_and_does_not_hang():
    expected = LLM(None, inference_config=InferenceConfig(**CONFIG), default_model="tiny-moe").generate(
        [PROMPTS[0]], SamplingParams(top_k=1, num_tokens_to_generate=40, ignore_eos=True))[0].generated_tokens
    r0, r1 = run_ranks(_idle_worker, 2, timeout_s=120)
    assert r0["tokens"] == r1["tokens"] == expected
    assert r0["served"] == 1 and r1["served"] == 0  # least loaded: the one request went to rank 0
    assert r1["dummy"] >= 39 and r0["dummy"] == 0  # rank 1 matched every launch of rank 0
    assert r1["steps"] == 0 and r0["steps"] >= 40
    assert r0["rounds"] == r1["rounds"] <= r0["steps"] + 4  # one exchange per step (+ idle checks)


def _dying_worker(rank: int, world: int) -> None:
    llm = LLM(None, inference_config=InferenceConfig(**CONFIG), default_model="tiny-moe", expert_parallel_size=world)
    llm.generate(PROMPTS[:4], GREEDY[:4])
    if rank == world - 1:
        os._exit(9)
    llm.generate(PROMPTS[:4], GREEDY[:4])  # must fail long before the 300 s ZMQ timeout


def test_a_killed_rank_makes_the_others_fail_clearly():
    with pytest.raises(RuntimeError) as failed:
        run_ranks(_dying_worker, 2, timeout_s=60)
    report = str(failed.value)
    assert "rank 1 failed:\nexited with code 9" in report
    assert "CommunicatorError: rank 0: lost the connection to a peer" in report


JOB_ARGS = ["--num-requests", "8", "--prompt-len-min", "4", "--prompt-len-max", "12", "--output-len-min", "3",
            "--output-len-max", "8", "--arrival-rate", "1.5", "--temperature", "0.9", "--top-p", "0.8",
            "--block-size", "4", "--num-kv-blocks", "64", "--max-requests", "3", "--max-tokens", "16", "--quiet",
            "--device", "cpu"]


def _job_worker(rank: int, world: int, out_dir: str) -> bool:
    summary = main([*JOB_ARGS, "--default-model", "tiny-moe", "--expert-parallel-size", str(world),
                    "--output-path", f"{out_dir}/r{rank}.json"])
    return summary is not None


def test_main_job_ep2_with_arrivals_matches_ep1(tmp_path):
    main([*JOB_ARGS, "--default-model", "tiny-moe", "--output-path", str(tmp_path / "ep1.json")])
    run_ranks(_job_worker, 2, str(tmp_path), timeout_s=90)
    assert not (tmp_path / "r1.json").exists()  # only rank 0 writes

    def tokens(name: str) -> list[list[int]]:
        return [r["generated_tokens"] for r in json.loads((tmp_path / name).read_text())["requests"]]

    assert tokens("r0.json") == tokens("ep1.json") and all(tokens("ep1.json"))


def _abort_worker(rank: int, world: int) -> dict:
    """Rank 0 aborts a request another rank serves; its output still comes back through rank 0."""
    llm = LLM(None, inference_config=InferenceConfig(**CONFIG), default_model="tiny-moe", expert_parallel_size=world)
    try:
        eng, outs, steps = llm.engine, {}, 0
        if rank == 0:
            for prompt in PROMPTS[:4]:
                eng.add_request(prompt, SamplingParams(top_k=1, num_tokens_to_generate=30, ignore_eos=True))
        while eng.has_unfinished_requests():
            if steps == 6 and rank == 0:
                assert eng.abort_request(1) and not eng.abort_request(1)
            for o in eng.step().finished:
                outs[o.request_id] = (o.finish_reason, len(o.generated_tokens))
            steps += 1
            assert steps < 300
        return {"outs": outs, "aborted": eng.stats.aborted_requests}
    finally:
        llm.close()


def test_abort_reaches_the_rank_that_serves_the_request():
    r0, r1 = run_ranks(_abort_worker, 2, timeout_s=120)
    assert r0["outs"][1][0] == "abort" and 0 < r0["outs"][1][1] < 30
    assert all(r0["outs"][i] == ("length", 30) for i in (0, 2, 3))
    assert r1["outs"] == {} and r0["aborted"] + r1["aborted"] == 1 and r1["aborted"] == 1  # rank 1 served it
