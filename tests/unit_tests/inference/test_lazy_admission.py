"""Prompts beyond what the next step can admit are added between steps (``LLM.generate`` and the
benchmark driver), so their validation runs while the GPU works. The outputs must equal those
of adding everything up front, token for token (async and serial), with invalid prompts still
answered in their slots; and the deferral must really happen (adds after the first step)."""
from __future__ import annotations

import random

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.cli.driver import run_workload
from megatron_async.cli.workload import WorkloadRequest
from megatron_async.inference.request import RequestOutput

CFG = dict(max_requests=6, max_tokens=48, max_sequence_length=128, num_kv_blocks=64)  # 6 x 46 tokens fit; not 1 GB


def _prompts(n: int = 30) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 200) for _ in range(rng.randint(8, 40))] for _ in range(n)]


def _params(n: int) -> list[SamplingParams]:
    # greedy and seeded sampling mixed; seeds fixed so the draw order cannot matter
    return [SamplingParams(top_k=1, num_tokens_to_generate=6, ignore_eos=True) if i % 2 else
            SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, num_tokens_to_generate=6, ignore_eos=True)
            for i in range(n)]


def _spy_adds(llm: LLM) -> list[int]:
    """Records, for every add_request, how many steps the engine had run."""
    eng, seen, real = llm.engine, [], llm.engine.add_request

    def add(*args, **kwargs):
        seen.append(eng.stats.steps)
        return real(*args, **kwargs)

    eng.add_request = add
    return seen


def _all_up_front(llm: LLM, prompts, params) -> list[RequestOutput]:
    slots = []
    for p, sp in zip(prompts, params):
        try:
            slots.append(llm.engine.add_request(p, sp))
        except Exception as e:  # noqa: BLE001 - the same InvalidRequestError generate turns into an output
            slots.append(str(e))
    done = llm.engine.run_requests([s for s in slots if isinstance(s, int)])
    return [done[s] if isinstance(s, int) else s for s in slots]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_generate_adds_lazily_with_the_same_outputs(async_scheduling):
    prompts, params = _prompts(), _params(30)
    prompts[7] = []  # empty: an error output in its slot
    prompts[19] = [5, 10 ** 6]  # out of vocab
    cfg = InferenceConfig(**CFG, async_scheduling=async_scheduling)
    ref_llm = LLM(inference_config=cfg)
    ref = _all_up_front(ref_llm, prompts, params)

    llm = LLM(inference_config=cfg)
    adds = _spy_adds(llm)
    out = llm.generate(prompts, params)
    assert adds[0] == 0 and max(adds) > 0, "every prompt was added before the first step"
    assert len(adds) == 30
    for i, (o, r) in enumerate(zip(out, ref, strict=True)):
        if isinstance(r, str):
            assert o.finish_reason == "error" and o.error == r, i
        else:
            assert o.generated_tokens == r.generated_tokens and o.finish_reason == r.finish_reason, i
    assert llm.engine.stats.steps == ref_llm.engine.stats.steps
    if async_scheduling:
        assert llm.engine.stats.overlapped_steps > 0


def test_driver_defers_adds_and_counts_latency_from_arrival():
    prompts, params = _prompts(), _params(30)
    llm = LLM(inference_config=InferenceConfig(**CFG))
    ref = [o.generated_tokens for o in llm.generate(prompts, params)]

    llm = LLM(inference_config=InferenceConfig(**CFG))
    adds = _spy_adds(llm)
    requests = [WorkloadRequest(p, 6) for p in prompts]
    by_prompt = {id(r): sp for r, sp in zip(requests, params)}
    run = run_workload(llm.engine, requests, lambda r: by_prompt[id(r)])
    assert adds[0] == 0 and max(adds) > 0
    assert [o.generated_tokens for o in run.outputs] == ref
    # every request arrived at time 0: its TTFT is its first token's landing time
    assert all(t.arrival == 0.0 for t in run.timings)


def test_admission_queue_short():
    llm = LLM(inference_config=InferenceConfig(**CFG))
    eng = llm.engine
    assert eng.admission_queue_short()
    sp = SamplingParams(top_k=1, num_tokens_to_generate=2)
    eng.add_request(list(range(3, 50)), sp)  # 47 tokens: under 2 x max_tokens
    assert eng.admission_queue_short()
    eng.add_request(list(range(3, 53)), sp)  # 97 tokens waiting
    assert not eng.admission_queue_short()
    llm = LLM(inference_config=InferenceConfig(**CFG))
    for _ in range(CFG["max_requests"]):  # as many waiting requests as one step can admit
        llm.engine.add_request([3, 4], sp)
    assert not llm.engine.admission_queue_short()
