"""/v1/completions ``echo`` and vLLM's ``prompt_logprobs``: the prompt back, scored.

``echo: true`` puts the prompt's text before the completion; with ``logprobs: k`` the legacy
``logprobs`` object then covers the prompt tokens too (the first one's log-prob and top entries
``null``: nothing precedes it). ``max_tokens: 0`` with echo (or ``prompt_logprobs``) scores the
prompt only. vLLM's extra ``prompt_logprobs: k`` adds ``choices[i].prompt_logprobs``: ``null``
for the first token, then per token a dict of token id -> {logprob, rank, decoded_token} holding
the prompt's own token and the top k (rank: 1 for the best; the prompt token's rank is given
when it is among the top k, else null). Streams echo the prompt text in the first chunk; prompt
log-probs come whole only (a stream asking for them is refused)."""
from __future__ import annotations

from megatron_async.inference.request import RequestOutput, SamplingParams
from megatron_async.serve.openai_protocol import BadRequest, CompletionRequest
from megatron_async.serve.responses import TokenText, completion_logprobs


def check_echo_options(req: CompletionRequest) -> None:
    if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
        raise BadRequest("max_tokens 0 needs echo or prompt_logprobs (it scores the prompt only)", "max_tokens")
    if req.stream and (req.prompt_logprobs is not None or req.echo and req.logprobs is not None):
        raise BadRequest("prompt log-probs (echo with logprobs, prompt_logprobs) are not streamed; use stream false",
                         "stream")


def wants_prompt_scores(req: CompletionRequest) -> bool:
    return req.prompt_logprobs is not None or (req.echo and req.logprobs is not None) or req.max_tokens == 0


def with_prompt_scoring(req: CompletionRequest, sp: SamplingParams) -> SamplingParams:
    """``sp`` scoring the prompt when the request needs it (top-n: the larger of the two asks)."""
    if wants_prompt_scores(req):
        sp.return_prompt_log_probs = True
        sp.top_n_logprobs = max(sp.top_n_logprobs, req.prompt_logprobs or 0)
    return sp


def prompt_texts(raw_prompts: list, token_prompts: list[list[int]], tokenizer) -> list[str]:
    """The text echoed for each prompt: a text prompt as sent, token ids decoded."""
    return [p if isinstance(p, str) else tokenizer.decode(t) if tokenizer is not None else ""
            for p, t in zip(raw_prompts, token_prompts)]


def _top(tops: list[dict[int, float]] | None, k: int | None) -> list[dict[int, float]] | None:
    return [dict(list(t.items())[:k]) for t in tops] if tops is not None and k else None


def echo_choice(choice: dict, req: CompletionRequest, out: RequestOutput, prompt_text: str, text_of: TokenText) -> dict:
    """A whole completion choice (``responses.completion_choice``) with the echo / prompt
    log-prob parts this request asked for."""
    k = req.logprobs
    if req.echo:
        choice["text"] = prompt_text + choice["text"]
    if k is not None:
        gen = (out.generated_tokens, out.generated_log_probs, _top(out.generated_top_n_logprobs, k))
        if req.echo:
            prompt_tops = _top(out.prompt_top_n_logprobs, k)
            lps = [None, *out.prompt_log_probs, *gen[1]]
            tops = [None, *prompt_tops, *gen[2]] if prompt_tops is not None else None
            choice["logprobs"] = completion_logprobs(out.prompt_tokens + gen[0], lps, tops, text_of)
        else:
            choice["logprobs"] = completion_logprobs(*gen, text_of)
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(out, req.prompt_logprobs, text_of)
    return choice


def vllm_prompt_logprobs(out: RequestOutput, k: int, text_of: TokenText) -> list[dict | None]:
    tops = out.prompt_top_n_logprobs or [{}] * len(out.prompt_log_probs)
    result: list[dict | None] = [None]
    for token, lp, top in zip(out.prompt_tokens[1:], out.prompt_log_probs, tops):
        best = list(top.items())[:k]
        entry = {str(t): {"logprob": v, "rank": r, "decoded_token": text_of(t)} for r, (t, v) in enumerate(best, 1)}
        if str(token) not in entry:
            entry = {str(token): {"logprob": lp, "rank": None, "decoded_token": text_of(token)}, **entry}
        result.append(entry)
    return result
