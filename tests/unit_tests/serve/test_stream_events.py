"""A stream's waiting events become one update per choice: merged updates hold exactly the
tokens, text and log-probs of the steps they replace, in order; an error ends the stream."""
import random

from megatron_async.inference.request import RequestOutput, RequestUpdate
from megatron_async.serve.responses import merge_events, merge_updates
from megatron_async.serve.submission import ChoiceEvent


def random_updates(rng: random.Random, steps: int, log_probs: bool) -> list[RequestUpdate]:
    ups = []
    for k in range(steps):
        toks = tuple(rng.randrange(1000) for _ in range(rng.randrange(0, 3)))  # 0 (held back), 1, or drafts
        lps = tuple(-rng.random() for _ in toks) if log_probs else None
        tops = tuple({t: -rng.random()} for t in toks) if log_probs else None
        last = k == steps - 1
        ups.append(RequestUpdate(7, toks, "".join(f"<{t}>" for t in toks), last, "length" if last else None, lps, tops))
    return ups


def test_merged_updates_equal_their_concatenation():
    rng = random.Random(0)
    for trial in range(50):
        ups = random_updates(rng, rng.randrange(1, 6), log_probs=trial % 2 == 0)
        merged = ups[0]
        for u in ups[1:]:
            merged = merge_updates(merged, u)
        assert merged.new_tokens == sum((u.new_tokens for u in ups), ())
        assert merged.new_text == "".join(u.new_text for u in ups)
        assert (merged.finished, merged.finish_reason) == (True, "length")
        if trial % 2 == 0:
            assert merged.new_log_probs == sum((u.new_log_probs for u in ups), ())
            assert merged.new_top_n_logprobs == sum((u.new_top_n_logprobs for u in ups), ())
        else:
            assert merged.new_log_probs is None and merged.new_top_n_logprobs is None


def test_merged_updates_keep_the_prompt_log_probs_of_whichever_carried_them():
    prompt = ((-0.5, -1.5), ({3: -0.5}, {4: -1.5}))
    first = RequestUpdate(7, (1,), "a", False, None, (-0.1,), None, *prompt)
    later = RequestUpdate(7, (2,), "b", True, "length", (-0.2,), None)
    for a, b in ((first, later), (RequestUpdate(7, (), "", False, None, (), None), first)):
        merged = merge_updates(a, b)
        assert (merged.prompt_log_probs, merged.prompt_top_n_logprobs) == prompt
    assert merge_updates(later, later).prompt_log_probs is None


def test_merge_events_groups_by_choice_and_stops_at_an_error():
    a = [RequestUpdate(1, (i,), f"a{i}", False, None) for i in range(3)]
    b = [RequestUpdate(2, (10 + i,), None, False, None) for i in range(2)]
    out = RequestOutput(1, [0], [0, 1, 2], "a0a1a2", "length")
    events = [ChoiceEvent(0, a[0]), ChoiceEvent(1, b[0]), ChoiceEvent(0, a[1]), ChoiceEvent(1, b[1]),
              ChoiceEvent(0, a[2]), ChoiceEvent(0, output=out)]
    error, updates, outputs = merge_events(events)
    assert error is None and list(updates) == [0, 1] and outputs == {0: out}
    assert updates[0].new_tokens == (0, 1, 2) and updates[0].new_text == "a0a1a2"
    assert updates[1].new_tokens == (10, 11) and updates[1].new_text is None
    failed = RequestOutput(2, [0], [], None, "error", error="boom")
    error, updates, outputs = merge_events([ChoiceEvent(0, a[0]), ChoiceEvent(1, output=failed), ChoiceEvent(0, a[1])])
    assert error == "boom" and updates[0].new_tokens == (0,) and not outputs
    error, _, _ = merge_events([ChoiceEvent(0, error="step failed"), ChoiceEvent(0, a[0])])
    assert error == "step failed"
