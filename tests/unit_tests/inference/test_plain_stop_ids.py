"""``stop_conditions.plain_stop_ids``: the requests whose stop check the landing loop makes
inline (RequestBook._land_plain), and the ids it checks."""
from itertools import product

from megatron_async import SamplingParams
from megatron_async.inference.request import DynamicInferenceRequest, FinishReason
from megatron_async.inference.stop_conditions import finish_reason, plain_stop_ids
from megatron_async.inference.text_stream import TextStream


def test_plain_stop_ids_are_what_finish_reason_checks():
    """Where ``plain_stop_ids`` gives ids, ``finish_reason`` is "one of them: STOP, else LENGTH at the
    limit" for every newest token and length (what the landing loop checks inline); anything it
    cannot say that for (stop sequences, min_tokens, stop strings fed token by token) gets None."""

    class Ids:  # a tokenizer stand-in: one character per id
        def decode(self, ids, **_):
            return "".join(chr(97 + i % 26) for i in ids)

    plain = 0
    for ignore_eos, min_tokens, stops, strings in product([False, True], [0, 3], [[], [[4, 5]]], [False, True]):
        sp = SamplingParams(ignore_eos=ignore_eos, min_tokens=min_tokens, num_tokens_to_generate=6)
        for last, length in product([2, 4, 5, 9], [1, 3, 6]):
            text = TextStream(Ids(), [1], ["fg"] if strings else [], False, False)
            req = DynamicInferenceRequest(1, [1], sp, 0, eos_ids=frozenset({2, 9}), stop_sequences=stops, text=text)
            req.max_generated_tokens = 6
            ids = plain_stop_ids(req)
            if stops or min_tokens or strings:
                assert ids is None
                continue
            req.generated_tokens[:] = [4] * (length - 1) + [last]
            want = FinishReason.STOP if last in ids else FinishReason.LENGTH if length >= 6 else None
            assert finish_reason(req) == want, (ignore_eos, last, length)
            plain += 1
    assert plain == 2 * 12
