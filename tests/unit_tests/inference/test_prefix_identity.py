"""Prefix-cache identity end to end: prompts whose block digests collide (a weak digest is
forced in) never share KV, and normal prefix hits still happen."""
import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.contexts import kv_block_allocator as kv

G = SamplingParams(top_k=1, num_tokens_to_generate=4)
A = list(range(10, 22))  # 3 blocks of 4
B = list(range(30, 42))


def _llm(caching: bool) -> LLM:
    return LLM(inference_config=InferenceConfig(block_size_tokens=4, num_kv_blocks=64, max_requests=4, max_tokens=64,
                                                max_sequence_length=64, enable_prefix_caching=caching))


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    llm = _llm(False)
    return {name: o.generated_tokens for name, o in zip("AB", llm.generate([A, B], G))}


@pytest.mark.parametrize("weak", [False, True], ids=["sha256", "colliding_digest"])
def test_prefix_hits_only_for_equal_tokens(monkeypatch, reference, weak):
    if weak:
        monkeypatch.setattr(kv, "_digest", lambda message: b"\0" * 32)  # every block collides
    llm = _llm(True)
    st = llm.engine.stats
    assert llm.generate([A], G)[0].generated_tokens == reference["A"]
    assert llm.generate([B], G)[0].generated_tokens == reference["B"]
    assert st.prefix_hit_tokens == 0  # B shares no KV with A, collision or not
    assert llm.generate([A], G)[0].generated_tokens == reference["A"]
    assert st.prefix_hit_tokens == 8  # A again: its first two blocks are reused
