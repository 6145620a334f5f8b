"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): a prompt or chat messages to the token ids
the engine would run (the chat template rendered as ``/v1/chat/completions`` renders it), and
token ids back to text. Both check ``model`` (the served model or a LoRA adapter, which shares its
tokenizer; 404 for another name) and the body limits."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from megatron_async.serve import openai_protocol as proto
from megatron_async.serve.request_input import OFF_LOOP_BYTES, RequestInput


class Tokenize(proto._Strict):
    """A ``prompt`` (special tokens added by default, as completions do) or chat ``messages``
    (rendered by the chat template; none added by default, as chat does): exactly one."""

    model: str | None = None
    prompt: str | None = None
    messages: list[proto.ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[proto.FunctionTool] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class Detokenize(proto._Strict):
    model: str | None = None
    tokens: list[int]


def tokenize_router(inputs: RequestInput) -> APIRouter:
    router = APIRouter()
    state = inputs.state

    def tokenizer():
        if state.tokenizer is None:
            raise proto.BadRequest(f"{state.model_name} has no tokenizer")
        return state.tokenizer

    @router.post("/tokenize")
    async def tokenize(request: Request):
        req = await inputs.parse(request, Tokenize)
        await inputs.lora_of(req.model)  # an adapter shares the base model's tokenizer
        tok = tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise proto.BadRequest("give a prompt or messages (one of them)", "prompt")
        if req.messages is not None:
            if state.chat_template is None:
                raise proto.BadRequest(f"{state.model_name} has no chat template", "messages")
            kwargs = dict(req.chat_template_kwargs or {})
            if req.tools:
                kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
            messages = [m.as_template_message() for m in req.messages]
            add_generation_prompt = kwargs.pop("add_generation_prompt", req.add_generation_prompt)
            text = await inputs.render(messages, add_generation_prompt, kwargs)
        else:
            text = req.prompt
        special = req.add_special_tokens if req.add_special_tokens is not None else req.messages is None
        [ids] = await inputs.tokens([text], add_special_tokens=special)
        body = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = [tok.decode([i]) for i in ids]
        return body

    @router.post("/detokenize")
    async def detokenize(request: Request):
        req = await inputs.parse(request, Detokenize)
        await inputs.lora_of(req.model)  # an adapter shares the base model's tokenizer
        tok = tokenizer()
        bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise proto.BadRequest(f"token ids outside the vocabulary [0, {tok.vocab_size}): {bad[:5]}", "tokens")
        return {"prompt": await inputs.off_loop(len(req.tokens) > OFF_LOOP_BYTES // 4, tok.decode, req.tokens)}

    return router
