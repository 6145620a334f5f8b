"""Prompt log-probs (``SamplingParams.return_prompt_log_probs``) against transformers'
teacher-forced log_softmax, through chunked prefill, prefix-cache hits, launch-ahead, top-n,
scoring-only requests and a hybrid model."""
import pytest
import torch

from megatron_async import SamplingParams
from tests.helpers.engine_harness import Arrival, make_llm, random_prompts, run_arrivals
from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint
from tests.helpers.hf_models import hf_logits, load_hf_reference, make_tiny_checkpoint

VOCAB = 256  # the tiny GPT checkpoints' vocabulary


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("qwen3"))
    return path, load_hf_reference(path)


def hf_prompt_log_probs(ref, prompt: list[int]) -> torch.Tensor:
    """log P(prompt[i] | prompt[:i]) for i >= 1, teacher-forced."""
    lp = torch.log_softmax(hf_logits(ref, prompt), dim=-1)
    return lp[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]


def assert_matches_hf(ref, out, tol: float = 1e-5) -> None:
    expected = hf_prompt_log_probs(ref, out.prompt_tokens)
    got = torch.tensor(out.prompt_log_probs)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    if not got.numel():
        return
    err = (got - expected).abs().max().item()
    assert err < tol, f"prompt log-probs differ from HF by {err:.2e}"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_matches_hf(qwen3, async_scheduling):
    """Prompts of up to 45 tokens at 16 tokens per step: each spans several prefill steps, and
    the first token of every chunk is scored from the last position of the chunk before."""
    path, ref = qwen3
    prompts = random_prompts(3, 30, 45, VOCAB, seed=3)
    llm = make_llm(path, max_tokens=16, async_scheduling=async_scheduling)
    sp = SamplingParams(top_k=1, num_tokens_to_generate=4, return_prompt_log_probs=True)
    outs = llm.generate(prompts, sp)
    for o in outs:
        assert len(o.generated_tokens) == 4 and o.prompt_top_n_logprobs is None
        assert_matches_hf(ref, o)
    assert llm.engine.stats.prefill_steps >= 6  # >= 90 prompt tokens at 16 a step


def test_async_equals_serial_exactly(qwen3):
    path, _ = qwen3
    prompts = random_prompts(4, 10, 40, VOCAB, seed=4)
    params = [SamplingParams(temperature=0.9, seed=i, num_tokens_to_generate=6, return_log_probs=True,
                             return_prompt_log_probs=i % 2 == 0, top_n_logprobs=2 * (i == 2)) for i in range(4)]
    results = {}
    for mode in (False, True):
        llm = make_llm(path, max_tokens=24, async_scheduling=mode)
        outs = llm.generate(prompts, params)
        results[mode] = [(o.generated_tokens, o.generated_log_probs, o.prompt_log_probs, o.prompt_top_n_logprobs)
                         for o in outs]
        if mode:
            assert llm.engine.stats.overlapped_steps > 0
    assert results[True] == results[False]
    assert results[True][0][2] is not None and results[True][1][2] is None


