"""The engine's log-probs with the Triton sampler backend (kernels/triton_log_probs.py, run by
the interpreter on CPU) equal the torch backend's: the same tokens, chosen log-probs to float32
rounding of the log-sum-exp, and the same top-n ids."""
import os

import pytest
import torch

from megatron_async import SamplingParams
from tests.helpers.engine_harness import make_llm, random_prompts


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU engine with the interpreted Triton kernels (TRITON_INTERPRET=1, set by conftest)")
def test_triton_log_probs_in_the_engine_equal_torch(qwen3_ckpt, monkeypatch):
    from megatron_async.kernels import triton_log_probs

    calls = []
    kernel = triton_log_probs.log_probs
    monkeypatch.setattr(triton_log_probs, "log_probs", lambda *a, **k: calls.append(a[2]) or kernel(*a, **k))
    prompts = random_prompts(3, 3, 10, 256, seed=31)
    params = [SamplingParams(top_k=1, num_tokens_to_generate=4, return_log_probs=True, top_n_logprobs=5),
              SamplingParams(temperature=0.9, seed=3, num_tokens_to_generate=4, return_log_probs=True),
              SamplingParams(temperature=1.0, top_p=0.8, seed=4, num_tokens_to_generate=4, top_n_logprobs=20)]
    outs = {}
    for backend in ("torch", "triton"):
        llm = make_llm(qwen3_ckpt, sampling_backend=backend)
        outs[backend] = llm.generate(prompts, params)
        assert llm.engine.runner.sampler.backend.value == backend
    assert calls and max(calls) == 20  # the kernel served every step asking for log-probs
    for ref, got, sp in zip(outs["torch"], outs["triton"], params):
        assert got.generated_tokens == ref.generated_tokens
        if sp.return_log_probs:
            torch.testing.assert_close(torch.tensor(got.generated_log_probs), torch.tensor(ref.generated_log_probs),
                                       atol=1e-5, rtol=0)
        if sp.top_n_logprobs:
            assert len(got.generated_top_n_logprobs) == len(ref.generated_top_n_logprobs) == 4
            for g, r in zip(got.generated_top_n_logprobs, ref.generated_top_n_logprobs):
                assert list(g) == list(r) and len(g) == sp.top_n_logprobs
                torch.testing.assert_close(torch.tensor(list(g.values())), torch.tensor(list(r.values())),
                                           atol=1e-5, rtol=0)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU engine with the interpreted Triton kernels (TRITON_INTERPRET=1, set by conftest)")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_log_prob_steps_take_their_tokens_from_the_log_prob_pass(qwen3_ckpt, monkeypatch, async_scheduling):
    """All-greedy steps asking for log-probs read the logits once on the Triton backend: the
    log-prob pass gives the argmax tokens (no argmax kernel runs), equal to the torch backend's."""
    from megatron_async.kernels import triton_sampling

    argmax_calls = []
    argmax = triton_sampling.argmax
    monkeypatch.setattr(triton_sampling, "argmax", lambda x: argmax_calls.append(x.shape[0]) or argmax(x))
    prompts = random_prompts(3, 3, 10, 256, seed=35)
    params = [SamplingParams(top_k=1, num_tokens_to_generate=3, return_log_probs=True, top_n_logprobs=n)
              for n in (0, 2, 20)]
    outs = {}
    for backend in ("torch", "triton"):
        llm = make_llm(qwen3_ckpt, sampling_backend=backend, async_scheduling=async_scheduling)
        outs[backend] = llm.generate(prompts, params)
    assert argmax_calls == []  # every step asked for log-probs
    for ref, got, sp in zip(outs["torch"], outs["triton"], params):
        assert got.generated_tokens == ref.generated_tokens and len(got.generated_tokens) == 3
        torch.testing.assert_close(torch.tensor(got.generated_log_probs), torch.tensor(ref.generated_log_probs),
                                   atol=1e-5, rtol=0)
        for i, (g, r) in enumerate(zip(got.generated_top_n_logprobs or [], ref.generated_top_n_logprobs or [])):
            assert list(g) == list(r) and len(g) == sp.top_n_logprobs
            assert next(iter(g)) == got.generated_tokens[i]  # greedy: the token is the top-1
            assert g[got.generated_tokens[i]] == got.generated_log_probs[i]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_log_probs_in_graphs_and_launch_ahead_equal_torch(qwen3_ckpt):
    """CUDA, float32 weights: the Triton log-probs replayed inside the log-prob graphs (decode
    steps: the NUCLEUS variant's log-prob twin, not FULL), launch-ahead on and off, against the
    torch backend run eager; no host sync in decode steps asking for them."""
    from megatron_async import LLM
    from tests.helpers.engine_harness import count_replays_by_variant, decode_steps_without_host_sync

    prompts = random_prompts(8, 5, 40, 256, seed=32)
    params = [SamplingParams(top_k=1, num_tokens_to_generate=12, return_log_probs=True, top_n_logprobs=5),
              SamplingParams(temperature=0.9, top_p=0.9, seed=5, num_tokens_to_generate=12, return_log_probs=True),
              SamplingParams(temperature=0.8, seed=6, num_tokens_to_generate=12, top_n_logprobs=20)]
    params = [params[i % 3] for i in range(len(prompts))]

    def run(backend, graphs, async_):
        cfg = make_llm(qwen3_ckpt, sampling_backend=backend, cuda_graphs=graphs, async_scheduling=async_).config
        llm = LLM(model=str(qwen3_ckpt), device="cuda", dtype="float32", inference_config=cfg)
        replays = count_replays_by_variant(llm.engine.runner.graphs) if graphs else None
        outs = llm.generate(prompts, params)
        if graphs:
            st = llm.engine.stats
            assert replays["nucleus+log_probs"] > 0 and replays["full"] == st.mixed_graph_replays, replays
        return outs, llm

    ref, _ = run("torch", False, False)
    for graphs, async_ in ((True, True), (True, False), (False, True)):
        got, llm = run("triton", graphs, async_)
        for r, g, sp in zip(ref, got, params):
            assert g.generated_tokens == r.generated_tokens
            if sp.return_log_probs:
                torch.testing.assert_close(torch.tensor(g.generated_log_probs), torch.tensor(r.generated_log_probs),
                                           atol=2e-5, rtol=0)
            if sp.top_n_logprobs:
                for a, b in zip(g.generated_top_n_logprobs, r.generated_top_n_logprobs):
                    assert list(a) == list(b)
    eng = llm.engine  # launch-ahead, eager: prefilled within the warm steps, then decode only
    for i, p in enumerate(random_prompts(8, 3, 12, 256, seed=33)):
        eng.add_request(p, SamplingParams(temperature=1.0, seed=i, return_log_probs=True, top_n_logprobs=5,
                                          num_tokens_to_generate=30))
    assert decode_steps_without_host_sync(eng, 16) == 16
