"""``POST /v1/chat/completions``, the whole endpoint in one pass: the body parsed, its messages
rendered through the chat template (with ``tools``) and tokenized, or its ``prompt_token_ids``
taken as they are (request_input.py); each choice's sampling parameters, a forced tool call's
grammar among them (sampling_fields.py); the choices run (responses.respond); and the answers
formatted here, whole or streamed, their reasoning sections and tool calls parsed out of the text
(chat_output.py)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from megatron_async.inference.request import RequestOutput, RequestUpdate
from megatron_async.models.chat_template import ChatTemplate
from megatron_async.serve import responses as resp
from megatron_async.serve import sampling_fields
from megatron_async.serve.chat_output import ChatOutputFormat
from megatron_async.serve.openai_protocol import BadRequest, ChatCompletionRequest, NamedToolChoice
from megatron_async.serve.request_input import RequestInput
from megatron_async.serve.submission import Choice

_TEMPLATE_RESERVED = ("messages", "self")
"""Names ChatTemplate.render takes itself; ``add_generation_prompt`` may be overridden (vLLM's rule)."""


def chat_router(inputs: RequestInput, text_of: resp.TokenText) -> APIRouter:
    """``text_of``: the text of one token (log-probs' ``token``)."""
    router = APIRouter()
    state = inputs.state

    @router.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await inputs.parse(request, ChatCompletionRequest)
        lora = await inputs.lora_of(req.model)
        inputs.check_n(req.n)
        if state.chat_template is None and req.prompt_token_ids is None:
            raise BadRequest(f"{state.model_name} has no chat template; use /v1/completions")
        tools, add_generation_prompt, template_kwargs = template_inputs(
            req, state.chat_template if req.prompt_token_ids is None else None)
        if req.prompt_token_ids is not None:
            [prompt] = await inputs.tokens([req.prompt_token_ids])
            text = await inputs.decode(prompt)
        else:
            messages = [m.as_template_message() for m in req.messages]
            text = await inputs.render(messages, add_generation_prompt, template_kwargs)
            [prompt] = await inputs.tokens([text], add_special_tokens=False)
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, state.max_model_len - len(prompt))
        if req.top_logprobs and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        forced = sampling_fields.tool_choice_spec(req.tools, req.tool_choice, req.parallel_tool_calls,
                                                  state.tool_call_parser) if tools is not None else None
        spec = await sampling_fields.constraint(req, state.grammars, inputs.pool, forced)
        choices = [Choice(prompt, sampling_fields.choice_params(req, max_tokens, logprobs, i, spec, lora=lora))
                   for i in range(req.n)]
        answer = ChatAnswer(req, prompt, text, tools is not None, state, text_of)
        return await resp.respond(state.engine_loop, request, req, choices, answer.head, answer.chunk, answer.whole,
                                  [prompt])

    return router


def template_inputs(req: ChatCompletionRequest, template: ChatTemplate | None
                    ) -> tuple[list[dict] | None, bool, dict[str, Any]]:
    """(the tools the template is given, add_generation_prompt, the other template variables) of
    a chat request, BadRequest for fields that cannot be served. ``template``: the one that renders
    its prompt (None: ``prompt_token_ids`` is the prompt, nothing is rendered, and fields only the
    template would read are refused)."""
    tools = template_tools(req, template)
    if req.prompt_token_ids is not None:
        for name in ("messages", "chat_template_kwargs"):
            if getattr(req, name):
                raise BadRequest(f"prompt_token_ids is the whole prompt: {name} cannot be given with it", name)
    elif tools is not None:  # the template sees them as one more variable
        req.chat_template_kwargs = {**(req.chat_template_kwargs or {}), "tools": tools}
    add_generation_prompt, template_kwargs = chat_template_kwargs(req)
    return tools, add_generation_prompt, template_kwargs


def chat_template_kwargs(req: ChatCompletionRequest) -> tuple[bool, dict[str, Any]]:
    """(add_generation_prompt, the other template variables) of a chat request: its
    ``chat_template_kwargs`` override the request's own ``add_generation_prompt``."""
    extra = dict(req.chat_template_kwargs or {})
    add_generation_prompt = extra.pop("add_generation_prompt", req.add_generation_prompt)
    if not isinstance(add_generation_prompt, bool):
        raise BadRequest("chat_template_kwargs.add_generation_prompt must be a boolean",
                         "chat_template_kwargs.add_generation_prompt")
    for name in _TEMPLATE_RESERVED:
        if name in extra:
            raise BadRequest(f"chat_template_kwargs may not set {name!r}", f"chat_template_kwargs.{name}")
    return add_generation_prompt, extra


def template_tools(req: ChatCompletionRequest, template: ChatTemplate | None = None) -> list[dict] | None:
    """The tools the chat template is given (None: none at all). ``tool_choice`` "none" gives
    none; a named function gives that one alone. "required" and a named function are enforced by
    a grammar (sampling_fields.tool_choice_spec). Tools for a ``template`` that does not render
    them are refused (the model would never see them): a 400 naming ``tools``."""
    if not req.tools:
        if req.tool_choice is not None:
            raise BadRequest("tool_choice needs tools", "tool_choice")
        return None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise BadRequest("tool function names must be unique", "tools")
    choice = req.tool_choice or "auto"
    if choice == "none":
        return None
    tools = req.tools
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
        if not tools:
            raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not among tools", "tool_choice")
    if template is not None and not template.renders_tools:
        raise BadRequest("this model's chat template does not render tools: the model would never see them", "tools")
    return [t.model_dump(exclude_none=True) for t in tools]