def test_scoring_only_and_top_n(qwen3, monkeypatch):
    """num_tokens_to_generate=0 scores the prompt and generates nothing; top-n has the shape and
    format of the generated tokens' top-n, and its best entry is the HF argmax. Sub-chunks of 3
    positions (a 151k vocabulary's size, scaled to this one's)."""
    from megatron_async.inference.text_generation_controllers import prompt_scoring

    monkeypatch.setattr(prompt_scoring, "SUBCHUNK_BYTES", VOCAB * 32 * 3)
    path, ref = qwen3
    prompts = random_prompts(2, 5, 20, VOCAB, seed=5) + [[7]]
    llm = make_llm(path, max_tokens=8, max_requests=4)
    sp = SamplingParams(top_k=1, num_tokens_to_generate=0, return_prompt_log_probs=True, top_n_logprobs=3)
    outs = llm.generate(prompts, sp)
    for o, p in zip(outs, prompts):
        assert o.generated_tokens == [] and o.finish_reason == "length" and o.error is None
        assert len(o.prompt_log_probs) == len(p) - 1 == len(o.prompt_top_n_logprobs)
        assert_matches_hf(ref, o)
        lp = torch.log_softmax(hf_logits(ref, p), dim=-1)
        for i, top in enumerate(o.prompt_top_n_logprobs):
            assert len(top) == 3 and max(top, key=top.get) == int(lp[i].argmax())
            for tok, v in top.items():
                assert abs(v - lp[i, tok].item()) < 1e-5
    assert outs[2].prompt_log_probs == []
    bad = llm.generate([prompts[0]], SamplingParams(num_tokens_to_generate=0))[0]
    assert bad.finish_reason == "error" and "num_tokens_to_generate" in bad.error


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_streamed_updates_carry_the_whole_prompt_once(qwen3, async_scheduling):
    """Streaming: the first update with tokens (or the one that ends a scoring-only request)
    carries the whole prompt's log-probs and top-n, equal to the final output's; prompts span
    several prefill chunks, and a request without prompt scoring gets none."""
    path, _ = qwen3
    llm = make_llm(path, max_tokens=16, async_scheduling=async_scheduling)
    eng = llm.engine
    scored = SamplingParams(top_k=1, num_tokens_to_generate=4, return_prompt_log_probs=True, top_n_logprobs=2)
    asks = [(p, scored) for p in random_prompts(3, 20, 45, VOCAB, seed=11)]
    asks += [(asks[0][0], SamplingParams(top_k=1, num_tokens_to_generate=0, return_prompt_log_probs=True)),
             (asks[1][0], SamplingParams(top_k=1, num_tokens_to_generate=3))]
    ids = [eng.add_request(p, sp) for p, sp in asks]
    updates, outs = {i: [] for i in ids}, {}
    while eng.has_unfinished_requests():
        res = eng.step()
        for u in res.updates:
            updates[u.request_id].append(u)
        outs.update((o.request_id, o) for o in res.finished)
    for (prompt, sp), rid in zip(asks, ids):
        carrying = [k for k, u in enumerate(updates[rid]) if u.prompt_log_probs is not None]
        if not sp.return_prompt_log_probs:
            assert carrying == [] and all(u.prompt_top_n_logprobs is None for u in updates[rid])
            continue
        first = next(k for k, u in enumerate(updates[rid]) if u.new_tokens or u.finished)
        assert carrying == [first], (carrying, first)
        u, out = updates[rid][first], outs[rid]
        assert len(u.prompt_log_probs) == len(prompt) - 1 and list(u.prompt_log_probs) == out.prompt_log_probs
        tops = None if u.prompt_top_n_logprobs is None else list(u.prompt_top_n_logprobs)
        assert tops == out.prompt_top_n_logprobs and (tops is not None) == (sp.top_n_logprobs > 0)
    assert eng.stats.prefill_steps > len(asks)  # prompts did span several chunks


