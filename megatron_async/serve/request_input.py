"""From an HTTP request to what the engine takes: the body read and checked (request_body.py,
openai_protocol.py), the model name and ``n`` checked, the chat template rendered, prompts
tokenized, each choice's sampling parameters. Work that grows with the input (decoding a big
body, rendering the chat template, tokenizing) runs on a thread pool, off the event loop, so that
a huge prompt delays no other request; a text prompt longer than any ``max_model_len`` tokens can
hold is refused before it is tokenized."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from fastapi import Request

from megatron_async.inference.request import SamplingParams
from megatron_async.inference.structured.spec import GrammarError, StructuredOutputs
from megatron_async.models.chat_template import ChatTemplateError
from megatron_async.serve import openai_protocol as proto
from megatron_async.serve import request_body, structured_fields
from megatron_async.serve.server_state import ServerState

OFF_LOOP_BYTES = 64 * 2**10
"""Bodies, prompts and chat messages over this size are decoded, rendered and tokenized on the
thread pool; smaller ones inline (a thread hop costs more than their work)."""
MAX_COMPOSED_CHARS = 4
"""A tokenizer's normalizer (NFC / NFKC) may compose up to 3 characters into one before tokenizing."""


def max_token_chars(tokenizer) -> int:
    """The longest text one token of the vocabulary decodes to, in characters."""
    return max((len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size)), default=1)


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """More characters than this cannot tokenize into ``max_model_len`` tokens or fewer."""
    return max_model_len * max(1, max_token_chars(tokenizer)) * MAX_COMPOSED_CHARS


class RequestInput:
    def __init__(self, state: ServerState):
        self.state = state
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="megatron-async-input")
        self.prompt_chars = max_prompt_chars(state.tokenizer, state.max_model_len) if state.tokenizer is not None else 0
        """Text prompts longer than this are refused untokenized."""

    async def off_loop(self, big: bool, fn: Callable, *args):
        """``fn(*args)`` on the thread pool when its input is big, else right here."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args) if big else fn(*args)

    async def parse(self, request: Request, model: type):
        """The body as ``model``: content type, size, JSON and fields checked (see request_body.py)."""
        limit = self.state.max_request_bytes
        request_body.check_content_type(request.headers.get("content-type"))
        request_body.check_content_length(request.headers.get("content-length"), limit)
        raw = await request_body.read_limited(request.stream(), limit)
        return await self.off_loop(len(raw) > OFF_LOOP_BYTES, lambda: proto.parse_body(model, request_body.decode_json(raw)))

    def check_model(self, name: str | None) -> None:
        served = self.state.model_name
        if name is not None and name != served:
            raise proto.NotFound(f"model {name!r} does not exist; this server serves {served!r}", "model")

    def check_n(self, n: int) -> None:
        if n > self.state.max_requests:
            raise proto.BadRequest(f"n={n} is more than the {self.state.max_requests} requests this engine runs at once "
                                   "(--max-requests)", "n")

    def check_body_size(self, prompts: int, n: int) -> None:
        """One body may not hold more than ``prompts_per_body`` engine requests: nothing it asks for
        is queued without bound (a 400 naming the limit and its flag)."""
        limit = self.state.prompts_per_body
        if prompts * n > limit:
            raise proto.BadRequest(f"this body asks for {prompts * n} completions ({prompts} prompts x n={n}); this "
                                   f"server takes at most {limit} per body (--max-prompts-per-body)", "prompt")

    def render(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        try:
            return self.state.chat_template.render(messages, add_generation_prompt, **kwargs)
        except ChatTemplateError as e:
            raise proto.BadRequest(str(e), "messages") from None

    async def constraint(self, req, tools=None) -> StructuredOutputs | None:
        """The request's one constraint (structured_fields.py; ``tools``: its tool choice's),
        compiled on the thread pool where the engine's grammars are at hand, so a bad schema,
        regex or grammar is a 400 with the library's message before anything is queued and the
        engine thread finds it compiled. (Elsewhere the engine refuses it when it is added.)"""
        spec, field = structured_fields.spec_of(req, tools)
        grammars = self.state.grammars
        if spec is not None and grammars is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(self.pool, grammars.validate, spec)
            except GrammarError as e:
                raise proto.BadRequest(str(e), field) from None
        return spec

    async def tokens(self, prompts: list[str | list[int]], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each prompt; text longer than any prompt that fits is refused untokenized."""
        state = self.state
        texts = [p for p in prompts if isinstance(p, str)]
        if texts and state.tokenizer is None:
            raise proto.BadRequest("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        for t in texts:
            if len(t) > self.prompt_chars:
                raise proto.BadRequest(f"the prompt is {len(t)} characters: more than {state.max_model_len} tokens "
                                       "(the most a request may hold) can cover", "prompt")

        def encode() -> list[list[int]]:
            return [state.tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str)
                    else list(p) for p in prompts]

        return await self.off_loop(sum(len(t) for t in texts) > OFF_LOOP_BYTES, encode)


def choice_params(req, max_tokens: int, logprobs: int | None, i: int, structured_outputs=None) -> SamplingParams:
    """The sampling parameters of choice ``i`` of request body ``req`` (``structured_outputs``: its
    constraint, ``RequestInput.constraint``)."""
    sp = proto.sampling_params(req, max_tokens, logprobs, structured_outputs)
    if sp.seed is not None and i:  # n samples of one seeded request must differ
        sp.seed = (sp.seed + i) % 2**63
    return sp
