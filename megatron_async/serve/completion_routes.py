"""``POST /v1/completions``: a text or token-id prompt (or a list of them) completed ``n`` times
each, with ``echo`` and prompt scoring (echo.py), whole or streamed."""
from __future__ import annotations

from fastapi import APIRouter, Request

from megatron_async.inference.request import RequestOutput, RequestUpdate
from megatron_async.serve import best_of, echo
from megatron_async.serve import openai_protocol as proto
from megatron_async.serve import responses as resp
from megatron_async.serve.request_input import RequestInput, choice_params
from megatron_async.serve.responder import respond, usage
from megatron_async.serve.submission import Choice

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


def completions_router(inputs: RequestInput, text_of: resp.TokenText) -> APIRouter:
    """``text_of``: the text of one token (log-probs' ``tokens``)."""
    router = APIRouter()
    state = inputs.state

    @router.post("/v1/completions")
    async def completions(request: Request):
        req = await inputs.parse(request, proto.CompletionRequest)
        inputs.check_model(req.model)
        proto.check_completion_options(req)
        k = best_of.samples_per_prompt(req)  # samples per prompt: n, or best_of of which n are kept
        inputs.check_n(k)
        echo.check_echo_options(req)
        raw_prompts = proto.completion_prompts(req)
        inputs.check_body_size(len(raw_prompts), req.n)
        prompts = await inputs.tokens(raw_prompts)
        echoed = echo.prompt_texts(raw_prompts, prompts, state.tokenizer) if req.echo else None
        max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        spec = await inputs.constraint(req)
        logprobs = best_of.engine_logprobs(req, k)
        choices = [Choice(p, echo.with_prompt_scoring(req, choice_params(req, max_tokens, logprobs, i, spec)))
                   for p in prompts for i in range(k)]
        head = resp.ResponseHead("text_completion", state.model_name, resp.new_id("cmpl"))

        text_offsets = [0] * len(choices)  # per choice: text of the tokens streamed so far
        scored = echo.wants_prompt_scores(req)
        ids = resp.TOKENS_SLOT if req.return_token_ids else None
        templates = [resp.chunk_template(head.body([resp.completion_chunk_choice(i, resp.TEXT_SLOT, None, ids)]))
                     for i in range(len(choices))] if req.stream else []

        def chunk(i: int, text: str, finish: str | None, tokens: list[int] | None, first: bool,
                  upd: RequestUpdate | None = None) -> dict | str:
            lp = prompt_lp = None
            if first and echoed is not None:
                text = echoed[i // req.n] + text
            if scored and upd is not None:  # prompt log-probs in the chunk after the prefill (serve/echo.py)
                lp, prompt_lp = echo.stream_logprobs(req, choices[i].prompt_tokens, upd, text_of, text_offsets[i])
            elif upd is not None and upd.new_tokens and upd.new_log_probs is not None:
                lp = resp.completion_logprobs(upd.new_tokens, upd.new_log_probs, upd.new_top_n_logprobs, text_of,
                                              text_offsets[i])
            if lp is not None:
                text_offsets[i] += sum(len(t) for t in lp["tokens"])
            if lp is None and prompt_lp is None and finish is None:  # the common chunk: only its text (and ids)
                return templates[i](text) if tokens is None else templates[i](text, tokens)
            body = resp.completion_chunk_choice(i, text, finish, tokens, lp)
            if prompt_lp is not None:
                body["prompt_logprobs"] = prompt_lp
            return head.body([body])

        def whole(outs: list[RequestOutput]) -> dict:
            kept = best_of.select(req, outs, k)
            body = [resp.completion_choice(i, o, text_of, req.return_token_ids) for i, o in enumerate(kept)]
            if echoed is not None or scored:
                body = [echo.echo_choice(c, req, o, echoed[i // req.n] if echoed else "", text_of)
                        for i, (c, o) in enumerate(zip(body, kept))]
            return head.body(body, usage=usage(prompts, outs))

        return await respond(state.engine_loop, request, req, choices, head, chunk, whole, prompts)

    return router