def test_prefix_cache_hits_do_not_leave_holes(qwen3):
    """A request scoring its prompt recomputes what the prefix cache holds (others hit it)."""
    path, ref = qwen3
    shared = random_prompts(1, 24, 24, VOCAB, seed=6)[0]
    prompts = [shared + t for t in random_prompts(3, 3, 6, VOCAB, seed=7)]
    llm = make_llm(path, enable_prefix_caching=True, max_requests=1)
    plain = SamplingParams(top_k=1, num_tokens_to_generate=2)
    llm.generate([prompts[0]], plain)
    hits = llm.engine.stats.prefix_hit_tokens
    scored = llm.generate([prompts[1]], SamplingParams(top_k=1, num_tokens_to_generate=2, return_prompt_log_probs=True))[0]
    assert llm.engine.stats.prefix_hit_tokens == hits  # it took no hit
    assert_matches_hf(ref, scored)
    llm.generate([prompts[2]], plain)
    assert llm.engine.stats.prefix_hit_tokens >= hits + 24  # the cache really held the prefix


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_evicted_requests_rescore_without_holes(qwen3, async_scheduling):
    """A pool too small for the batch pauses and evicts scoring requests mid-prompt; their
    recompute (prefix hits allowed up to what they had scored) rewrites the same entries."""
    path, ref = qwen3
    prompts = random_prompts(6, 30, 45, VOCAB, seed=10)
    llm = make_llm(path, num_kv_blocks=21, max_tokens=32, enable_prefix_caching=True,
                   async_scheduling=async_scheduling)
    sp = SamplingParams(top_k=1, num_tokens_to_generate=6, return_prompt_log_probs=True)
    for o in llm.generate(prompts, sp):
        assert_matches_hf(ref, o)
    st = llm.engine.stats
    assert st.evicted > 0, st.as_dict()


def test_hybrid_model_matches_hf(tmp_path):
    path = make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tmp_path)
    ref = load_hf_reference(path)
    prompts = random_prompts(2, 12, 20, 128, seed=8)
    llm = make_llm(path, max_tokens=8, max_requests=4)
    outs = llm.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=2, return_prompt_log_probs=True))
    for o in outs:
        assert_matches_hf(ref, o, tol=1e-4)


def test_bad_top_n_is_the_request_error(qwen3):
    path, _ = qwen3
    llm = make_llm(path)
    bad, good = llm.generate([[1, 2, 3], [4, 5, 6]], [
        SamplingParams(return_prompt_log_probs=True, top_n_logprobs=-1),
        SamplingParams(top_k=1, num_tokens_to_generate=1, return_prompt_log_probs=True)])
    assert bad.finish_reason == "error" and "top_n_logprobs" in bad.error
    assert len(good.prompt_log_probs) == 2 and len(good.generated_tokens) == 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculative_decoding_on(qwen3, async_scheduling, monkeypatch):
    """A repetitive request decodes with n-gram drafts while scoring requests arrive and prefill
    in the same steps: their prompt log-probs and everyone's tokens are plain decoding's."""
    from megatron_async.inference.text_generation_controllers.model_runner import ModelRunner

    path, ref = qwen3
    sp = SamplingParams(top_k=1, num_tokens_to_generate=12, return_prompt_log_probs=True, return_log_probs=True)
    arrivals = [Arrival(0, [5, 6, 7, 8] * 6, sp), Arrival(3, random_prompts(1, 40, 40, VOCAB, seed=12)[0], sp),
                Arrival(4, [9, 10, 11] * 7, sp)]
    plain = run_arrivals(make_llm(path, max_tokens=16, async_scheduling=async_scheduling), arrivals)
    spec_scoring_steps = []
    compute_step = ModelRunner.compute_step

    def watched(self, shape, spec=None, dp_num_tokens=0, scoring=None, **kwargs):
        spec_scoring_steps.append(bool(spec) and scoring is not None)
        return compute_step(self, shape, spec, dp_num_tokens, scoring, **kwargs)

    monkeypatch.setattr(ModelRunner, "compute_step", watched)
    llm = make_llm(path, max_tokens=16, async_scheduling=async_scheduling, num_speculative_tokens=2,
                   speculative_method="ngram", speculative_min_acceptance=0.0)
    spec = run_arrivals(llm, arrivals)
    assert llm.engine.stats.spec_draft_tokens > 0 and any(spec_scoring_steps)
    for i in range(len(arrivals)):
        assert plain[i].generated_tokens == spec[i].generated_tokens
        # float32 GEMMs of other row counts round differently on some CPUs (AVX-512 MKL kernels:
        # 2e-6 seen at |log-prob| 7); a scoring error is orders of magnitude above this
        assert plain[i].prompt_log_probs == pytest.approx(spec[i].prompt_log_probs, abs=1e-5)
        assert_matches_hf(ref, spec[i])


