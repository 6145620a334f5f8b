"""logit_bias, allowed_token_ids and bad_words on the built-in tiny model (CPU): +100 forces a
chosen token at every step, -100 bans the greedy token, allowed_token_ids keeps every token in the
set, bad_words never appear; the torch and Triton (interpreted) samplers give the same tokens;
async == serial; bad values refused at add_request."""
import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.request import InvalidRequestError

CFG = dict(max_requests=4, max_tokens=64, max_sequence_length=256, num_kv_blocks=64)


def make(backend="torch", async_scheduling=True) -> LLM:
    return LLM(None, inference_config=InferenceConfig(**CFG, sampling_backend=backend, async_scheduling=async_scheduling))


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True, **kw)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bias_forces_and_bans(backend):
    llm = make(backend)
    prompt = llm.tokenizer.encode("the river flows to")
    plain = llm.generate([prompt], greedy())[0].generated_tokens
    forced = llm.generate([prompt], greedy(logit_bias={7: 100.0}))[0].generated_tokens
    assert forced == [7] * 12 and plain != forced
    banned = llm.generate([prompt], greedy(logit_bias={plain[0]: -100.0}))[0].generated_tokens
    assert banned[0] != plain[0]
    allowed = [5, 9, 300, 301, 302]
    outs = llm.generate([prompt] * 2, [greedy(allowed_token_ids=allowed),
                                        SamplingParams(temperature=1.0, seed=4, num_tokens_to_generate=30,
                                                       ignore_eos=True, allowed_token_ids=allowed)])
    assert all(t in allowed for o in outs for t in o.generated_tokens)
    word = llm.tokenizer.decode([plain[0]]).strip()
    words = llm.generate([prompt], greedy(bad_words=[word]))[0]
    bad = {llm.tokenizer.encode(w, add_special_tokens=False)[0] for w in (word, " " + word)}
    assert not bad & set(words.generated_tokens)


def test_backends_and_modes_agree():
    runs = []
    for backend, mode in (("torch", True), ("triton", True), ("torch", False)):
        llm = make(backend, mode)
        prompts = [llm.tokenizer.encode(f"story {i}") for i in range(4)]
        params = [SamplingParams(temperature=0.9, seed=i, num_tokens_to_generate=10, ignore_eos=True,
                                 logit_bias={11: 3.5, 40: -2.0, 7 + i: 1.25}, allowed_token_ids=None if i % 2 else
                                 list(range(0, 1000, 3)), presence_penalty=0.3 if i == 3 else 0.0) for i in range(4)]
        runs.append([o.generated_tokens for o in llm.generate(prompts, params)])
    assert runs[0] == runs[1] == runs[2]


def test_bad_values_are_refused():
    eng = make().engine
    for sp, needle in [(greedy(logit_bias={5: 101.0}), "in \\[-100, 100\\]"), (greedy(logit_bias={10**6: 1.0}), "vocab"),
                       (greedy(logit_bias={i: 1.0 for i in range(301)}), "at most 300"),
                       (greedy(allowed_token_ids=[]), "empty"), (greedy(allowed_token_ids=[-1]), "vocab"),
                       (greedy(bad_words=["".join(chr(0x4E00 + i) for i in range(12))]), "1 to 8")]:
        with pytest.raises(InvalidRequestError, match=needle):
            eng.add_request("x", sp)
