"""Tensor parallelism on CPU (gloo + ZMQ): 2 or 3 spawned ranks must produce exactly the tokens
of the single-process model, identical on every rank, for GPT and hybrid checkpoints and the
built-in model; greedy and seeded top-p sampling, launch-ahead and serial scheduling, and
requests rank 0 adds between steps. Shapes that do not divide fail at load on every rank."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.cli.main_job import main
from tests.helpers.engine_harness import run_leader_arrivals
from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint
from tests.helpers.hf_models import make_tiny_checkpoint
from tests.helpers.multiprocess import run_ranks

ROOT = Path(__file__).resolve().parents[2]
CONFIG = dict(block_size_tokens=4, num_kv_blocks=128, max_requests=4, max_tokens=16, max_sequence_length=128,
              async_scheduling=True)
PROMPTS = [[3, 17, 42, 9, 100, 7], [250, 1, 2], [5] * 11, [60, 61, 62, 63, 64, 65, 66, 67, 68], [8, 9]]
GREEDY = [SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True) for n in (6, 9, 4, 7, 5)]
# seed None: rank 0 draws it from the engine's generator and sends it with the request
SAMPLED = [SamplingParams(temperature=0.9, top_p=0.8, num_tokens_to_generate=8, ignore_eos=True,
                          seed=None if i % 2 else 1000 + i) for i in range(len(PROMPTS))]
ARRIVAL_STEPS = [0, 2, 2, 5, 9]
ARRIVAL_PARAMS = [GREEDY[0], SAMPLED[1], SAMPLED[2], GREEDY[3], SAMPLED[4]]


def prompts_for(vocab: int) -> list[list[int]]:
    return [[t % vocab for t in p] for p in PROMPTS]


def staggered(llm: LLM, rank: int) -> dict[int, list[int]]:
    return run_leader_arrivals(llm, rank, list(zip(ARRIVAL_STEPS, prompts_for(llm.model.vocab_size), ARRIVAL_PARAMS)))


def run_all(llm: LLM, rank: int) -> dict:
    """Launch-ahead runs (greedy, sampled, staggered arrivals), then the same batches serially."""
    prompts, stats = prompts_for(llm.model.vocab_size), llm.engine.stats
    result = {"greedy": [o.generated_tokens for o in llm.generate(prompts, GREEDY)],
              "sampled": [o.generated_tokens for o in llm.generate(prompts, SAMPLED)],
              "staggered": staggered(llm, rank)}
    overlapped = stats.overlapped_steps
    llm.engine.async_scheduling = False  # read at every step: the same engine now runs serially
    result["serial_greedy"] = [o.generated_tokens for o in llm.generate(prompts, GREEDY)]
    result["serial_sampled"] = [o.generated_tokens for o in llm.generate(prompts, SAMPLED)]
    result["overlapped"] = (overlapped, stats.overlapped_steps - overlapped)
    llm.engine.async_scheduling = True
    return result


def _tp_worker(rank: int, world: int, ckpt: str | None) -> dict:
    llm = LLM(ckpt, inference_config=InferenceConfig(**CONFIG), tensor_parallel_size=world)
    try:
        result = run_all(llm, rank)
        result["kv_cache_shape"] = tuple(llm.context.kv_caches[0].shape) if llm.context.kv_caches else None
        mamba = llm.context.mamba
        result["ssm_shape"] = tuple(mamba.ssm_states[0].shape) if mamba is not None else None
        result["exchange_path"] = llm.communicator.exchange_path
        if rank != 0:  # followers only receive requests
            with pytest.raises(RuntimeError, match="cannot add requests"):
                llm.engine.add_request([1, 2, 3])
        return result
    finally:
        llm.close()


def _check_tp(ckpt: str | None, world: int, sharded_heads: tuple[int, ...]) -> None:
    """``sharded_heads``: dims of the KV cache / SSM state that hold heads (divided by ``world``)."""
    reference = LLM(ckpt, inference_config=InferenceConfig(**CONFIG))
    expected = run_all(reference, 0)
    full = {"kv_cache_shape": tuple(reference.context.kv_caches[0].shape) if reference.context.kv_caches else None,
            "ssm_shape": (tuple(reference.context.mamba.ssm_states[0].shape)
                          if reference.context.mamba is not None else None)}
    assert expected["serial_greedy"] == expected["greedy"]
    seeded = [i for i, sp in enumerate(SAMPLED) if sp.seed is not None]  # the others draw new seeds per run
    assert [expected["serial_sampled"][i] for i in seeded] == [expected["sampled"][i] for i in seeded]
    assert expected["overlapped"][0] > 0 and expected["overlapped"][1] == 0  # both modes really ran
    assert len(expected["staggered"]) == len(ARRIVAL_STEPS)
    ranks = run_ranks(_tp_worker, world, ckpt, timeout_s=120)
    for rank, got in enumerate(ranks):
        for key, dim in zip(("kv_cache_shape", "ssm_shape"), sharded_heads):
            if full[key] is not None:  # this rank's heads, same blocks / slots
                want = list(full[key])
                want[dim] //= world
                assert got[key] == tuple(want), f"rank {rank}, {key}"
        for case in ("greedy", "sampled", "staggered", "serial_greedy", "serial_sampled", "overlapped"):
            assert got[case] == expected[case], f"rank {rank}, {case}"
        assert got["exchange_path"] == "shared_memory"  # ranks on one host: the default path


GPT_CASES = {
    # Qwen3: q/k norm, head_dim 32 != hidden / heads. Llama: untied head.
    "qwen3-tp2": ("Qwen3ForCausalLM", 2, dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-tp2": ("LlamaForCausalLM", 2, dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3-tp3": ("Qwen3ForCausalLM", 3, dict(num_attention_heads=6, num_key_value_heads=3, vocab_size=258,
                                              intermediate_size=96)),
}


@pytest.mark.parametrize("case", list(GPT_CASES))
def test_gpt_tp_matches_single_process(case, tmp_path):
    arch, world, overrides = GPT_CASES[case]
    ckpt = make_tiny_checkpoint(arch, tmp_path / "ckpt", **overrides)
    _check_tp(str(ckpt), world, sharded_heads=(3, 1))  # kv cache [2, blocks, block, heads, dim]


HYBRID_CASES = {
    # NemotronH "M*M-": 4 Mamba heads in 2 groups, 4 attention heads / 2 KV heads, relu^2 MLP
    "nemotron_h-tp2": ("NemotronHForCausalLM", 2, {}),
    "nemotron_h-tp3": ("NemotronHForCausalLM", 3, dict(mamba_num_heads=6, n_groups=3, num_attention_heads=6,
                                                       num_key_value_heads=3, vocab_size=129, intermediate_size=66)),
    "bamba-tp2": ("BambaForCausalLM", 2, {}),  # partial rotary attention, SwiGLU after every mixer
}


@pytest.mark.parametrize("case", list(HYBRID_CASES))
def test_hybrid_tp_matches_single_process(case, tmp_path):
    arch, world, overrides = HYBRID_CASES[case]
    ckpt = make_tiny_hybrid_checkpoint(arch, tmp_path / "ckpt", **overrides)
    _check_tp(str(ckpt), world, sharded_heads=(3, 1))  # ssm state [slots, heads, head_dim, d_state]


def test_built_in_model_is_the_same_under_tp2():
    """The built-in model draws full tensors and keeps each rank's shard: TP=2 is the TP=1 model."""
    _check_tp(None, 2, sharded_heads=(3, 1))


