"""Why a request stops after its newest token: host-side, on bookkept tokens only, so a
launch-ahead row of a request that stopped here is discarded by reconcile like any finish."""
from __future__ import annotations

from megatron_async.inference.request import DynamicInferenceRequest, FinishReason, SamplingParams


def generation_limit(sp: SamplingParams, prompt_len: int, max_sequence_length: int) -> int:
    """The length limit: the most tokens a request may generate (its own cap, and the
    sequence length). Fixed at admission (``DynamicInferenceRequest.max_generated_tokens``);
    the scheduler and the stop check compare against it."""
    return min(sp.num_tokens_to_generate, max_sequence_length - prompt_len)


def finish_reason(req: DynamicInferenceRequest) -> FinishReason | None:
    """Check the request's newest generated token (already appended) and feed its text.

    EOS stops before its text is decoded, so the EOS text is never in the output. Before
    ``min_tokens`` tokens exist no EOS / stop check applies (vLLM's rule)."""
    sp = req.sampling_params
    gen = req.generated_tokens
    last = gen[-1]
    stops_armed = len(gen) >= sp.min_tokens
    if stops_armed and not sp.ignore_eos and last in req.eos_ids:
        if req.text is not None:
            req.text.end_before_last()
        return FinishReason.STOP
    text = req.text
    if text is not None and text.needs_tokens and text.append(last, check_stops=stops_armed):
        return FinishReason.STOP  # a stop string completed in the decoded text
    for seq in req.stop_sequences if stops_armed else ():
        if len(gen) >= len(seq) and gen[-len(seq):] == seq:
            return FinishReason.STOP
    if len(gen) >= req.max_generated_tokens:
        return FinishReason.LENGTH
    return None


def plain_stop_ids(req: DynamicInferenceRequest) -> frozenset[int] | None:
    """Where ``finish_reason`` reduces to "the newest token is one of these ids: STOP (the text
    ends before it), else LENGTH at the limit": no stop sequences, no text fed token by token, no
    ``min_tokens``. The ids (none with ``ignore_eos``), or None where it does not; ``RequestBook``
    keeps them on the request and checks them inline while landing."""
    sp, text = req.sampling_params, req.text
    if req.stop_sequences or sp.min_tokens or (text is not None and text.needs_tokens):
        return None
    return frozenset() if sp.ignore_eos else frozenset(req.eos_ids)
