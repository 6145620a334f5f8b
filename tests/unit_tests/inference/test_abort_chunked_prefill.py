"""An abort during a chunked prefill stops its chunks: after ``abort_request`` the engine
computes no further chunk of that prompt (async: at most the one already launched ahead lands),
and it is free within two steps. Counted with EngineStats.prefill_tokens, alone and next to a
decoding stream."""
import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams

CHUNK = 16  # max_tokens: a 160-token prompt takes ten chunks
CFG = dict(block_size_tokens=4, num_kv_blocks=128, max_requests=4, max_tokens=CHUNK, max_sequence_length=256)
LONG = [(7 * i) % 1000 + 3 for i in range(160)]
GREEDY = dict(top_k=1, ignore_eos=True)


@pytest.mark.parametrize("with_stream", [False, True], ids=["alone", "with_stream"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_abort_mid_prefill_schedules_no_further_chunk(async_scheduling, with_stream):
    eng = LLM(inference_config=InferenceConfig(**CFG, async_scheduling=async_scheduling)).engine
    stream = None
    if with_stream:
        stream = eng.add_request([11, 12, 13], SamplingParams(num_tokens_to_generate=40, **GREEDY))
        for _ in range(3):
            eng.step()
    victim = eng.add_request(LONG, SamplingParams(num_tokens_to_generate=4, **GREEDY))
    for _ in range(3):
        eng.step()
    req = eng._requests[victim]
    assert 0 < req.num_computed_tokens < len(LONG) - 2 * CHUNK  # mid-prefill, chunks left to do
    launched_ahead = eng._pending is not None and victim in eng._pending.request_ids
    assert launched_ahead == async_scheduling  # async: its next chunk is already on the device

    before = eng.stats.prefill_tokens
    assert eng.abort_request(victim)
    steps, reasons = 0, {}
    while victim not in reasons or (not with_stream and eng.has_unfinished_requests()):
        res = eng.step()
        steps += 1
        reasons.update((o.request_id, o.finish_reason) for o in res.finished)
    assert reasons[victim] == "abort"
    after = eng.stats.prefill_tokens - before
    assert after == (CHUNK - 1 if with_stream else CHUNK) * async_scheduling  # only the chunk launched ahead
    assert steps <= 2 if not with_stream else steps == 1  # the abort lands in the next step's outputs
    if with_stream:  # the stream goes on, and no prefill runs with it any more
        while eng.has_unfinished_requests():
            reasons.update((o.request_id, o.finish_reason) for o in eng.step().finished)
        assert reasons[stream] == "length" and eng.stats.prefill_tokens - before == after
    alloc = eng.context.allocator
    assert alloc.num_available == alloc.capacity and eng.stats.aborted_requests == 1