def _bad_worker(rank: int, world: int, ckpt: str) -> None:
    LLM(ckpt, inference_config=InferenceConfig(**CONFIG), tensor_parallel_size=world)


def test_shapes_that_do_not_divide_fail_at_load_on_every_rank(tmp_path):
    ckpt = make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tmp_path / "ckpt", n_groups=1)
    with pytest.raises(RuntimeError) as failed:
        run_ranks(_bad_worker, 2, str(ckpt), timeout_s=60)  # no hang: every rank raises while building
    report = str(failed.value)
    assert "rank 0 failed" in report and "rank 1 failed" in report
    assert report.count("Mamba n_groups (1) must be divisible by tensor_parallel_size (2)") >= 2


def _dying_worker(rank: int, world: int) -> None:
    llm = LLM(None, inference_config=InferenceConfig(**CONFIG), tensor_parallel_size=world)
    llm.generate(PROMPTS[:2], GREEDY[:2])
    if rank == 1:
        os._exit(9)  # dies between steps, without a word
    llm.generate(PROMPTS[:2], GREEDY[:2])  # the ZMQ timeout is 300 s: this must fail long before


def test_a_dead_rank_makes_the_others_fail_clearly():
    with pytest.raises(RuntimeError) as failed:
        run_ranks(_dying_worker, 2, timeout_s=60)
    report = str(failed.value)
    assert "rank 1 failed:\nexited with code 9" in report
    assert "CommunicatorError: rank 0: lost the connection to a peer" in report


