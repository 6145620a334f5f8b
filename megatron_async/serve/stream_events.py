"""A stream's engine events merged: what several steps gave one response, as if one step had
made it (responder.py writes one chunk per choice for everything that waited)."""
from __future__ import annotations

from megatron_async.inference.request import RequestOutput, RequestUpdate
from megatron_async.serve.submission import ChoiceEvent


def merge_updates(a: RequestUpdate, b: RequestUpdate) -> RequestUpdate:
    """One update holding ``a`` then ``b`` (two steps of one request), as if one step made both."""
    text = None if a.new_text is None and b.new_text is None else (a.new_text or "") + (b.new_text or "")
    lps = None if a.new_log_probs is None else a.new_log_probs + (b.new_log_probs or ())
    tops = None if a.new_top_n_logprobs is None else a.new_top_n_logprobs + (b.new_top_n_logprobs or ())
    prompt = a if a.prompt_log_probs is not None else b
    return RequestUpdate(a.request_id, a.new_tokens + b.new_tokens, text, b.finished, b.finish_reason, lps, tops,
                         prompt.prompt_log_probs, prompt.prompt_top_n_logprobs)


def merge_events(events: list[ChoiceEvent]) -> tuple[str | None, dict[int, RequestUpdate], dict[int, RequestOutput]]:
    """A stream's waiting events, in order, as (the first error, if any; each choice's updates
    merged into one; each choice's final output). Events after an error are dropped: the stream
    ends there."""
    updates: dict[int, RequestUpdate] = {}
    outputs: dict[int, RequestOutput] = {}
    for ev in events:
        out = ev.output
        if ev.error is not None:
            return ev.error, updates, outputs
        if out is not None and out.finish_reason == "error":
            return out.error or "request failed", updates, outputs
        if ev.update is not None:
            prev = updates.get(ev.index)
            updates[ev.index] = ev.update if prev is None else merge_updates(prev, ev.update)
        if out is not None:
            outputs[ev.index] = out
    return None, updates, outputs
