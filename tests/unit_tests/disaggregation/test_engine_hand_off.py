"""The engine entry points of the hand-off in one process, without a coordinator or a transfer
connection (disaggregation/kv_import.py, kv_layout.py): a prefill engine capped at the first
token keeps the request's blocks (and Mamba state) past its end, a decode engine admits it
decoding with those bytes in blocks of its own, and the tokens equal one engine's that did both
(dense and hybrid, greedy and seeded, penalties, serial and launch-ahead); the decode engine
computes no prompt; every block comes back on both engines."""
from __future__ import annotations

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.disaggregation.kv_import import PrefillHold, admit_decoding, allocate
from megatron_async.disaggregation.kv_layout import KVLayout

PROMPTS = [[(7 * i + 3 * j) % 120 + 1 for j in range(5 + 3 * i)] for i in range(5)]
PARAMS = {
    "greedy": SamplingParams(top_k=1, num_tokens_to_generate=10, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.95, seed=11, num_tokens_to_generate=10, ignore_eos=True),
    "penalties": SamplingParams(temperature=0.7, seed=3, presence_penalty=0.5, frequency_penalty=0.3,
                                num_tokens_to_generate=10, ignore_eos=True),
}


def dense(**cfg):
    base = dict(block_size_tokens=4, num_kv_blocks=128, max_requests=8, max_tokens=64)
    return LLM(None, "cpu", "float32", InferenceConfig(**{**base, **cfg}))


def run_until(engine, local: int):
    while True:
        for out in engine.step().finished:
            if out.request_id == local:
                return out


def hand_over(prefill: LLM, decode: LLM, prompts, params: SamplingParams) -> list:
    """Each prompt computed on ``prefill`` to its first token, finished on ``decode``: the outputs."""
    hold = PrefillHold(prefill.engine)
    layout = KVLayout(decode.engine.context)
    outs = []
    for prompt in prompts:
        local = hold.submit(lambda: prefill.engine.add_request(prompt, params))
        assert local in hold.capped
        first = run_until(prefill.engine, local)
        assert first.finish_reason == "length" and len(first.generated_tokens) == 1
        assert hold.handed(local, first.finish_reason, 1)
        n = hold.num_blocks(local)
        assert n == -(-len(prompt) // prefill.context.block_size)
        buf = hold.pack(local)
        blocks = allocate(decode.engine, n)
        rid = admit_decoding(decode.engine, prompt, params, b"", first.generated_tokens, None, 0, blocks,
                             lambda slot: layout.unpack(buf, blocks, slot))
        assert hold.release(local) == n
        outs.append(run_until(decode.engine, rid))
    return outs


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("launch_ahead", [False, True], ids=["serial", "launch-ahead"])
def test_dense_tokens_equal_one_engine(name, launch_ahead):
    params = PARAMS[name]
    want = dense().generate(PROMPTS, params)
    prefill, decode = dense(), dense()
    for llm in (prefill, decode):
        llm.engine.async_scheduling = launch_ahead
    got = hand_over(prefill, decode, PROMPTS, params)
    assert [o.generated_tokens for o in got] == [o.generated_tokens for o in want]
    assert [o.generated_text for o in got] == [o.generated_text for o in want]  # (the first token's text too)
    assert decode.engine.stats.prefill_steps == 0 and decode.engine.stats.decode_steps > 0
    for llm in (prefill, decode):
        alloc = llm.context.allocator
        assert alloc.num_available == alloc.capacity and not llm.engine.has_unfinished_requests()


def test_a_request_that_ends_at_its_first_token_frees_its_blocks_on_the_prefill_engine():
    prefill = dense()
    hold = PrefillHold(prefill.engine)
    local = hold.submit(lambda: prefill.engine.add_request([5, 6, 7, 8], SamplingParams(top_k=1, num_tokens_to_generate=1)))
    assert local not in hold.capped  # one token: nothing to hand off
    local = hold.submit(lambda: prefill.engine.add_request([5, 6, 7, 8, 9], SamplingParams(top_k=1, num_tokens_to_generate=5)))
    assert local in hold.capped
    prefill.engine.abort_request(local)
    out = run_until(prefill.engine, local)
    assert not hold.handed(local, out.finish_reason, len(out.generated_tokens))
    prefill.engine.run_until_done()
    alloc = prefill.context.allocator
    assert alloc.num_available == alloc.capacity and not hold.kept


def test_hybrid_tokens_equal_one_engine(tmp_path):
    from tests.helpers.engine_harness import make_llm
    from tests.helpers.hf_hybrid_models import HYBRID_ARCHS, make_tiny_hybrid_checkpoint

    path = make_tiny_hybrid_checkpoint(HYBRID_ARCHS[0], tmp_path / "hybrid")
    params = PARAMS["seeded"]
    want = [o.generated_tokens for o in make_llm(path, max_requests=4).generate(PROMPTS, params)]
    prefill, decode = make_llm(path, max_requests=4), make_llm(path, max_requests=4)
    assert decode.context.mamba is not None and KVLayout(decode.context).states
    assert [o.generated_tokens for o in hand_over(prefill, decode, PROMPTS, params)] == want
    assert decode.engine.stats.prefill_steps == 0
