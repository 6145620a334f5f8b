"""``POST /v1/chat/completions``: messages rendered through the model's chat template (with
``tools``), answered ``n`` times, whole or streamed; reasoning sections and tool calls are parsed
out of the answers (chat_output.py)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from megatron_async.inference.request import RequestOutput, RequestUpdate
from megatron_async.serve import openai_protocol as proto
from megatron_async.serve import responses as resp
from megatron_async.serve import structured_fields, tool_calls
from megatron_async.serve.chat_output import ChatOutputFormat, chunk_choices
from megatron_async.serve.request_input import OFF_LOOP_BYTES, RequestInput, choice_params
from megatron_async.serve.responder import respond, usage
from megatron_async.serve.submission import Choice


def chat_router(inputs: RequestInput, text_of: resp.TokenText) -> APIRouter:
    """``text_of``: the text of one token (log-probs' ``token``)."""
    router = APIRouter()
    state = inputs.state

    @router.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await inputs.parse(request, proto.ChatCompletionRequest)
        inputs.check_model(req.model)
        inputs.check_n(req.n)
        if state.chat_template is None and req.prompt_token_ids is None:
            raise proto.BadRequest(f"{state.model_name} has no chat template; use /v1/completions")
        tools = tool_calls.template_tools(req, state.chat_template if req.prompt_token_ids is None else None)
        if req.prompt_token_ids is not None:
            text, prompt = await token_prompt(inputs, req)
        else:
            if tools is not None:  # the template sees them as one more variable
                req.chat_template_kwargs = {**(req.chat_template_kwargs or {}), "tools": tools}
            messages = [m.as_template_message() for m in req.messages]
            add_generation_prompt, template_kwargs = proto.chat_template_kwargs(req)
            big = sum(len(m.get("content") or "") for m in messages) > OFF_LOOP_BYTES
            text = await inputs.off_loop(big, inputs.render, messages, add_generation_prompt, template_kwargs)
            [prompt] = await inputs.tokens([text], add_special_tokens=False)
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, state.max_model_len - len(prompt))
        if req.top_logprobs and not req.logprobs:
            raise proto.BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        forced = structured_fields.tool_choice_spec(req.tools, req.tool_choice, req.parallel_tool_calls,
                                                    state.tool_call_parser) if tools is not None else None
        spec = await inputs.constraint(req, forced)
        choices = [Choice(prompt, choice_params(req, max_tokens, logprobs, i, spec)) for i in range(req.n)]
        head = resp.ResponseHead("chat.completion.chunk" if req.stream else "chat.completion", state.model_name,
                                 resp.new_id("chatcmpl"))
        output = ChatOutputFormat(state.reasoning_parser, state.tool_call_parser if tools is not None else None, text,
                                  max_tool_calls=1 if req.parallel_tool_calls is False else None)
        streams = [output.stream() for _ in choices]
        ids = resp.TOKENS_SLOT if req.return_token_ids else None
        plain = req.stream and not (output.reasoning_parser or output.tool_call_parser)  # content deltas only
        templates = [resp.chunk_template(head.body([resp.chat_chunk_choice(i, {"content": resp.TEXT_SLOT}, None, ids)]))
                     for i in range(len(choices))] if plain else []

        def chunk(i: int, text: str, finish: str | None, tokens: list[int] | None, first: bool,
                  upd: RequestUpdate | None = None) -> list[dict]:
            lp = None
            if upd is not None and upd.new_tokens and upd.new_log_probs is not None:
                lp = resp.chat_logprobs(upd.new_tokens, upd.new_log_probs, upd.new_top_n_logprobs, text_of)
            if templates and lp is None and not finish and not first:  # the common chunk: its text (and ids)
                return [templates[i](text) if tokens is None else templates[i](text, tokens)]
            deltas = streams[i].feed(text) + (streams[i].finish() if finish else [])
            finish = streams[i].finish_reason(finish) if finish else None
            extra = {"prompt_token_ids": prompt} if first and req.return_token_ids else {}
            return [head.body([c], **extra) for c in chunk_choices(i, deltas, first, finish, tokens, lp)]

        def whole(outs: list[RequestOutput]) -> dict:
            body = [resp.chat_choice(i, o, text_of, req.return_token_ids) for i, o in enumerate(outs)]
            for c, o in zip(body, outs):
                c["message"], c["finish_reason"] = output.message(o.generated_text or "", o.finish_reason)
            extra = {"prompt_token_ids": prompt} if req.return_token_ids else {}
            return head.body(body, usage=usage([prompt], outs), **extra)

        return await respond(state.engine_loop, request, req, choices, head, chunk, whole, [prompt])

    return router


async def token_prompt(inputs: RequestInput, req: proto.ChatCompletionRequest) -> tuple[str, list[int]]:
    """(its text, the ids) of a request whose prompt is ``prompt_token_ids``: nothing rendered (the
    engine checks the ids against its vocabulary); fields only the template would read are refused."""
    for name in ("messages", "chat_template_kwargs"):
        if getattr(req, name):
            raise proto.BadRequest(f"prompt_token_ids is the whole prompt: {name} cannot be given with it", name)
    [prompt] = await inputs.tokens([req.prompt_token_ids])
    tokenizer = inputs.state.tokenizer
    text = await inputs.off_loop(len(prompt) > OFF_LOOP_BYTES // 8, tokenizer.decode, prompt) if tokenizer else ""
    return text, prompt
