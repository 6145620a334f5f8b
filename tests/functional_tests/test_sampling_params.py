"""min_tokens, min_p and the presence / frequency / repetition penalties end to end.

Each field is checked against a small independent implementation of its math (plain Python
over HF's logits, one token at a time: vLLM's definitions) and shown to change the tokens;
then async == serial with penalties (launch-ahead really overlapped), and a penalised
request keeps its tokens through pause / evict / recompute and in any batch."""
import math
import os
from collections import Counter
from dataclasses import replace

import pytest
import torch

from megatron_async import SamplingParams
from megatron_async.inference.text_generation_controllers.sampling import gumbel_noise, row_keys
from tests.helpers.engine_harness import (Arrival, count_replays_by_variant, decode_steps_without_host_sync,
                                                    make_llm, random_prompts, run_arrivals, tokens_of)
from tests.helpers.hf_models import hf_logits, load_hf_reference


def _penalised(logits: list[float], prompt: list[int], out: list[int], sp: SamplingParams, stop: set[int]):
    counts, seen = Counter(out), set(prompt) | set(out)
    res = []
    for t, x in enumerate(logits):
        if t in seen:
            x = x / sp.repetition_penalty if x > 0 else x * sp.repetition_penalty
        x -= sp.frequency_penalty * counts[t] + sp.presence_penalty * (counts[t] > 0)
        if len(out) < sp.min_tokens and t in stop:
            x = -math.inf
        res.append(x)
    return res


def reference_generate(model, prompt: list[int], sp: SamplingParams, eos: int | None) -> list[int]:
    """Token-by-token reference: HF logits -> penalties -> (greedy | temperature + min-p +
    Gumbel-max with the engine's (seed, position) noise)."""
    out: list[int] = []
    stop = {eos} if eos is not None and not sp.ignore_eos else set()
    while len(out) < sp.num_tokens_to_generate:
        x = _penalised(hf_logits(model, prompt + out)[-1].double().tolist(), prompt, out, sp, stop)
        if sp.temperature == 0 or sp.top_k == 1:
            tok = max(range(len(x)), key=lambda i: x[i])
        else:
            s = [v / sp.temperature for v in x]
            top = max(s)
            noise = gumbel_noise(row_keys(torch.tensor([sp.seed]), torch.tensor([len(prompt) + len(out)])), len(s))[0]
            kept = [i for i in range(len(s)) if math.exp(s[i] - top) >= sp.min_p]
            tok = max(kept, key=lambda i: s[i] + noise[i].item())
        out.append(tok)
        if tok in stop and len(out) >= sp.min_tokens:
            break
    return out


@pytest.fixture(scope="module")
def hf_ref(qwen3_ckpt):
    return load_hf_reference(qwen3_ckpt)


N = 14
CASES = {
    "repetition": dict(top_k=1, repetition_penalty=1.8),
    "repetition_below_one": dict(top_k=1, repetition_penalty=0.6),
    "presence": dict(top_k=1, presence_penalty=1.5),
    "frequency": dict(top_k=1, frequency_penalty=1.2),
    "all_penalties_sampled": dict(temperature=0.9, seed=5, presence_penalty=0.5, frequency_penalty=0.4,
                                  repetition_penalty=1.3),
    "min_p": dict(temperature=1.5, seed=7, min_p=0.3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_field_matches_independent_reference_and_changes_tokens(qwen3_ckpt, hf_ref, name):
    prompts = random_prompts(3, 4, 12, 256, seed=21)
    sp = SamplingParams(num_tokens_to_generate=N, **CASES[name])
    base_kw = {k: v for k, v in CASES[name].items() if k in ("top_k", "temperature", "seed")}
    base = SamplingParams(num_tokens_to_generate=N, **base_kw)
    llm = make_llm(qwen3_ckpt)
    outs = [o.generated_tokens for o in llm.generate(prompts, sp)]
    assert outs == [reference_generate(hf_ref, p, sp, None) for p in prompts]
    assert outs != [o.generated_tokens for o in make_llm(qwen3_ckpt).generate(prompts, base)]


def test_min_tokens_masks_eos_until_reached(qwen3_ckpt, hf_ref):
    prompts = random_prompts(3, 4, 12, 256, seed=22)
    greedy = make_llm(qwen3_ckpt).generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=N))
    eos = greedy[0].generated_tokens[1]  # request 0 would stop at its 2nd token
    sp = SamplingParams(top_k=1, num_tokens_to_generate=N, termination_id=eos, min_tokens=6)
    outs = make_llm(qwen3_ckpt).generate(prompts, sp)
    assert [o.generated_tokens for o in outs] == [reference_generate(hf_ref, p, sp, eos) for p in prompts]
    assert all(eos not in o.generated_tokens[:6] for o in outs)
    assert len(outs[0].generated_tokens) >= 6
    early = make_llm(qwen3_ckpt).generate(prompts[:1], SamplingParams(top_k=1, num_tokens_to_generate=N,
                                                                       termination_id=eos))
    assert early[0].generated_tokens == greedy[0].generated_tokens[:2] and early[0].finish_reason == "stop"


PENALISED = [
    SamplingParams(temperature=0.8, top_k=20, seed=11, presence_penalty=0.8, num_tokens_to_generate=16),
    SamplingParams(top_k=1, repetition_penalty=1.5, frequency_penalty=1.5, num_tokens_to_generate=12),
    SamplingParams(temperature=1.1, top_p=0.9, min_p=0.05, seed=13, frequency_penalty=2.0, num_tokens_to_generate=18),
    SamplingParams(temperature=0.7, num_tokens_to_generate=15),  # no penalties, engine seed
    SamplingParams(temperature=1.0, seed=3, repetition_penalty=0.7, presence_penalty=-2.0, min_tokens=4,
                   num_tokens_to_generate=10),
]


