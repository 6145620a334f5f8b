"""pause_generation / resume_generation and update_weights under TP=2 and EP=2 (CPU, gloo + ZMQ,
spawned ranks). Rank 0 pauses and resumes; every rank applies it at the same step, lands what is
in flight, then runs nothing. pause("keep") / resume gives the tokens of an uninterrupted run;
update_weights on every rank (full tensors, each keeps its shard) makes the engine equal to a
fresh one loaded from the new checkpoint; tokens record their weight version; "abort" ends every
request on every rank; "wait" lets the running ones finish and admits none. After an update the tokens are those the new weights continue the
sequence with (the KV is recomputed)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.models.default_checkpoint import save_default_checkpoint
from tests.helpers.multiprocess import run_ranks

CONFIG = dict(block_size_tokens=4, num_kv_blocks=128, max_requests=4, max_tokens=16, max_sequence_length=128)
PROMPTS = [[3, 17, 42, 9, 100, 7], [250, 1, 2], [5] * 11, [60, 61, 62, 63, 64, 65, 66, 67, 68]]
PARAMS = [SamplingParams(top_k=1, num_tokens_to_generate=10, ignore_eos=True) if i % 2 else
          SamplingParams(temperature=0.9, top_p=0.8, seed=100 + i, num_tokens_to_generate=12, ignore_eos=True)
          for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel_pause")
    return {name: tuple(str(save_default_checkpoint(name, root / f"{name}-{seed}", torch.device("cpu"), torch.float32,
                                                    seed=seed)) for seed in (0, 1))
            for name in ("tiny", "tiny-moe")}


def _tokens(outs) -> list[list[int]]:
    return [o.generated_tokens for o in outs]


def drive_with_pause(llm: LLM, rank: int, new: str | None, pause_at: int = 4) -> dict:
    """Every rank runs this (the same collective calls); rank 0 adds, pauses and resumes. With
    ``new``: every rank updates the weights while paused."""
    eng, outs = llm.engine, {}

    def step():
        res = eng.step()
        outs.update((o.request_id, o) for o in res.finished)
        return res

    if rank == 0:
        for prompt, params in zip(PROMPTS, PARAMS):
            eng.add_request(prompt, params)
    for _ in range(pause_at):
        step()
    if rank == 0:
        eng.pause_generation("keep")
    while not eng.is_paused:
        step()
    step()  # lands what is in flight
    assert eng._pending is None and eng._requests  # some requests span the pause
    paused, steps = eng.stats.paused_steps, eng.stats.steps
    for _ in range(2):
        assert not step().finished
    assert eng.stats.paused_steps == paused + 2 and eng.stats.steps == steps  # nothing ran
    version = llm.update_weights(new) if new else 0
    if rank == 0:
        eng.resume_generation()
    while eng.has_unfinished_requests():
        step()
    assert not eng.is_paused
    return {"outs": [(outs[rid].generated_tokens, outs[rid].weight_versions) for rid in sorted(outs)], "version": version}


def abort_everything(llm: LLM, rank: int) -> list[str]:
    eng, reasons = llm.engine, []
    if rank == 0:
        for prompt, params in zip(PROMPTS, PARAMS):
            eng.add_request(prompt, params)
    for _ in range(3):
        reasons += [o.finish_reason for o in eng.step().finished]
    if rank == 0:
        eng.pause_generation("abort")
    while eng.has_unfinished_requests():
        reasons += [o.finish_reason for o in eng.step().finished]
    assert eng.is_paused
    if rank == 0:
        eng.resume_generation()
    for _ in range(2):  # the next exchange brings it (an idle check's exchange may have been the last)
        if eng.is_paused:
            eng.step()
    assert not eng.is_paused
    return reasons


def wait_for_running(llm: LLM, rank: int) -> dict:
    """pause("wait"): the running requests finish, one added after the pause waits until resumed."""
    eng, outs = llm.engine, {}

    def steps(n: int) -> None:  # the same count on every rank (only rank 0 of data-parallel ranks reports)
        for _ in range(n):
            outs.update((o.request_id, o.finish_reason) for o in eng.step().finished)

    if rank == 0:
        for prompt, params in zip(PROMPTS[:3], PARAMS[:3]):
            eng.add_request(prompt, params)
    steps(4)
    if rank == 0:
        eng.pause_generation("wait")
        eng.add_request(PROMPTS[3], PARAMS[3])
    steps(20)
    finished_while_paused, ran = dict(outs), eng.stats.steps
    steps(2)
    idle = eng.stats.steps == ran
    if rank == 0:
        eng.resume_generation()
    while eng.has_unfinished_requests():
        steps(1)
    return {"while_paused": sorted(finished_while_paused.values()), "idle": idle, "all": sorted(outs.values())}


def _worker(rank: int, world: int, old: str, new: str, tp: int, ep: int) -> dict:
    llm = LLM(old, inference_config=InferenceConfig(**CONFIG), tensor_parallel_size=tp, expert_parallel_size=ep)
    try:
        if rank != 0:
            with pytest.raises(RuntimeError, match="only rank 0"):
                llm.engine.pause_generation("keep")
        result = {"uninterrupted": _tokens(llm.generate(PROMPTS, PARAMS)),
                  "kept": drive_with_pause(llm, rank, None),
                  "updated": drive_with_pause(llm, rank, new),
                  "after_update": _tokens(llm.generate(PROMPTS, PARAMS)),
                  "aborted": abort_everything(llm, rank),
                  "waited": wait_for_running(llm, rank)}
        result["recomputed"] = llm.engine.stats.recomputed_after_update
        return result
    finally:
        llm.close()


def _single(path: str) -> LLM:
    return LLM(path, inference_config=InferenceConfig(**CONFIG))


def _check_common(got: dict, ref_old: list, ref_new: list, new: str, rank: int, reports: bool) -> None:
    assert got["uninterrupted"] == ref_old
    if reports:  # the rank that reports outputs (every TP rank; rank 0 of data-parallel ranks)
        assert [t for t, _ in got["kept"]["outs"]] == ref_old, f"rank {rank}: pause / resume changed tokens"
        _check_continuations(got["updated"]["outs"], ref_old, new)
        assert got["aborted"] == ["abort"] * len(PROMPTS)
        assert got["waited"]["while_paused"] == ["length"] * 3 and got["waited"]["all"] == ["length"] * 4
    assert got["waited"]["idle"], f"rank {rank} ran steps while paused with only a new request queued"
    assert got["updated"]["version"] == 1
    assert got["after_update"] == ref_new, f"rank {rank}: the updated engine differs from a fresh load"


def _check_continuations(outs: list, ref_old: list, new: str) -> None:
    """Tokens before the update are the old weights'; after it (KV recomputed), those a fresh engine
    on the new checkpoint continues the same sequence with (draws are keyed by position)."""
    versions = [v for _, v in outs]
    assert all(v == sorted(v) and set(v) <= {0, 1} for v in versions)
    assert any(len(set(v)) == 2 for v in versions), "no request spanned the update"
    prefixes = [v.count(0) for v in versions]
    continued = _single(new).generate(
        [p + t[:n] for p, (t, _), n in zip(PROMPTS, outs, prefixes)],
        [dataclasses.replace(sp, num_tokens_to_generate=sp.num_tokens_to_generate - n) for sp, n in zip(PARAMS, prefixes)])
    for (tokens, _), old, n, cont in zip(outs, ref_old, prefixes, continued):
        assert tokens[:n] == old[:n] and tokens[n:] == cont.generated_tokens


def test_tp2_pause_and_update_weights(checkpoints):
    old, new = checkpoints["tiny"]
    ref_old, ref_new = _tokens(_single(old).generate(PROMPTS, PARAMS)), _tokens(_single(new).generate(PROMPTS, PARAMS))
    assert ref_old != ref_new
    ranks = run_ranks(_worker, 2, old, new, 2, 1, timeout_s=240)
    for rank, got in enumerate(ranks):
        _check_common(got, ref_old, ref_new, new, rank, reports=True)
        assert got["recomputed"] > 0
    assert ranks[0] == ranks[1]  # replicas


def test_ep2_pause_and_update_weights(checkpoints):
    old, new = checkpoints["tiny-moe"]
    ref_old, ref_new = _tokens(_single(old).generate(PROMPTS, PARAMS)), _tokens(_single(new).generate(PROMPTS, PARAMS))
    ranks = run_ranks(_worker, 2, old, new, 1, 2, timeout_s=240)
    for rank, got in enumerate(ranks):
        _check_common(got, ref_old, ref_new, new, rank, reports=rank == 0)
    assert ranks[1]["kept"]["outs"] == []  # rank 0 reports every rank's outputs
    assert all(r["recomputed"] > 0 for r in ranks)  # both ranks served requests across the update
