"""min_tokens, min_p and the penalties: bad values are rejected at add_request with an
InvalidRequestError that names the field (nothing queued), and the engine serves on."""
import math

import pytest

from megatron_async import LLM, InferenceConfig, InvalidRequestError, SamplingParams
from megatron_async.inference.engines.request_validation import check_sampling_extensions

BAD = [
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, num_tokens_to_generate=4), "min_tokens"),
    (dict(min_tokens=2.0), "min_tokens must be an int"),
    (dict(min_tokens=True), "min_tokens must be an int"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=math.nan), "min_p must be finite"),
    (dict(min_p="0.1"), "min_p must be a number"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=-math.inf), "presence_penalty must be finite"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(frequency_penalty=None), "frequency_penalty must be a number"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=math.inf), "repetition_penalty must be finite"),
    (dict(repetition_penalty=False), "repetition_penalty must be a number"),
]


@pytest.mark.parametrize("fields,message", BAD)
def test_bad_values_are_rejected_with_the_field_named(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        check_sampling_extensions(SamplingParams(**fields))


def test_good_values_pass():
    for fields in (dict(min_tokens=4, num_tokens_to_generate=4), dict(min_p=1.0), dict(presence_penalty=-2.0),
                   dict(frequency_penalty=2), dict(repetition_penalty=0.01), dict(repetition_penalty=100)):
        check_sampling_extensions(SamplingParams(**fields))
    assert not SamplingParams().has_penalties and SamplingParams(min_tokens=1).has_penalties


def test_engine_rejects_and_keeps_serving():
    llm = LLM(model=None, inference_config=InferenceConfig(block_size_tokens=4, num_kv_blocks=32, max_requests=4,
                                                            max_tokens=16, max_sequence_length=64))
    eng = llm.engine
    ok = eng.add_request([5, 6, 7], SamplingParams(top_k=1, num_tokens_to_generate=4, presence_penalty=1.0))
    with pytest.raises(InvalidRequestError, match="repetition_penalty"):
        eng.add_request([5, 6, 7], SamplingParams(repetition_penalty=0.0))
    outs = eng.run_until_done()
    assert [o.request_id for o in outs] == [ok] and len(outs[0].generated_tokens) == 4
    assert eng.stats.rejected_requests == 1
