"""``best_of`` (completions): ``best_of`` samples of each prompt are generated (they prefill the
prompt once: ``InferenceConfig.share_prompt_prefill``) and the ``n`` with the highest cumulative
log-probability of their generated tokens are returned, best first, as OpenAI and vLLM do. Usage
counts every generated token. It cannot be streamed (which samples win is known only at the end)."""
from __future__ import annotations

import dataclasses

from megatron_async.inference.request import RequestOutput
from megatron_async.serve.openai_protocol import BadRequest, CompletionRequest


def samples_per_prompt(req: CompletionRequest) -> int:
    """How many samples each prompt gets; BadRequest for a ``best_of`` that cannot be served."""
    if req.best_of is None or req.best_of == req.n:
        return req.n
    if req.best_of < req.n:
        raise BadRequest(f"best_of ({req.best_of}) must be at least n ({req.n})", "best_of")
    if req.stream:
        raise BadRequest("best_of larger than n cannot be streamed", "best_of")
    return req.best_of


def engine_logprobs(req: CompletionRequest, per_prompt: int) -> int | None:
    """The ``logprobs`` the samples are generated with: ranking needs each token's log-prob."""
    return req.logprobs if per_prompt == req.n or req.logprobs is not None else 0


def cumulative_log_prob(out: RequestOutput) -> float:
    return sum(out.generated_log_probs or ())


def select(req: CompletionRequest, outs: list[RequestOutput], per_prompt: int) -> list[RequestOutput]:
    """Of each prompt's ``per_prompt`` outputs (consecutive), its ``n`` best (stable on ties:
    the earlier sample first); log-probs dropped unless the request asked for them."""
    if per_prompt == req.n:
        return outs
    kept = []
    for start in range(0, len(outs), per_prompt):
        group = outs[start:start + per_prompt]
        kept += sorted(group, key=cumulative_log_prob, reverse=True)[:req.n]
    if req.logprobs is None:
        kept = [dataclasses.replace(o, generated_log_probs=None, generated_top_n_logprobs=None) for o in kept]
    return kept
