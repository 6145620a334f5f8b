"""``POST /v1/completions``, the whole endpoint in one pass: the body parsed and its prompts
tokenized (request_input.py), each choice's sampling parameters (sampling_fields.py), the choices
run (responses.respond), and the answer formatted here, whole or streamed.

What only this endpoint has lives here too. ``best_of``: that many samples of each prompt are
generated (they prefill the prompt once: ``InferenceConfig.share_prompt_prefill``) and the ``n``
with the highest cumulative log-probability of their generated tokens are returned, best first,
as OpenAI and vLLM do; usage counts every generated token; it cannot be streamed (which samples
win is known only at the end). ``echo`` puts the prompt's text before the completion; with
``logprobs: k`` the legacy ``logprobs`` object then covers the prompt tokens too (the first one's
log-prob and top entries ``null``: nothing precedes it). ``max_tokens: 0`` with echo (or
``prompt_logprobs``) scores the prompt only. vLLM's extra ``prompt_logprobs: k`` adds
``choices[i].prompt_logprobs``: ``null`` for the first token, then per token a dict of token id ->
{logprob, rank, decoded_token} holding the prompt's own token and the top k (rank: 1 for the best;
the prompt token's rank is given when it is among the top k, else null). Streams echo the prompt
text in the first chunk, and the prompt's log-probs (legacy ``logprobs`` entries before the
tokens', or ``prompt_logprobs``) in the first chunk after the prefill (the one with the first
token, or the end with max_tokens 0): the chunks concatenate to the whole response."""
from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request

from megatron_async.inference.request import RequestOutput, RequestUpdate
from megatron_async.serve import responses as resp
from megatron_async.serve import sampling_fields
from megatron_async.serve.openai_protocol import BadRequest, CompletionRequest, TokenIds
from megatron_async.serve.request_input import RequestInput
from megatron_async.serve.submission import Choice

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


def completions_router(inputs: RequestInput, text_of: resp.TokenText) -> APIRouter:
    """``text_of``: the text of one token (log-probs' ``tokens``)."""
    router = APIRouter()
    state = inputs.state

    @router.post("/v1/completions")
    async def completions(request: Request):
        req = await inputs.parse(request, CompletionRequest)
        lora = await inputs.lora_of(req.model)
        per_prompt, raw_prompts = completion_plan(req)
        inputs.check_n(per_prompt)
        inputs.check_body_size(len(raw_prompts), req.n)
        prompts = await inputs.tokens(raw_prompts)
        max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        logprobs = req.logprobs if per_prompt == req.n or req.logprobs is not None else 0  # best_of ranks by them
        spec = await sampling_fields.constraint(req, state.grammars, inputs.pool)
        choices = [Choice(p, sampling_fields.choice_params(req, max_tokens, logprobs, i, spec, prompt_top_n(req), lora))
                   for p in prompts for i in range(per_prompt)]
        answer = CompletionAnswer(req, raw_prompts, prompts, per_prompt, state, text_of)
        return await resp.respond(state.engine_loop, request, req, choices, answer.head, answer.chunk, answer.whole,
                                  prompts)

    return router


def completion_plan(req: CompletionRequest) -> tuple[int, list[str | TokenIds]]:
    """(samples per prompt: ``n``, or ``best_of`` of which ``n`` are kept; the prompts as sent),
    BadRequest for options that cannot be served."""
    if req.suffix:
        raise BadRequest("suffix is not supported", "suffix")
    per_prompt = samples_per_prompt(req)
    check_echo_options(req)
    return per_prompt, completion_prompts(req)


def completion_prompts(req: CompletionRequest) -> list[str | TokenIds]:
    """The request's prompts: one text, one token-id list, or a batch of either."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise BadRequest("prompt must not be empty", "prompt")
    if isinstance(p[0], int):
        return [p]
    return list(p)


def samples_per_prompt(req: CompletionRequest) -> int:
    """How many samples each prompt gets; BadRequest for a ``best_of`` that cannot be served."""
    if req.best_of is None or req.best_of == req.n:
        return req.n
    if req.best_of < req.n:
        raise BadRequest(f"best_of ({req.best_of}) must be at least n ({req.n})", "best_of")
    if req.stream:
        raise BadRequest("best_of larger than n cannot be streamed", "best_of")
    return req.best_of


def check_echo_options(req: CompletionRequest) -> None:
    if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
        raise BadRequest("max_tokens 0 needs echo or prompt_logprobs (it scores the prompt only)", "max_tokens")


def wants_prompt_scores(req: CompletionRequest) -> bool:
    return req.prompt_logprobs is not None or (req.echo and req.logprobs is not None) or req.max_tokens == 0


def prompt_top_n(req: CompletionRequest) -> int | None:
    """The prompt's scoring a choice asks for (top entries: the larger of the two asks), None: none."""
    return (req.prompt_logprobs or 0) if wants_prompt_scores(req) else None


def best_samples(req: CompletionRequest, outs: list[RequestOutput], per_prompt: int) -> list[RequestOutput]:
    """Of each prompt's ``per_prompt`` outputs (consecutive), its ``n`` best by cumulative
    log-probability (stable on ties: the earlier sample first); log-probs dropped unless the
    request asked for them."""
    if per_prompt == req.n:
        return outs
    kept = []
    for start in range(0, len(outs), per_prompt):
        group = outs[start:start + per_prompt]
        kept += sorted(group, key=lambda o: sum(o.generated_log_probs or ()), reverse=True)[:req.n]
    if req.logprobs is None:
        kept = [dataclasses.replace(o, generated_log_probs=None, generated_top_n_logprobs=None) for o in kept]
    return kept