def _tp_worker(rank: int, world: int, ckpt: str, prompts: list[list[int]]) -> list:
    from megatron_async import LLM, InferenceConfig

    config = InferenceConfig(block_size_tokens=4, num_kv_blocks=128, max_requests=4, max_tokens=16,
                             max_sequence_length=128)
    llm = LLM(ckpt, inference_config=config, tensor_parallel_size=world)
    try:  # every rank steps (the same collectives); rank 0 adds the requests and reports
        sp = SamplingParams(top_k=1, num_tokens_to_generate=3, return_prompt_log_probs=True, top_n_logprobs=2)
        eng, outs = llm.engine, {}
        for p in prompts if rank == 0 else ():
            eng.add_request(p, sp)
        while eng.has_unfinished_requests():
            outs.update((o.request_id, (o.prompt_log_probs, o.prompt_top_n_logprobs)) for o in eng.step().finished)
        return [outs[k] for k in sorted(outs)]
    finally:
        llm.close()


def test_tensor_parallel_two_ranks(tmp_path):
    """Vocab-parallel logits (TP=2, gloo): the same prompt log-probs as HF."""
    from tests.helpers.multiprocess import run_ranks

    ckpt = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "ckpt", num_attention_heads=4, num_key_value_heads=2)
    ref = load_hf_reference(ckpt)
    prompts = random_prompts(2, 10, 25, VOCAB, seed=9)
    got = run_ranks(_tp_worker, 2, str(ckpt), prompts, timeout_s=120)[0]
    for p, (lps, tops) in zip(prompts, got):
        expected = hf_prompt_log_probs(ref, p)
        assert (torch.tensor(lps) - expected).abs().max().item() < 1e-5
        assert len(tops) == len(p) - 1 and all(len(t) == 2 for t in tops)


def _ep_worker(rank: int, world: int, prompts: list[list[int]]) -> list:
    from megatron_async import LLM, InferenceConfig

    config = InferenceConfig(block_size_tokens=4, num_kv_blocks=128, max_requests=4, max_tokens=16,
                             max_sequence_length=96)
    llm = LLM(None, inference_config=config, default_model="tiny-moe", expert_parallel_size=world)
    try:  # every rank generates; each serves its share and rank 0 reports every request
        sp = SamplingParams(top_k=1, num_tokens_to_generate=3, return_prompt_log_probs=True, top_n_logprobs=2)
        outs = llm.generate(prompts, sp)
        return [(o.prompt_log_probs, o.prompt_top_n_logprobs, llm.engine.stats.prefill_steps) for o in outs]
    finally:
        llm.close()


def test_expert_parallel_two_ranks_equal_one_engine():
    """EP=2 (gloo, the built-in tiny MoE): prompt positions scored in steps whose MoE layers
    exchange tokens between ranks give one engine's prompt log-probs and top-n."""
    from megatron_async import LLM, InferenceConfig
    from tests.helpers.multiprocess import run_ranks

    prompts = random_prompts(4, 10, 40, 256, seed=11)
    got = run_ranks(_ep_worker, 2, prompts, timeout_s=240)[0]
    one = LLM(None, inference_config=InferenceConfig(block_size_tokens=4, num_kv_blocks=128, max_requests=4,
                                                      max_tokens=16, max_sequence_length=96), default_model="tiny-moe")
    ref = one.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=3, return_prompt_log_probs=True,
                                               top_n_logprobs=2))
    assert max(map(len, prompts)) > 16 and got[0][2] >= 2  # a prompt longer than a step's 16 tokens: chunked
    for p, (lps, tops, _), r in zip(prompts, got, ref):
        assert len(lps) == len(p) - 1 and len(tops) == len(p) - 1
        assert lps == pytest.approx(r.prompt_log_probs, abs=1e-5)
        assert [sorted(t) for t in tops] == [sorted(t) for t in r.prompt_top_n_logprobs]
