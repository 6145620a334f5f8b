"""Requests that can never be served are rejected at add_request with a clear message;
LLM.generate reports them as finish_reason "error" and still serves the other prompts."""
import os
import re

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from megatron_async import LLM, InferenceConfig, InvalidRequestError, SamplingParams  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402

VOCAB = 256  # the tiny HF checkpoint (it has no tokenizer)
GOOD = [[5, 6, 7], [8, 9, 10, 11, 12]]
NEW = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("llama_no_tok"))


def _llm(ckpt, **overrides) -> LLM:
    # block 4 x 8 usable blocks = 32 tokens of KV; max_tokens 16
    cfg = dict(block_size_tokens=4, num_kv_blocks=9, max_requests=4, max_tokens=16, max_sequence_length=64)
    cfg.update(overrides)
    return LLM(model=None if ckpt is None else str(ckpt), inference_config=InferenceConfig(**cfg))


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    llm = _llm(ckpt)
    assert llm.tokenizer is None
    return llm


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    outs = llm.generate(GOOD, SamplingParams(top_k=1, num_tokens_to_generate=NEW))
    return [o.generated_tokens for o in outs]


G = dict(top_k=1, num_tokens_to_generate=NEW)
CASES = {
    "empty prompt": ([], SamplingParams(**G), "empty prompt"),
    "token above vocab": ([1, 2, VOCAB], SamplingParams(**G), r"outside the vocab \[0, 256\).*256"),
    "negative token": ([-3, 4], SamplingParams(**G), r"outside the vocab.*-3"),
    "not token ids": ([1, "x"], SamplingParams(**G), "token ids must be integers"),
    "float token ids": ([1, 2.5], SamplingParams(**G), "token ids must be integers"),
    "bool token ids": ([1, True], SamplingParams(**G), "token ids must be integers"),
    "float numpy prompt": (np.array([1.0, 2.0]), SamplingParams(**G), "token ids must be integers"),
    "numpy prompt above vocab": (np.array([1, VOCAB], dtype=np.int32), SamplingParams(**G), "outside the vocab"),
    "too long for max_sequence_length": (
        [1] * 10, SamplingParams(top_k=1, num_tokens_to_generate=55), r"= 65 exceeds max_sequence_length 64"),
    "never fits the KV pool": (
        [1] * 20, SamplingParams(top_k=1, num_tokens_to_generate=20), r"needs 10 KV blocks.*only 8"),
    "negative temperature": ([1, 2], SamplingParams(temperature=-0.5), "temperature must be >= 0"),
    "nan temperature": ([1, 2], SamplingParams(temperature=float("nan")), "temperature must be a finite number"),
    "inf temperature": ([1, 2], SamplingParams(temperature=float("inf")), "temperature must be a finite number"),
    "string temperature": ([1, 2], SamplingParams(temperature="0.5"), "temperature must be a finite number"),
    "None temperature": ([1, 2], SamplingParams(temperature=None), "temperature must be a finite number"),
    "bool temperature": ([1, 2], SamplingParams(temperature=True), "temperature must be a finite number"),
    "None top_k": ([1, 2], SamplingParams(top_k=None), "top_k must be an integer"),
    "bool top_k": ([1, 2], SamplingParams(top_k=True), "top_k must be an integer"),
    "float top_k": ([1, 2], SamplingParams(top_k=1.0), "top_k must be an integer"),
    "inf top_p": ([1, 2], SamplingParams(top_p=float("inf")), "top_p must be a finite number"),
    "None num_tokens_to_generate": (
        [1, 2], SamplingParams(num_tokens_to_generate=None), "num_tokens_to_generate must be an integer"),
    "float num_tokens_to_generate": (
        [1, 2], SamplingParams(num_tokens_to_generate=2.5), "num_tokens_to_generate must be an integer"),
    "float seed": ([1, 2], SamplingParams(seed=1.5, **G), "seed must be an integer or None"),
    "float termination_id": ([1, 2], SamplingParams(termination_id=2.5, **G), "termination_id must be an integer"),
    "string ignore_eos": ([1, 2], SamplingParams(ignore_eos="yes", **G), "ignore_eos must be a bool"),
    "int return_log_probs": ([1, 2], SamplingParams(return_log_probs=1, **G), "return_log_probs must be a bool"),
    "int stop word": ([1, 2], SamplingParams(stop_words=[5], **G), "stop_words must be"),
    "stop word ids outside vocab": ([1, 2], SamplingParams(stop_words=[[3, VOCAB]], **G), "outside the vocab"),
    "float in stop word ids": ([1, 2], SamplingParams(stop_words=[[3, 1.5]], **G), "stop_words must be"),
    "None prompt": (None, SamplingParams(**G), "prompt must be a string or a list of token ids, got NoneType"),
    "int prompt": (7, SamplingParams(**G), "prompt must be a string or a list of token ids, got int"),
    "nested prompt": ([[1, 2]], SamplingParams(**G), "token ids must be integers"),
    "bool token ids": ([True, 2], SamplingParams(**G), "token ids must be integers"),
    "top_p above 1": ([1, 2], SamplingParams(top_p=1.5), r"top_p must be in \[0, 1\]"),
    "top_p below 0": ([1, 2], SamplingParams(top_p=-0.1), r"top_p must be in \[0, 1\]"),
    "negative top_k": ([1, 2], SamplingParams(top_k=-1), "top_k must be >= 0"),
    "zero tokens to generate": (
        [1, 2], SamplingParams(num_tokens_to_generate=0), "num_tokens_to_generate must be >= 1"),
    "top_n_logprobs above vocab": ([1, 2], SamplingParams(top_n_logprobs=VOCAB + 1), "top_n_logprobs"),
    "termination id outside vocab": ([1, 2], SamplingParams(termination_id=VOCAB), "termination_id"),
    "text prompt without tokenizer": ("hello", SamplingParams(**G), "needs a tokenizer"),
    "text stop word without tokenizer": ([1, 2], SamplingParams(stop_words=["ab"], **G), "need a tokenizer"),
    "empty stop word": ([1, 2], SamplingParams(stop_words=[[3], []], **G), "stop word .* is empty"),
    "params of the wrong type": ([1, 2], dict(top_k=1), "must be SamplingParams"),
    "seed above int64": ([1, 2], SamplingParams(seed=2**63), r"seed must be in \[0, 2\*\*63\)"),
    "negative seed": ([1, 2], SamplingParams(seed=-1), r"seed must be in \[0, 2\*\*63\)"),
}