class CompletionAnswer:
    """One request's answer: ``whole(outputs)`` as one body, or stream chunks (``chunk``)."""

    def __init__(self, req: CompletionRequest, raw_prompts: list, prompts: list[list[int]], per_prompt: int, state,
                 text_of: resp.TokenText):
        self.req, self.per_prompt, self.prompts, self.text_of = req, per_prompt, prompts, text_of
        tok = state.tokenizer
        self.echoed = [p if isinstance(p, str) else tok.decode(t) if tok is not None else ""
                       for p, t in zip(raw_prompts, prompts)] if req.echo else None
        """The text echoed for each prompt: a text prompt as sent, token ids decoded."""
        self.scored = wants_prompt_scores(req)
        n = len(prompts) * per_prompt
        self.text_offsets = [0] * n  # per choice: text of the tokens streamed so far
        ids = resp.TOKENS_SLOT if req.return_token_ids else None
        chunks = [completion_chunk_choice(i, resp.TEXT_SLOT, None, ids) for i in range(n)] if req.stream else []
        self.head = resp.ResponseHead("text_completion", req.model or state.model_name, resp.new_id("cmpl"))
        self.templates = [resp.chunk_template(self.head.body([c])) for c in chunks]

    def chunk(self, i: int, text: str, finish: str | None, tokens: list[int] | None, first: bool,
              upd: RequestUpdate | None = None) -> dict | str:
        req, lp, prompt_lp = self.req, None, None
        if first and self.echoed is not None:
            text = self.echoed[i // req.n] + text
        if self.scored and upd is not None:  # prompt log-probs in the chunk after the prefill
            lp, prompt_lp = stream_logprobs(req, self.prompts[i // self.per_prompt], upd, self.text_of,
                                            self.text_offsets[i])
        elif upd is not None and upd.new_tokens and upd.new_log_probs is not None:
            lp = completion_logprobs(upd.new_tokens, upd.new_log_probs, upd.new_top_n_logprobs, self.text_of,
                                     self.text_offsets[i])
        if lp is not None:
            self.text_offsets[i] += sum(len(t) for t in lp["tokens"])
        if lp is None and prompt_lp is None and finish is None:  # the common chunk: only its text (and ids)
            return self.templates[i](text) if tokens is None else self.templates[i](text, tokens)
        body = completion_chunk_choice(i, text, finish, tokens, lp)
        if prompt_lp is not None:
            body["prompt_logprobs"] = prompt_lp
        return self.head.body([body])

    def whole(self, outs: list[RequestOutput]) -> dict:
        req = self.req
        kept = best_samples(req, outs, self.per_prompt)
        body = [completion_choice(i, o, self.text_of, req.return_token_ids) for i, o in enumerate(kept)]
        if self.echoed is not None or self.scored:
            body = [echo_choice(c, req, o, self.echoed[i // req.n] if self.echoed else "", self.text_of)
                    for i, (c, o) in enumerate(zip(body, kept))]
        return self.head.body(body, usage=resp.outputs_usage(self.prompts, outs))


def completion_logprobs(tokens, log_probs, tops, text_of: resp.TokenText, offset: int = 0) -> dict | None:
    """The legacy completions ``logprobs`` object (tokens, token_logprobs, top_logprobs,
    text_offset) of some generated tokens; ``offset``: text length before them (a stream's
    earlier chunks), so that streamed chunks concatenate to the whole answer's object."""
    if log_probs is None:
        return None
    texts = [text_of(t) for t in tokens]
    offsets = []
    for s in texts:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": texts,
        "token_logprobs": list(log_probs),
        "top_logprobs": ([{text_of(t): lp for t, lp in top.items()} if top is not None else None for top in tops]
                         if tops is not None else None),
        "text_offset": offsets,
    }


def completion_choice(index: int, out: RequestOutput, text_of: resp.TokenText, token_ids: bool) -> dict:
    choice = {"index": index, "text": out.generated_text or "",
              "logprobs": completion_logprobs(out.generated_tokens, out.generated_log_probs,
                                              out.generated_top_n_logprobs, text_of),
              "finish_reason": out.finish_reason}
    if token_ids:
        choice["token_ids"] = list(out.generated_tokens)
        choice["prompt_token_ids"] = list(out.prompt_tokens)
    return choice


def completion_chunk_choice(index: int, text: str, finish: str | None, tokens: list[int] | None,
                            logprobs: dict | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if tokens is not None:
        choice["token_ids"] = tokens
    return choice


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


def echo_choice(choice: dict, req: CompletionRequest, out: RequestOutput, prompt_text: str,
                text_of: resp.TokenText) -> dict:
    """A whole completion choice (``completion_choice``) with the echo / prompt log-prob parts
    this request asked for."""
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


def stream_logprobs(req: CompletionRequest, prompt_tokens: list[int], upd: RequestUpdate, text_of: resp.TokenText,
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


def vllm_prompt_logprobs(prompt_tokens: list[int], log_probs, top_n, k: int,
                         text_of: resp.TokenText) -> list[dict | None]:
    tops = top_n or [{}] * len(log_probs)
    result: list[dict | None] = [None]
    for token, lp, top in zip(prompt_tokens[1:], log_probs, tops):
        best = list(top.items())[:k]
        entry = {str(t): {"logprob": v, "rank": r, "decoded_token": text_of(t)} for r, (t, v) in enumerate(best, 1)}
        if str(token) not in entry:
            entry = {str(token): {"logprob": lp, "rank": None, "decoded_token": text_of(token)}, **entry}
        result.append(entry)
    return result