def test_penalties_async_equals_serial_with_overlap(qwen3_ckpt):
    prompts = random_prompts(10, 3, 30, 256, seed=23)
    arr = [Arrival(2 * i, p, PENALISED[i % len(PENALISED)]) for i, p in enumerate(prompts)]
    results = {}
    for mode in (False, True):
        llm = make_llm(qwen3_ckpt, async_scheduling=mode)
        results[mode] = (tokens_of(run_arrivals(llm, arr)), llm.engine.stats, llm.engine.context.sampling_state)
    assert results[True][0] == results[False][0]
    st, state = results[True][1], results[True][2]
    assert st.overlapped_decode_steps >= 0.8 * st.decode_steps and st.decode_steps > 20, st.as_dict()
    assert state.num_assigned == 8 and len(state._free) == 16  # 8 penalised requests; every slot back


def test_penalised_requests_survive_pause_evict_and_batching(qwen3_ckpt):
    prompts = random_prompts(10, 5, 30, 256, seed=24)
    arr = [Arrival(i, p, PENALISED[i % len(PENALISED)]) for i, p in enumerate(prompts)]
    for mode in (False, True):
        llm = make_llm(qwen3_ckpt, num_kv_blocks=24, max_tokens=32, async_scheduling=mode)
        book, evicted = llm.engine.book, []
        evict = book.evict
        book.evict = lambda req: (evicted.append((req.sampling_params.has_penalties, len(req.generated_tokens))),
                                 evict(req))
        busy = tokens_of(run_arrivals(llm, arr))
        st = llm.engine.stats
        assert st.paused > 0 and st.evicted > 0, st.as_dict()
        assert any(pen and n > 0 for pen, n in evicted), evicted  # recomputed with counts to refill
        for i in range(len(prompts)):
            if arr[i].params.seed is None and arr[i].params.top_k != 1:
                continue  # engine-assigned seeds depend on arrival order
            alone = make_llm(qwen3_ckpt, async_scheduling=mode).generate([prompts[i]], arr[i].params)
            assert busy[i] == alone[0].generated_tokens, (mode, i)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU engine with the interpreted Triton sampler (TRITON_INTERPRET=1, set by the kernel "
                           "tests' conftest); on CUDA the test_cuda_* tests cover it")
def test_triton_sampler_in_the_engine_equals_torch(qwen3_ckpt, monkeypatch):
    from megatron_async.kernels import triton_sampling

    argmax_calls = []
    kernel = triton_sampling.argmax
    monkeypatch.setattr(triton_sampling, "argmax", lambda *a, **k: argmax_calls.append(1) or kernel(*a, **k))
    prompts = random_prompts(3, 3, 12, 256, seed=25)  # the interpreter is slow: a short run
    params = [replace(PENALISED[i], num_tokens_to_generate=5) for i in (0, 2, 4)]
    greedy = [SamplingParams(top_k=1, num_tokens_to_generate=5, ignore_eos=True)] * 3  # all-greedy steps: argmax kernel
    outs = {}
    for backend in ("torch", "triton"):
        llm = make_llm(qwen3_ckpt, sampling_backend=backend)
        outs[backend] = [o.generated_tokens for o in llm.generate(prompts, params) + llm.generate(prompts, greedy)]
        assert llm.engine.runner.sampler.backend.value == backend
    assert outs["torch"] == outs["triton"]
    assert argmax_calls  # the all-greedy steps took the chunked argmax


def _cuda_llm(path, **cfg):
    from megatron_async import LLM

    return LLM(model=str(path), device="cuda", dtype="float32", inference_config=make_llm(path, **cfg).config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_penalties_graphs_async_serial_and_backends_agree(qwen3_ckpt):
    prompts = random_prompts(12, 3, 30, 256, seed=26)
    arr = [Arrival(2 * i, p, PENALISED[i % len(PENALISED)]) for i, p in enumerate(prompts)]
    res = {}
    for key in [("triton", True, True), ("triton", False, True), ("triton", True, False), ("torch", True, True)]:
        backend, graphs, async_ = key
        llm = _cuda_llm(qwen3_ckpt, sampling_backend=backend, cuda_graphs=graphs, async_scheduling=async_,
                        attention_backend="triton")
        replays = count_replays_by_variant(llm.engine.runner.graphs) if graphs else None
        res[key] = tokens_of(run_arrivals(llm, arr))
        if graphs:
            assert llm.engine.runner.graphs.num_replays > 0
            assert replays["full"] > 0, replays  # a penalties graph ran
        if async_:
            assert llm.engine.stats.overlap_ratio > 0.8
    first = res[("triton", True, True)]
    assert all(r == first for r in res.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_no_host_sync_with_penalties_and_filters(qwen3_ckpt):
    llm = _cuda_llm(qwen3_ckpt, attention_backend="triton", max_requests=16, sampling_backend="triton")
    eng = llm.engine
    for i, p in enumerate(random_prompts(8, 5, 20, 256, seed=27)):
        eng.add_request(p, SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05, seed=i,
                                          presence_penalty=0.5, repetition_penalty=1.2, min_tokens=10,
                                          num_tokens_to_generate=40))
    decoded = decode_steps_without_host_sync(eng, 20)
    assert decoded == 20 and eng.stats.overlap_ratio > 0.9
