"""/v1/completions ``echo`` and vLLM's ``prompt_logprobs``: the prompt back, scored.

``echo: true`` puts the prompt's text before the completion; with ``logprobs: k`` the legacy
``logprobs`` object then covers the prompt tokens too (the first one's log-prob and top entries
``null``: nothing precedes it). ``max_tokens: 0`` with echo (or ``prompt_logprobs``) scores the
prompt only. vLLM's extra ``prompt_logprobs: k`` adds ``choices[i].prompt_logprobs``: ``null``
for the first token, then per token a dict of token id -> {logprob, rank, decoded_token} holding
the prompt's own token and the top k (rank: 1 for the best; the prompt token's rank is given
when it is among the top k, else null). Streams echo the prompt text in the first chunk, and
the prompt's log-probs (legacy ``logprobs`` entries before the tokens', or ``prompt_logprobs``)
in the first chunk after the prefill (the one with the first token, or the end with max_tokens
0): the chunks concatenate to the whole response."""
from __future__ import annotations

from megatron_async.inference.request import RequestOutput, RequestUpdate, SamplingParams
from megatron_async.serve.openai_protocol import BadRequest, CompletionRequest
from megatron_async.serve.responses import TokenText, completion_logprobs


def check_echo_options(req: CompletionRequest) -> None:
    if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
        raise BadRequest("max_tokens 0 needs echo or prompt_logprobs (it scores the prompt only)", "max_tokens")


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


def _entries(req: CompletionRequest, prompt_tokens, prompt_log_probs, prompt_top_n, tokens, log_probs, top_n):
    """(tokens, log-probs, top entries cut to ``logprobs``) of the legacy object: with echo and the
    prompt's log-probs given, the prompt's entries (the first null) before the tokens'."""
    k = req.logprobs
    tokens, log_probs, tops = list(tokens), list(log_probs or ()), _top(top_n, k)
    if req.echo and prompt_log_probs is not None:
        prompt_tops = _top(prompt_top_n, k)
        tokens, log_probs = list(prompt_tokens) + tokens, [None, *prompt_log_probs, *log_probs]
        tops = [None, *prompt_tops, *tops] if prompt_tops is not None else None
    return tokens, log_probs, tops


def echo_choice(choice: dict, req: CompletionRequest, out: RequestOutput, prompt_text: str, text_of: TokenText) -> dict:
    """A whole completion choice (``responses.completion_choice``) with the echo / prompt
    log-prob parts this request asked for."""
    if req.echo:
        choice["text"] = prompt_text + choice["text"]
    if req.logprobs is not None:
        choice["logprobs"] = completion_logprobs(*_entries(req, out.prompt_tokens, out.prompt_log_probs,
                                                           out.prompt_top_n_logprobs, out.generated_tokens,
                                                           out.generated_log_probs, out.generated_top_n_logprobs),
                                                 text_of)
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_tokens, out.prompt_log_probs,
                                                         out.prompt_top_n_logprobs, req.prompt_logprobs, text_of)
    return choice


def stream_logprobs(req: CompletionRequest, prompt_tokens: list[int], upd: RequestUpdate, text_of: TokenText,
                    offset: int) -> tuple[dict | None, list[dict | None] | None]:
    """A streamed chunk's legacy ``logprobs`` (``offset``: the text before it) and
    ``prompt_logprobs``, None where the chunk has none. The update carrying the prompt's
    log-probs puts them, with echo, before its own tokens' (as ``echo_choice`` does)."""
    prompt, lp = upd.prompt_log_probs, None
    if req.logprobs is not None:
        entries = _entries(req, prompt_tokens, prompt, upd.prompt_top_n_logprobs, upd.new_tokens, upd.new_log_probs,
                           upd.new_top_n_logprobs)
        lp = completion_logprobs(*entries, text_of, offset) if entries[0] else None
    plp = None
    if req.prompt_logprobs is not None and prompt is not None:
        plp = vllm_prompt_logprobs(prompt_tokens, prompt, upd.prompt_top_n_logprobs, req.prompt_logprobs, text_of)
    return lp, plp


def vllm_prompt_logprobs(prompt_tokens: list[int], log_probs, top_n, k: int, text_of: TokenText) -> list[dict | None]:
    tops = top_n or [{}] * len(log_probs)
    result: list[dict | None] = [None]
    for token, lp, top in zip(prompt_tokens[1:], log_probs, tops):
        best = list(top.items())[:k]
        entry = {str(t): {"logprob": v, "rank": r, "decoded_token": text_of(t)} for r, (t, v) in enumerate(best, 1)}
        if str(token) not in entry:
            entry = {str(token): {"logprob": lp, "rank": None, "decoded_token": text_of(token)}, **entry}
        result.append(entry)
    return result
