"""Tensor parallelism on CPU (gloo + ZMQ): 2 spawned ranks must produce exactly the tokens of
the single-process model, identical on both ranks, for greedy and seeded top-p sampling
with launch-ahead scheduling, and for requests rank 0 adds between steps."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.testing.hf_models import make_tiny_checkpoint
from megatron_async.testing.multiprocess import run_ranks
from megatron_async.tools.main_job import main

ROOT = Path(__file__).resolve().parents[2]
CONFIG = dict(block_size_tokens=4, num_kv_blocks=128, max_requests=4, max_tokens=16, max_sequence_length=128,
              async_scheduling=True)
PROMPTS = [[3, 17, 42, 9, 100, 7], [250, 1, 2], [5] * 11, [60, 61, 62, 63, 64, 65, 66, 67, 68], [8, 9]]
GREEDY = [SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True) for n in (6, 9, 4, 7, 5)]
# seed None: rank 0 draws it from the engine's generator and sends it with the request
SAMPLED = [SamplingParams(temperature=0.9, top_p=0.8, num_tokens_to_generate=8, ignore_eos=True,
                          seed=None if i % 2 else 1000 + i) for i in range(len(PROMPTS))]
ARRIVALS = [(0, PROMPTS[0], GREEDY[0]), (2, PROMPTS[1], SAMPLED[1]), (2, PROMPTS[2], SAMPLED[2]),
            (5, PROMPTS[3], GREEDY[3]), (9, PROMPTS[4], SAMPLED[4])]


def staggered(llm: LLM, rank: int) -> dict[int, list[int]]:
    """Every rank runs this same loop (same collective calls); only rank 0 adds requests."""
    eng, pending, steps, outs = llm.engine, list(ARRIVALS), 0, {}
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][0] <= steps:
            _, prompt, params = pending.pop(0)
            if rank == 0:
                eng.add_request(prompt, params)
        for out in eng.step().finished:
            outs[out.request_id] = out.generated_tokens
        steps += 1
        assert steps < 500, "engine made no progress"
    return outs


def run_all(llm: LLM, rank: int) -> dict:
    greedy = llm.generate(PROMPTS, GREEDY)
    sampled = llm.generate(PROMPTS, SAMPLED)
    return {"greedy": [o.generated_tokens for o in greedy], "sampled": [o.generated_tokens for o in sampled],
            "staggered": staggered(llm, rank)}


def _tp_worker(rank: int, world: int, ckpt: str) -> dict:
    llm = LLM(ckpt, inference_config=InferenceConfig(**CONFIG), tensor_parallel_size=world)
    try:
        result = run_all(llm, rank)
        result["kv_heads"] = llm.model.kv_cache_spec().num_kv_heads
        result["kv_cache_shape"] = tuple(llm.context.kv_caches[0].shape)
        if rank != 0:  # followers only receive requests
            with pytest.raises(RuntimeError, match="cannot add requests"):
                llm.engine.add_request([1, 2, 3])
        return result
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_tp2_matches_single_process(arch, tmp_path):
    # Qwen3: 4 heads / 2 KV heads, q/k norm, head_dim 32 != hidden / heads. Llama: untied head, biases off.
    ckpt = make_tiny_checkpoint(arch, tmp_path / "ckpt", num_attention_heads=4, num_key_value_heads=2)
    reference = LLM(str(ckpt), inference_config=InferenceConfig(**CONFIG))
    expected = run_all(reference, 0)
    full_kv = tuple(reference.context.kv_caches[0].shape)
    ranks = run_ranks(_tp_worker, 2, str(ckpt), timeout_s=60)
    for rank, got in enumerate(ranks):
        assert got["kv_heads"] == 1
        assert got["kv_cache_shape"] == full_kv[:3] + (1,) + full_kv[4:]  # half the heads, same blocks
        for case in ("greedy", "sampled", "staggered"):
            assert got[case] == expected[case], f"rank {rank}, {case}"
    assert len(expected["staggered"]) == len(ARRIVALS)


JOB_ARGS = ["--num-requests", "6", "--prompt-len-min", "4", "--prompt-len-max", "12", "--output-len-min", "3",
            "--output-len-max", "8", "--arrival-rate", "1.5", "--temperature", "0.9", "--top-p", "0.8",
            "--block-size", "4", "--num-kv-blocks", "64", "--max-requests", "3", "--max-tokens", "16", "--quiet",
            "--device", "cpu"]


def _job_worker(rank: int, world: int, ckpt: str, out_dir: str) -> bool:
    main([*JOB_ARGS, "--model", ckpt, "--tensor-parallel-size", str(world), "--output-path", f"{out_dir}/r{rank}.json"])
    return True


def test_main_job_tp2_with_arrivals_matches_tp1(tmp_path):
    ckpt = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "ckpt")
    main([*JOB_ARGS, "--model", str(ckpt), "--output-path", str(tmp_path / "tp1.json")])
    run_ranks(_job_worker, 2, str(ckpt), str(tmp_path), timeout_s=60)
    assert not (tmp_path / "r1.json").exists()  # only rank 0 writes

    def tokens(name: str) -> list[list[int]]:
        return [r["generated_tokens"] for r in json.loads((tmp_path / name).read_text())["requests"]]

    assert tokens("r0.json") == tokens("tp1.json")
    assert all(tokens("tp1.json"))


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
                    with pytest.raises(RuntimeError, match="cannot add requests or abort them"):
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
