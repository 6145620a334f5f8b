"""A long prompt arriving while streams decode shares every step with them: each step of its
chunked prefill carries every decoding stream's row (one token per stream per step), and the
prefill takes only the tokens the decode rows leave of max_tokens."""
import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams

STREAMS, MAX_TOKENS = 8, 24
CFG = dict(block_size_tokens=4, num_kv_blocks=256, max_requests=STREAMS + 1, max_tokens=MAX_TOKENS,
           max_sequence_length=512)
LONG = [(7 * i) % 1000 + 3 for i in range(200)]
GREEDY = dict(top_k=1, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_every_mixed_step_carries_every_decode_row(async_scheduling):
    eng = LLM(inference_config=InferenceConfig(**CFG, async_scheduling=async_scheduling)).engine
    streams = [eng.add_request([5 + s, 6, 7], SamplingParams(num_tokens_to_generate=200, **GREEDY))
               for s in range(STREAMS)]
    for _ in range(4):  # every stream prefilled and decoding
        eng.step()
    long = eng.add_request(LONG, SamplingParams(num_tokens_to_generate=2, **GREEDY))
    prefill_steps, prefill_tokens = eng.stats.prefill_steps, eng.stats.prefill_tokens
    mixed_tokens, kv_read = eng.stats.mixed_step_tokens, eng.stats.mixed_kv_read_tokens
    mixed = 0
    while eng.stats.prefill_tokens - prefill_tokens < len(LONG):  # until its last chunk landed
        assert mixed < 100, "the long prompt's prefill made no progress"
        res = eng.step()
        got = [u.request_id for u in res.updates if u.request_id != long]
        assert sorted(got) == streams, "a step skipped a decoding stream"
        assert all(len(u.new_tokens) == 1 for u in res.updates if u.request_id != long)
        mixed += 1
    per_chunk = MAX_TOKENS - STREAMS
    assert eng.stats.prefill_tokens - prefill_tokens == len(LONG)
    # each chunk took what the decode rows left (async: the first step landed a decode step
    # launched ahead before the prompt came)
    assert eng.stats.prefill_steps - prefill_steps == -(-len(LONG) // per_chunk) == mixed - async_scheduling
    # the mixed steps' rows: the chunks and one token of every stream a step; each stream's row
    # reads its whole context (its 3-token prompt and more)
    steps = eng.stats.prefill_steps - prefill_steps
    assert eng.stats.mixed_step_tokens - mixed_tokens == len(LONG) + STREAMS * steps
    ends = list(range(per_chunk, len(LONG), per_chunk)) + [len(LONG)]
    assert eng.stats.mixed_kv_read_tokens - kv_read > sum(ends) + 4 * STREAMS * steps


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_a_request_sent_during_a_long_prefill_starts_at_once(async_scheduling):
    """A short request sent while a long prompt is prefilled in chunks is admitted at the next
    step and answers long before the prefill ends (the chunks leave it its 3 tokens); the long
    prompt keeps the rest of every step."""
    eng = LLM(inference_config=InferenceConfig(**{**CFG, "max_requests": 4}, async_scheduling=async_scheduling)).engine
    long = eng.add_request(LONG, SamplingParams(num_tokens_to_generate=2, **GREEDY))
    eng.step()
    eng.step()  # the long prompt's prefill is under way
    assert eng.context.active and eng.stats.prefill_tokens < len(LONG)
    short = eng.add_request([5, 6, 7], SamplingParams(num_tokens_to_generate=2, **GREEDY))
    done, steps, prefilled = {}, 0, eng.stats.prefill_tokens
    while eng.has_unfinished_requests():
        steps += 1
        done.update((o.request_id, steps) for o in eng.step().finished)
        assert steps < 100
    assert done[short] <= 4 < done[long]
    chunks = -(-(len(LONG) - prefilled + 3) // MAX_TOKENS)  # the fewest steps: every token of every step used
    assert done[long] <= chunks + 3


def test_mixed_steps_count_the_kv_their_rows_read_and_write():
    """``EngineStats.mixed_kv_read_tokens`` / ``mixed_step_tokens`` (a mixed step's floor counts
    them): a prompt prefilled alone in chunks of max_tokens reads, each step, its KV up to the
    chunk's end, and writes the chunk (decode rows beside a chunk:
    ``test_every_mixed_step_carries_every_decode_row``)."""
    eng = LLM(inference_config=InferenceConfig(**CFG, async_scheduling=False)).engine
    eng.add_request(LONG, SamplingParams(num_tokens_to_generate=2, **GREEDY))
    while eng.stats.prefill_tokens < len(LONG):
        eng.step()
    ends = list(range(MAX_TOKENS, len(LONG), MAX_TOKENS)) + [len(LONG)]  # 24, 48, ..., 192, 200
    assert eng.stats.prefill_steps == len(ends)
    assert eng.stats.mixed_step_tokens == len(LONG) and eng.stats.mixed_kv_read_tokens == sum(ends)
    for _ in range(3):  # decode-only steps count nothing here
        eng.step()
    assert eng.stats.mixed_step_tokens == len(LONG) and eng.stats.mixed_kv_read_tokens == sum(ends)
