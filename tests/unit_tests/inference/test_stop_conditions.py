"""When requests stop (EOS, stop words, length limits) and what they return with their tokens
(log-probs equal to Hugging Face's teacher-forced ones), in serial and launch-ahead mode."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from tests.helpers.hf_models import hf_logits, load_hf_reference, make_tiny_checkpoint  # noqa: E402

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28], [8, 41]]
NEW = 8

pytestmark = pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("llama_stop"))


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_hf_reference(ckpt)


@pytest.fixture(scope="module")
def greedy(ckpt) -> list[list[int]]:
    """Greedy continuations without any stop condition (the serial engine)."""
    llm = _llm(ckpt, False)
    return [o.generated_tokens for o in llm.generate(PROMPTS, SamplingParams(top_k=1, num_tokens_to_generate=NEW))]


def _llm(ckpt, async_scheduling: bool, **overrides) -> LLM:
    cfg = dict(block_size_tokens=4, num_kv_blocks=64, max_requests=4, max_tokens=8, max_sequence_length=32,
               async_scheduling=async_scheduling)
    cfg.update(overrides)
    return LLM(model=str(ckpt), inference_config=InferenceConfig(**cfg))


def _first_new(tokens: list[int], start: int) -> int:
    """Index >= start of a token that does not occur earlier in ``tokens``."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_eos_stops_unless_ignored(ckpt, greedy, async_scheduling):
    cont = greedy[0]
    i = _first_new(cont, 2)
    eos = cont[i]
    llm = _llm(ckpt, async_scheduling)
    stop = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=eos)
    ignore = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=eos, ignore_eos=True)
    plain = SamplingParams(top_k=1, num_tokens_to_generate=NEW)
    outs = llm.generate([PROMPTS[0], PROMPTS[0], PROMPTS[1]], [stop, ignore, plain])
    assert outs[0].generated_tokens == cont[: i + 1] and outs[0].finish_reason == "stop"
    assert outs[1].generated_tokens == cont and outs[1].finish_reason == "length"
    assert outs[2].generated_tokens == greedy[1] and outs[2].finish_reason == "length"
    st = llm.engine.stats
    # launch-ahead already computed a token past the EOS; it must have been dropped
    assert st.discarded_rows == (1 if async_scheduling else 0)
    assert st.generated_tokens == i + 1 + 2 * NEW


def test_stop_word_sequences(ckpt, greedy, async_scheduling):
    cont = greedy[0]
    i = _first_new(cont, 2)
    absent = next(t for t in range(256) if t not in cont)
    llm = _llm(ckpt, async_scheduling)
    params = [
        SamplingParams(top_k=1, num_tokens_to_generate=NEW, stop_words=[[absent], cont[i - 1 : i + 1]]),
        SamplingParams(top_k=1, num_tokens_to_generate=NEW, stop_words=[[cont[i - 1], absent]]),  # never matches
        SamplingParams(top_k=1, num_tokens_to_generate=NEW, stop_words=[[cont[0]]]),  # the first token
    ]
    outs = llm.generate([PROMPTS[0]] * 3, params)
    assert outs[0].generated_tokens == cont[: i + 1] and outs[0].finish_reason == "stop"
    assert outs[1].generated_tokens == cont and outs[1].finish_reason == "length"
    assert outs[2].generated_tokens == cont[:1] and outs[2].finish_reason == "stop"


def test_min_tokens_disarms_stop_sequences(ckpt, greedy, async_scheduling):
    """A stop sequence completed before min_tokens tokens exist does not end the request (vLLM)."""
    cont = greedy[0]
    llm = _llm(ckpt, async_scheduling)
    stop = [cont[:2]]
    outs = llm.generate([PROMPTS[0]] * 2, [SamplingParams(top_k=1, num_tokens_to_generate=NEW, stop_words=stop),
                                           SamplingParams(top_k=1, num_tokens_to_generate=NEW, stop_words=stop,
                                                          min_tokens=3)])
    assert outs[0].generated_tokens == cont[:2] and outs[0].finish_reason == "stop"
    assert outs[1].generated_tokens == cont and outs[1].finish_reason == "length"