class ChatAnswer:
    """One request's answers: ``whole(outputs)`` as one body, or stream chunks (``chunk``)."""

    def __init__(self, req: ChatCompletionRequest, prompt: list[int], text: str, with_tools: bool, state,
                 text_of: resp.TokenText):
        self.req, self.prompt, self.text_of = req, prompt, text_of
        self.output = ChatOutputFormat(state.reasoning_parser, state.tool_call_parser if with_tools else None, text,
                                       max_tool_calls=1 if req.parallel_tool_calls is False else None)
        self.streams = [self.output.stream() for _ in range(req.n)]
        ids = resp.TOKENS_SLOT if req.return_token_ids else None
        plain = req.stream and not (self.output.reasoning_parser or self.output.tool_call_parser)  # content only
        chunks = [chat_chunk_choice(i, {"content": resp.TEXT_SLOT}, None, ids) for i in range(req.n)] if plain else []
        self.head = resp.ResponseHead("chat.completion.chunk" if req.stream else "chat.completion",
                                      req.model or state.model_name, resp.new_id("chatcmpl"))
        self.templates = [resp.chunk_template(self.head.body([c])) for c in chunks]

    def chunk(self, i: int, text: str, finish: str | None, tokens: list[int] | None, first: bool,
              upd: RequestUpdate | None = None) -> list[dict]:
        lp = None
        if upd is not None and upd.new_tokens and upd.new_log_probs is not None:
            lp = chat_logprobs(upd.new_tokens, upd.new_log_probs, upd.new_top_n_logprobs, self.text_of)
        if self.templates and lp is None and not finish and not first:  # the common chunk: its text (and ids)
            return [self.templates[i](text) if tokens is None else self.templates[i](text, tokens)]
        stream = self.streams[i]
        deltas = stream.feed(text) + (stream.finish() if finish else [])
        finish = stream.finish_reason(finish) if finish else None
        extra = {"prompt_token_ids": self.prompt} if first and self.req.return_token_ids else {}
        return [self.head.body([c], **extra) for c in chunk_choices(i, deltas, first, finish, tokens, lp)]

    def whole(self, outs: list[RequestOutput]) -> dict:
        token_ids = self.req.return_token_ids
        body = [chat_choice(i, o, self.text_of, token_ids) for i, o in enumerate(outs)]
        for c, o in zip(body, outs):
            c["message"], c["finish_reason"] = self.output.message(o.generated_text or "", o.finish_reason)
        extra = {"prompt_token_ids": self.prompt} if token_ids else {}
        return self.head.body(body, usage=resp.outputs_usage([self.prompt], outs), **extra)


def chat_logprobs(tokens, log_probs, tops, text_of: resp.TokenText) -> dict | None:
    """The chat ``logprobs`` object: one entry per generated token with its top alternatives."""
    if log_probs is None:
        return None
    tops = tops if tops is not None else [{}] * len(tokens)

    def entry(token: int, lp: float) -> dict:
        s = text_of(token)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [
        {**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top.items()]}
        for t, lp, top in zip(tokens, log_probs, tops)
    ]}


def chat_choice(index: int, out: RequestOutput, text_of: resp.TokenText, token_ids: bool) -> dict:
    choice = {"index": index, "message": {"role": "assistant", "content": out.generated_text or ""},
              "logprobs": chat_logprobs(out.generated_tokens, out.generated_log_probs, out.generated_top_n_logprobs,
                                        text_of),
              "finish_reason": out.finish_reason}
    if token_ids:
        choice["token_ids"] = list(out.generated_tokens)
        choice["prompt_token_ids"] = list(out.prompt_tokens)
    return choice


def chat_chunk_choice(index: int, delta: dict, finish: str | None, tokens: list[int] | None,
                      logprobs: dict | None = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    if tokens is not None:
        choice["token_ids"] = tokens
    return choice


def chunk_choices(index: int, deltas: list[dict], first: bool, finish: str | None, tokens: list[int] | None,
                  logprobs: dict | None) -> list[dict]:
    """The stream chunk choices of one update: one per delta and at least one (an empty content
    delta still carries its tokens' ids and log-probs). The first of a choice's stream has its
    role; the update's token ids and log-probs ride on the first, the finish reason on the last."""
    if not deltas:
        deltas = [{} if finish and not first else {"content": ""}]
    if first:
        deltas[0] = {"role": "assistant", **deltas[0]}
    rest_tokens = None if tokens is None else []
    last = len(deltas) - 1
    return [chat_chunk_choice(index, d, finish if k == last else None, rest_tokens if k else tokens,
                              None if k else logprobs) for k, d in enumerate(deltas)]
