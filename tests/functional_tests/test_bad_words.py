"""``bad_words`` of several tokens on the built-in tiny model (CPU): against a reference that
applies vLLM's rule on the host one token at a time (the last token of a word is banned right
after its other tokens were generated; the reference re-prompts with the tokens so far and bans
with a -100 logit bias), on random prompts and words taken from what the model says unbanned;
the words really appeared without the ban and never with it; launch-ahead == serial with the bans
beside other requests (both samplers apply them in the same function after their penalties:
``sampling.apply_bias_and_bans``); too many or too long words refused."""
import random

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.request import InvalidRequestError

CFG = dict(max_requests=6, max_tokens=128, max_sequence_length=256, num_kv_blocks=96)
N = 16


def make(backend="torch", async_scheduling=True) -> LLM:
    return LLM(None, inference_config=InferenceConfig(**CFG, sampling_backend=backend, async_scheduling=async_scheduling))


def params(seed: int | None, **kw) -> SamplingParams:
    if seed is None:
        return SamplingParams(temperature=0.0, num_tokens_to_generate=N, ignore_eos=True, **kw)
    return SamplingParams(temperature=0.9, top_k=50, seed=seed, num_tokens_to_generate=N, ignore_eos=True, **kw)


def spellings(tok, words: list[str]) -> list[list[int]]:
    """The token ids of each word with and without a leading space (as the engine bans them)."""
    out = []
    for w in words:
        for s in dict.fromkeys((w, " " + w.lstrip())):
            ids = tok.encode(s, add_special_tokens=False)
            if ids not in out:
                out.append(ids)
    return out


def banned_next(generated: list[int], seqs: list[list[int]]) -> set[int]:
    """vLLM's rule over the generated tokens."""
    return {s[-1] for s in seqs if len(s) - 1 <= len(generated) and generated[len(generated) - len(s) + 1:] == s[:-1]}


def reference(llm: LLM, prompt: list[int], seed: int | None, seqs: list[list[int]]) -> list[int]:
    """One token per request: the prompt and the tokens so far, the rule's bans as -100 biases
    (the draw is keyed by seed and position, so the token is the one the request would draw)."""
    gen = []
    for _ in range(N):
        bias = {t: -100.0 for t in banned_next(gen, seqs)} or None
        sp = params(seed, logit_bias=bias)
        sp.num_tokens_to_generate = 1
        gen += llm.generate([prompt + gen], sp)[0].generated_tokens
    return gen


def contains(tokens: list[int], seq: list[int]) -> bool:
    return any(tokens[i:i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


def random_case(llm: LLM, rng: random.Random, seed: int | None):
    """A random prompt and 2-3 words from its unbanned answer (several tokens each)."""
    tok = llm.tokenizer
    prompt = [rng.randrange(1, 900) for _ in range(rng.randint(3, 12))]
    plain = llm.generate([prompt], params(seed))[0].generated_tokens
    words = []
    for _ in range(rng.randint(2, 3)):
        i = rng.randrange(0, N - 3)
        text = tok.decode(plain[i:i + rng.randint(2, 3)])
        if len(tok.encode(text, add_special_tokens=False)) > 1 and text.strip():
            words.append(text)
    return prompt, plain, words


@pytest.mark.parametrize("seed", [None, 5])
def test_multi_token_words_equal_the_reference(seed):
    llm, rng = make(), random.Random(11 if seed is None else seed)
    checked = appeared = 0
    for _ in range(4):
        prompt, plain, words = random_case(llm, rng, seed)
        seqs = [s for s in spellings(llm.tokenizer, words) if len(s) > 1]
        if not seqs:
            continue
        got = llm.generate([prompt], params(seed, bad_words=words))[0].generated_tokens
        assert got == reference(llm, prompt, seed, seqs), (words, seqs)
        assert not any(contains(got, s) for s in seqs)
        appeared += any(contains(plain, s) for s in seqs)
        checked += 1
    assert checked >= 3 and appeared >= 2  # the bans really changed answers


def test_async_equals_serial():
    runs = []
    for mode in (True, False):
        llm, rng = make(async_scheduling=mode), random.Random(3)
        cases = [random_case(llm, rng, 40 + i) for i in range(5)]
        ps = [params(40 + i, bad_words=words or None, presence_penalty=0.2 * (i == 1)) for i, (_, _, words) in enumerate(cases)]
        ps.append(params(None))  # a request without bans beside them
        outs = llm.generate([c[0] for c in cases] + [cases[0][0]], ps)
        st = llm.engine.stats
        if mode:
            assert st.overlapped_decode_steps > 0.5 * st.decode_steps, st.as_dict()
        runs.append([o.generated_tokens for o in outs])
    assert runs[0] == runs[1]


def test_word_limits_are_refused():
    eng = make().engine
    tok = make().tokenizer
    long = "".join(chr(0x4E00 + i) for i in range(12))  # many tokens
    assert len(tok.encode(long, add_special_tokens=False)) > 8
    with pytest.raises(InvalidRequestError, match="1 to 8"):
        eng.add_request("x", params(None, bad_words=[long]))
    many = [f"{w} {w}" for w in ("river", "stone", "cloud", "field", "house", "night", "green", "water", "light")]
    with pytest.raises(InvalidRequestError, match="at most 16"):
        eng.add_request("x", params(None, bad_words=many))