def test_empty_text_stop_word_rejected_with_tokenizer():
    llm = _llm(None)  # the built-in tiny model comes with the tiny BPE tokenizer
    assert llm.tokenizer is not None
    with pytest.raises(InvalidRequestError, match="stop word '' is empty"):
        llm.engine.add_request("hello", SamplingParams(stop_words=["the", ""]))
    assert llm.engine.stats.rejected_requests == 1 and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("case", list(CASES))
def test_add_request_rejects_with_clear_message(llm, case):
    prompt, params, message = CASES[case]
    eng = llm.engine
    before = eng.stats.rejected_requests
    with pytest.raises(InvalidRequestError, match=message):
        eng.add_request(prompt, params)
    assert eng.stats.rejected_requests == before + 1
    assert not eng.has_unfinished_requests() and not eng.scheduler.waiting  # nothing was queued


@pytest.mark.parametrize("case", list(CASES))
def test_generate_reports_the_error_and_serves_the_others(llm, reference, case):
    prompt, params, message = CASES[case]
    good = SamplingParams(**G)
    before = llm.engine.stats.rejected_requests
    outs = llm.generate([GOOD[0], prompt, GOOD[1]], [good, params, good])
    bad = outs[1]
    assert bad.finish_reason == "error" and bad.generated_tokens == []
    assert bad.error is not None and re.search(message, bad.error), bad.error
    assert [outs[0].generated_tokens, outs[2].generated_tokens] == reference
    assert outs[0].finish_reason == outs[2].finish_reason == "length"
    assert llm.engine.stats.rejected_requests == before + 1


def test_prompt_over_max_tokens_rejected_only_without_chunked_prefill(ckpt):
    prompt = list(range(1, 21))  # 20 tokens > max_tokens 16
    off = _llm(ckpt, enable_chunked_prefill=False)
    with pytest.raises(InvalidRequestError, match="exceeds max_tokens 16 with chunked prefill off"):
        off.engine.add_request(prompt, SamplingParams(**G))
    outs = off.generate([prompt, GOOD[0]], SamplingParams(**G))
    assert outs[0].finish_reason == "error" and len(outs[1].generated_tokens) == NEW
    assert off.engine.stats.rejected_requests == 2
    on = _llm(ckpt)
    assert len(on.generate([prompt], SamplingParams(**G))[0].generated_tokens) == NEW


def test_limits_are_inclusive(llm, ckpt):
    # exactly max_sequence_length, and exactly the whole KV pool, are accepted
    fits_pool = llm.generate([[1] * 28], SamplingParams(top_k=1, num_tokens_to_generate=4))[0]
    assert fits_pool.finish_reason == "length" and len(fits_pool.generated_tokens) == 4
    big = _llm(ckpt, num_kv_blocks=40)
    at_limit = big.generate([[1] * 60], SamplingParams(top_k=1, num_tokens_to_generate=4))[0]
    assert at_limit.finish_reason == "length" and len(at_limit.generated_tokens) == 4


def test_token_id_containers_serve_alike(llm, reference):
    # list of ints (the fast path), numpy int arrays, numpy scalars and tuples: the same tokens
    for prompt, want in zip(GOOD, reference):
        for variant in (np.array(prompt, dtype=np.int32), [np.int64(t) for t in prompt], tuple(prompt)):
            out = llm.generate([variant], SamplingParams(**G))[0]
            assert out.finish_reason == "length" and out.generated_tokens == want


def test_duplicate_request_id_rejected(llm):
    eng = llm.engine
    rid = eng.add_request([1, 2], SamplingParams(**G), request_id=1000)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([3, 4], SamplingParams(**G), request_id=1000)
    outs = eng.run_until_done()
    assert [o.request_id for o in outs] == [rid]


def test_seed_outside_int64_rejected(ckpt):
    llm = _llm(ckpt)
    bad_seed = SamplingParams(seed=2**63, num_tokens_to_generate=NEW)
    outs = llm.generate([GOOD[0], [1, 2]], [SamplingParams(**G), bad_seed])
    assert outs[1].finish_reason == "error" and "seed" in outs[1].error
    assert len(outs[0].generated_tokens) == NEW