def _counting_worker(rank: int, world: int, shared_memory: bool) -> dict:
    # cuda_graphs is accepted under TP (ignored on CPU; pytest -m multigpu replays graphs on NCCL)
    cfg = InferenceConfig(**{**CONFIG, "cuda_graphs": True, "consensus_shared_memory": shared_memory})
    llm = LLM(None, inference_config=cfg, tensor_parallel_size=world)
    try:
        eng, calls = llm.engine, {"step": 0}
        step = eng.step

        def counted_step():
            calls["step"] += 1
            return step()

        eng.step = counted_step
        outs = staggered(llm, rank)
        st = eng.stats
        return {"outs": outs, "steps": calls["step"], "rounds": st.consensus_rounds, "seconds": st.consensus_time,
                "samples": len(st.consensus_round_seconds), "p50_us": st.consensus_us(50), "p99_us": st.consensus_us(99),
                "pairs": list(zip(st.consensus_round_seconds, st.consensus_latency_seconds)),
                "as_dict": {k: v for k, v in st.as_dict().items() if k.startswith("consensus")},
                "path": llm.communicator.exchange_path}
    finally:
        llm.close()


def _diverging_worker(rank: int, world: int) -> str:
    """Rank 1's device result differs once (its 4th sample is bumped): the replicas' digests then
    differ at the next exchange, and every rank fails naming it, rather than running on."""
    llm = LLM(None, inference_config=InferenceConfig(**CONFIG), tensor_parallel_size=world)
    if rank == 1:
        sample, calls = llm.runner.sampler.sample_with_log_probs, []

        def bumped(*a, **kw):
            tokens, *log_probs = sample(*a, **kw)
            calls.append(1)
            return tokens + 1 if len(calls) == 4 else tokens, *log_probs

        llm.runner.sampler.sample_with_log_probs = bumped
    try:
        llm.generate(PROMPTS[:2], GREEDY[:2])
    except Exception as e:  # noqa: BLE001 -- the message is what the test checks
        return f"{type(e).__name__}: {e}"
    finally:
        llm.close()
    return "no error"


def test_replicas_that_diverge_fail_at_the_next_exchange():
    results = run_ranks(_diverging_worker, 2, timeout_s=120)
    for r in results:
        assert r.startswith("CommunicatorError: replica ranks diverged"), results


@pytest.mark.parametrize("shared_memory", [True, False])
def test_one_consensus_exchange_per_step(shared_memory):
    """New requests, aborts and "anyone has work" travel in ONE exchange per step (before: a
    broadcast per step plus an all-reduce per has_unfinished_requests call), through shared
    memory or ZMQ, with the same tokens."""
    r0, r1 = run_ranks(_counting_worker, 2, shared_memory, timeout_s=60)
    assert r0["outs"] == r1["outs"] and len(r0["outs"]) == len(ARRIVAL_STEPS)
    assert r0["path"] == r1["path"] == ("shared_memory" if shared_memory else "zmq")
    for got in (r0, r1):
        assert got["rounds"] <= got["steps"] + 2, got  # + the idle checks at the start and the end
        assert got["seconds"] > 0
        assert got["samples"] == got["rounds"] and 0 < got["p50_us"] <= got["p99_us"], got  # one duration per round
        assert got["as_dict"]["consensus_p99_us"] == got["p99_us"] and "consensus_round_seconds" not in got["as_dict"]
        # an exchange's own cost (after the last rank arrived) is part of its duration on every rank
        assert len(got["pairs"]) == got["rounds"] and all(0 <= lat <= dur + 1e-4 for dur, lat in got["pairs"]), got
        assert 0 < got["as_dict"]["consensus_latency_p50_us"] <= got["as_dict"]["consensus_latency_p99_us"]


