"""engine.suspend / resume under TP=2 and EP=2 (CPU, gloo + ZMQ, forked ranks; the emulated
backend frees the tensors' storages, so any device read while suspended fails). Rank 0 pauses
with "keep"; every rank, once paused with nothing in flight, suspends and resumes its own memory;
idle exchanges while suspended are host-only; running requests continue token-identically. The
RL order with dropped weights (resume weights, update_weights from the same checkpoint, resume
kv_cache) gives the same tokens; a wrong order raises SuspendError on that rank, and rank 0
resuming generation while another rank is still suspended raises it on every rank at once."""
from __future__ import annotations

import time

import pytest
import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.engines.suspend import SuspendError
from megatron_async.models.default_checkpoint import save_default_checkpoint
from tests.helpers.multiprocess import run_ranks

CONFIG = dict(block_size_tokens=4, num_kv_blocks=64, max_requests=4, max_tokens=16, max_sequence_length=64,
              enable_suspend=True)
PROMPTS = [[3, 17, 42, 9, 100, 7], [250, 1, 2], [5] * 11, [60, 61, 62, 63, 64, 65, 66, 67, 68]]
PARAMS = [SamplingParams(top_k=1, num_tokens_to_generate=8, ignore_eos=True) if i % 2 else
          SamplingParams(temperature=0.9, top_p=0.8, seed=100 + i, num_tokens_to_generate=8, ignore_eos=True)
          for i in range(len(PROMPTS))]
BOTH = ("weights", "kv_cache")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel_suspend")
    return {name: str(save_default_checkpoint(name, root / name, torch.device("cpu"), torch.float32, seed=0))
            for name in ("tiny", "tiny-moe")}


def _released(eng) -> bool:
    storages = [p.untyped_storage() for p in eng.runner.model.parameters()]
    storages += [t.untyped_storage() for t in eng.context.kv_caches]
    return all(s.nbytes() == 0 for s in storages)


def run_then_pause(eng, rank: int, outs: dict):
    """Every rank runs this: rank 0 adds the requests, every rank steps a few times (suspending is
    refused while generating, and with a launch in flight), rank 0 pauses with "keep", and every
    rank steps until paused with the in-flight launch landed. Returns the step function (it
    collects finished tokens into ``outs``)."""

    def step():
        outs.update((o.request_id, o.generated_tokens) for o in eng.step().finished)

    if rank == 0:
        for prompt, params in zip(PROMPTS, PARAMS):
            eng.add_request(prompt, params)
    for _ in range(3):
        step()
    with pytest.raises(SuspendError, match="while generating"):
        eng.suspend(BOTH)
    if rank == 0:
        eng.pause_generation("keep")
    while not eng.is_paused:
        step()
    if eng._pending is not None:
        with pytest.raises(SuspendError, match="in flight"):
            eng.suspend(BOTH)
    step()  # lands what is in flight
    assert eng._pending is None and eng.context.active  # requests hold KV across the suspend
    return step


def suspend_cycle(llm: LLM, rank: int, path: str, keep: bool) -> list:
    """Every rank runs this; rank 0 adds, pauses and resumes generation. ``keep`` False: the
    weights are dropped and refilled from ``path`` by update_weights."""
    eng, outs = llm.engine, {}
    step = run_then_pause(eng, rank, outs)
    eng.suspend(BOTH, keep_weights_on_host=keep)
    assert _released(eng)
    steps = eng.stats.steps
    for _ in range(2):  # idle exchanges while suspended: host-only (a device read would fail)
        step()
    assert eng.has_unfinished_requests() and eng.stats.steps == steps
    with pytest.raises(SuspendError, match="before"):
        eng.resume(("kv_cache",))
    if keep:
        eng.resume(BOTH)
    else:
        eng.resume(("weights",))
        with pytest.raises(SuspendError, match="dropped"):
            eng.resume(("kv_cache",))
        assert llm.update_weights(path) >= 1
        eng.resume(("kv_cache",))
    if rank == 0:
        eng.resume_generation()
    while eng.has_unfinished_requests():
        step()
    return [outs[rid] for rid in sorted(outs)]


def _worker(rank: int, world: int, path: str, tp: int, ep: int) -> dict:
    llm = LLM(path, inference_config=InferenceConfig(**CONFIG), tensor_parallel_size=tp, expert_parallel_size=ep)
    try:
        ref = [o.generated_tokens for o in llm.generate(PROMPTS, PARAMS)]
        return {"ref": ref, "kept": suspend_cycle(llm, rank, path, keep=True),
                "dropped": suspend_cycle(llm, rank, path, keep=False)}
    finally:
        llm.close()


