"""A prompt hashed where it arrived (rank 0 of data-parallel ranks hashes it to route it and sends
the digests along: ``NewRequest.digests``) is not hashed again where it is served: prefix matching,
prompt sharing and the blocks it publishes read those digests, and the blocks it publishes are the
ones a prompt hashed locally finds. Digests of another key (the weights changed since) are not read."""
from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.contexts import kv_block_allocator as kv

PROMPT = list(range(10, 51))  # 41 tokens: 10 blocks of 4 a prefix hit may skip
G = SamplingParams(top_k=1, num_tokens_to_generate=3, ignore_eos=True)


@pytest.fixture
def hashes(monkeypatch) -> list[int]:
    """Counts the block digests computed (SHA-256 calls of the prefix cache)."""
    count, digest = [0], kv._digest

    def counted(message: bytes) -> bytes:
        count[0] += 1
        return digest(message)

    monkeypatch.setattr(kv, "_digest", counted)
    kv.root_digest.cache_clear()  # a key's root digest counts where it is first computed
    return count


def _llm() -> LLM:
    return LLM(inference_config=InferenceConfig(block_size_tokens=4, num_kv_blocks=64, max_requests=4, max_tokens=64,
                                                max_sequence_length=64, enable_prefix_caching=True))


def _serve(llm: LLM, digests: bytes) -> list[int]:
    """Admit PROMPT as a data-parallel rank admits what rank 0 routed to it."""
    eng = llm.engine
    eng._admit(replace(eng.admission.accept(PROMPT, G, None), digests=digests))
    return eng.run_until_done()[0].generated_tokens


def _digests(llm: LLM) -> bytes:
    return b"".join(kv.prefix_digests(PROMPT, 4, llm.engine.context.allocator.hash_key))


def test_a_prompt_hashed_where_it_arrived_is_not_hashed_again(hashes):
    plain = _llm()
    expected = _serve(plain, b"")
    # the key's root digest, then each of the 10 shareable blocks once: prompt sharing's key hashes
    # them, the prefix match and the published blocks read those digests
    assert hashes[0] == 11
    llm = _llm()
    digests = _digests(llm)
    hashes[0] = 0
    assert _serve(llm, digests) == expected
    assert hashes[0] == 1  # only the first block, to tell the digests are this cache's key's
    assert llm.generate([PROMPT], G)[0].generated_tokens == expected  # hashed here: finds what it published
    assert llm.engine.stats.prefix_hit_tokens == 40


def test_digests_of_other_weights_are_not_read(hashes):
    llm = _llm()
    digests = _digests(llm)
    llm.engine.context.weights_changed()  # a new key: blocks of the old weights are never hit again
    assert kv.known_digests(digests, PROMPT, 4, llm.engine.context.allocator.hash_key) is None
    hashes[0] = 0
    expected = _serve(llm, digests)
    assert hashes[0] == 11  # hashed here, under the new key (its root and each block once)
    assert llm.generate([PROMPT], G)[0].generated_tokens == expected and llm.engine.stats.prefix_hit_tokens == 40


def test_digests_that_do_not_fit_the_prompt_are_not_read():
    key = b"m"
    digests = b"".join(kv.prefix_digests(PROMPT, 4, key))
    assert kv.known_digests(digests, PROMPT, 4, key) == kv.prefix_digests(PROMPT, 4, key)
    for bad in (b"", digests[:-1], digests + digests[:32] * 2, digests[32:]):
        assert kv.known_digests(bad, PROMPT, 4, key) is None