def test_num_tokens_to_generate(ckpt, greedy, async_scheduling):
    llm = _llm(ckpt, async_scheduling)
    lengths = [1, 3, NEW]
    outs = llm.generate(PROMPTS, [SamplingParams(top_k=1, num_tokens_to_generate=n) for n in lengths])
    assert [o.generated_tokens for o in outs] == [g[:n] for g, n in zip(greedy, lengths)]
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.engine.stats.discarded_rows == 0  # length limits are known before launching


def test_max_sequence_length(ckpt, greedy, async_scheduling):
    prompt = PROMPTS[1]  # 13 tokens
    llm = _llm(ckpt, async_scheduling, max_sequence_length=len(prompt) + 5)
    out = llm.generate([prompt], SamplingParams(top_k=1, num_tokens_to_generate=5))[0]
    assert out.generated_tokens == greedy[1][:5] and out.finish_reason == "length"
    assert len(out.prompt_tokens) + len(out.generated_tokens) == llm.config.max_sequence_length


def _hf_log_probs(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Teacher-forced log-probs of every generated token: [len(generated), vocab]."""
    logits = hf_logits(hf, prompt + generated[:-1])
    return torch.log_softmax(logits[len(prompt) - 1 :], dim=-1)


def test_log_probs_match_hf(ckpt, hf, async_scheduling):
    llm = _llm(ckpt, async_scheduling)
    params = [
        SamplingParams(top_k=1, num_tokens_to_generate=NEW, return_log_probs=True),
        SamplingParams(temperature=0.8, seed=5, num_tokens_to_generate=6, return_log_probs=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=9, num_tokens_to_generate=NEW, return_log_probs=True),
    ]
    outs = llm.generate(PROMPTS, params)
    for prompt, out, sp in zip(PROMPTS, outs, params):
        assert len(out.generated_log_probs) == len(out.generated_tokens) == sp.num_tokens_to_generate
        lp = _hf_log_probs(hf, prompt, out.generated_tokens)
        ref = lp.gather(-1, torch.tensor(out.generated_tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.generated_log_probs), ref, atol=1e-5, rtol=0)
        assert out.generated_top_n_logprobs is None
    # the greedy request's tokens are the argmax of the reference
    assert outs[0].generated_tokens == _hf_log_probs(hf, PROMPTS[0], outs[0].generated_tokens).argmax(-1).tolist()


def test_log_probs_of_early_stop_have_the_same_length(ckpt, greedy, async_scheduling):
    cont = greedy[0]
    i = _first_new(cont, 2)
    llm = _llm(ckpt, async_scheduling)
    out = llm.generate([PROMPTS[0]], SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=cont[i],
                                                    return_log_probs=True, top_n_logprobs=2))[0]
    assert len(out.generated_tokens) == len(out.generated_log_probs) == len(out.generated_top_n_logprobs) == i + 1


def test_top_n_logprobs(ckpt, hf, async_scheduling):
    llm = _llm(ckpt, async_scheduling)
    params = [
        SamplingParams(top_k=1, num_tokens_to_generate=5, top_n_logprobs=3),
        SamplingParams(temperature=1.0, seed=3, num_tokens_to_generate=4, top_n_logprobs=1, return_log_probs=True),
        SamplingParams(top_k=1, num_tokens_to_generate=3),
    ]
    outs = llm.generate(PROMPTS, params)
    for prompt, out, sp in zip(PROMPTS, outs, params):
        if sp.top_n_logprobs == 0:
            assert out.generated_top_n_logprobs is None and out.generated_log_probs is None
            continue
        assert len(out.generated_top_n_logprobs) == len(out.generated_tokens)
        assert all(len(d) == sp.top_n_logprobs for d in out.generated_top_n_logprobs)
        lp = _hf_log_probs(hf, prompt, out.generated_tokens)
        for step, d in enumerate(out.generated_top_n_logprobs):
            vals, ids = lp[step].topk(sp.top_n_logprobs)
            assert list(d) == ids.tolist()  # best first
            torch.testing.assert_close(torch.tensor(list(d.values())), vals, atol=1e-5, rtol=0)
    greedy_top = outs[0].generated_top_n_logprobs
    assert [next(iter(d)) for d in greedy_top] == outs[0].generated_tokens  # greedy = best entry
    assert outs[0].generated_log_probs is None  # not asked for