@pytest.mark.parametrize("tp,ep,model", [(2, 1, "tiny"), (1, 2, "tiny-moe")], ids=["tp2", "ep2"])
def test_suspend_resume_on_every_rank(checkpoints, tp, ep, model):
    ranks = run_ranks(_worker, 2, checkpoints[model], tp, ep, timeout_s=240)
    ref = ranks[0]["ref"]
    assert len(ref) == len(PROMPTS)
    reporting = ranks if tp > 1 else ranks[:1]  # data-parallel ranks: rank 0 reports every rank's outputs
    for rank, got in enumerate(reporting):
        assert got["kept"] == ref, f"rank {rank}: suspend / resume changed tokens"
        assert got["dropped"] == ref, f"rank {rank}: dropped weights refilled by update_weights changed tokens"


def test_resumed_generation_on_suspended_memory_is_refused(checkpoints):
    """Alone, a step told to generate (as an exchange applies rank 0's resume_generation) while
    the memory is suspended raises before any device work, instead of launching on freed memory."""
    eng = LLM(checkpoints["tiny"], inference_config=InferenceConfig(**CONFIG)).engine
    eng.add_request(PROMPTS[0], PARAMS[0])
    eng.step()
    eng.pause_generation("keep")
    eng.step()
    eng.suspend(BOTH)
    eng.ranks.pause(None)  # what an exchange does on a non-leader rank
    with pytest.raises(SuspendError, match="suspended"):
        eng.step()
    eng.resume(BOTH)
    assert eng.run_until_done()[0].generated_tokens


def _resume_while_rank1_suspended(rank: int, world: int, path: str, tp: int, ep: int) -> dict:
    """Every rank suspends; rank 0 resumes its memory and generation while rank 1 stays suspended."""
    llm = LLM(path, inference_config=InferenceConfig(**CONFIG), tensor_parallel_size=tp, expert_parallel_size=ep)
    try:
        ref = [o.generated_tokens for o in llm.generate(PROMPTS, PARAMS)]
        eng, outs = llm.engine, {}
        step = run_then_pause(eng, rank, outs)
        eng.suspend(BOTH)
        if rank == 0:
            eng.resume(BOTH)
            eng.resume_generation()
        steps, errors, calls = eng.stats.steps, [], 0
        while len(errors) < 2 and calls < 4:  # the first raise, then again while rank 1 stays suspended
            calls += 1
            t0 = time.monotonic()
            try:
                step()
            except SuspendError as e:
                errors.append((calls, str(e), time.monotonic() - t0))
        launched = eng.stats.steps - steps
        if rank == 1:
            eng.resume(BOTH)
        while eng.has_unfinished_requests():
            step()
        return {"ref": ref, "errors": errors, "launched": launched, "tokens": [outs[rid] for rid in sorted(outs)]}
    finally:
        llm.close()


@pytest.mark.parametrize("tp,ep,model", [(2, 1, "tiny"), (1, 2, "tiny-moe")], ids=["tp2", "ep2"])
def test_generation_resumed_while_a_rank_is_suspended_fails_every_rank(checkpoints, tp, ep, model):
    """Rank 1's suspended bit rides the per-step exchange: every rank raises the same SuspendError
    at the same step() (the one applying rank 0's resume under TP, the next under EP) within
    seconds, not after an exchange timeout; nothing launched, and once rank 1 resumes the
    requests finish with the tokens of an uninterrupted run."""
    ranks = run_ranks(_resume_while_rank1_suspended, 2, checkpoints[model], tp, ep, timeout_s=240)
    first_call = 1 if tp > 1 else 2  # data-parallel ranks apply rank 0's resume in a paused step
    for rank, got in enumerate(ranks):
        assert [call for call, _, _ in got["errors"]] == [first_call, first_call + 1], f"rank {rank}: {got['errors']}"
        for _, message, seconds in got["errors"]:
            assert "rank 1 is still suspended (weights, kv_cache)" in message, message
            assert seconds < 10, f"rank {rank} raised after {seconds:.1f} s"
        assert got["launched"] == 0, f"rank {rank} launched while rank 1 was suspended"
    assert [e[1] for e in ranks[0]["errors"]] == [e[1] for e in ranks[1]["errors"]]
    ref = ranks[0]["ref"]
    assert len(ref) == len(PROMPTS) and all(ref)
    reporting = ranks if tp > 1 else ranks[:1]  # data-parallel ranks: rank 0 reports every rank's outputs
    for rank, got in enumerate(reporting):
        assert got["tokens"] == ref, f"rank {rank}: tokens differ from an uninterrupted run"