JOB_ARGS = ["--num-requests", "6", "--prompt-len-min", "4", "--prompt-len-max", "12", "--output-len-min", "3",
            "--output-len-max", "8", "--arrival-rate", "1.5", "--temperature", "0.9", "--top-p", "0.8",
            "--block-size", "4", "--num-kv-blocks", "64", "--max-requests", "3", "--max-tokens", "16", "--quiet",
            "--device", "cpu"]
LATE_S = 1.5
"""How late rank 1 ends its start-up in the TP=2 main job."""


def _job_worker(rank: int, world: int, ckpt: str, out_dir: str, late_s: float = 0.0) -> bool:
    if rank == 1 and late_s:  # this rank ends its start-up late (after the engine's own collectives)
        from megatron_async.cli import main_job

        build = main_job.build_workload
        main_job.build_workload = lambda *a: time.sleep(late_s) or build(*a)
    main([*JOB_ARGS, "--model", ckpt, "--tensor-parallel-size", str(world), "--output-path", f"{out_dir}/r{rank}.json"])
    return True


def test_main_job_tp2_with_arrivals_matches_tp1(tmp_path):
    ckpt = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "ckpt")
    main([*JOB_ARGS, "--model", str(ckpt), "--output-path", str(tmp_path / "tp1.json")])
    run_ranks(_job_worker, 2, str(ckpt), str(tmp_path), LATE_S, timeout_s=60)
    assert not (tmp_path / "r1.json").exists()  # only rank 0 writes

    def tokens(name: str) -> list[list[int]]:
        return [r["generated_tokens"] for r in json.loads((tmp_path / name).read_text())["requests"]]

    assert tokens("r0.json") == tokens("tp1.json")
    assert all(tokens("tp1.json"))
    # rank 0 waited for rank 1's late start-up before its run's clock started: not inside its first step
    startup = json.loads((tmp_path / "r0.json").read_text())["startup"]
    assert startup["ranks_wait_s"] >= 0.8 * LATE_S
    assert startup["first_token_s"] >= startup["ready_s"] + startup["ranks_wait_s"]
    assert json.loads((tmp_path / "tp1.json").read_text())["startup"]["ranks_wait_s"] == 0.0



@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_launcher_two_ranks():
    proc = subprocess.run(["bash", "examples/run_torchrun.sh", *JOB_ARGS], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "NPROC": "2", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("6/6 finished") == 1  # the summary comes from rank 0 only
    assert proc.stderr.count("TP 2") == 1


def _abort_worker(rank: int, world: int, ckpt: str) -> dict:
    """Rank 0 aborts a decoding request; every rank must end it at the same step."""
    llm = LLM(ckpt, inference_config=InferenceConfig(**CONFIG), tensor_parallel_size=world)
    try:
        eng = llm.engine
        if rank == 0:
            for prompt, params in zip(PROMPTS[:3], GREEDY[:3]):
                eng.add_request(prompt, params)
        outs, steps = {}, 0
        while eng.has_unfinished_requests():
            if steps == 3:
                if rank == 0:
                    assert eng.abort_request(1)
                else:
                    with pytest.raises(RuntimeError, match="cannot add requests, abort them or pause generation"):
                        eng.abort_request(1)
            for o in eng.step().finished:
                outs[o.request_id] = (o.finish_reason, o.generated_tokens, steps)
            steps += 1
        return outs
    finally:
        llm.close()


def test_tp2_abort_reaches_every_rank(tmp_path):
    ckpt = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "ckpt", num_attention_heads=4, num_key_value_heads=2)
    expected = [o.generated_tokens for o in LLM(str(ckpt), inference_config=InferenceConfig(**CONFIG))
                .generate(PROMPTS[:3], GREEDY[:3])]
    r0, r1 = run_ranks(_abort_worker, 2, str(ckpt), timeout_s=60)
    assert r0 == r1 and r0[1][0] == "abort" and r0[1][2] == 3
    assert [r0[0][1], r0[2][1]] == [expected[0], expected[2]]
