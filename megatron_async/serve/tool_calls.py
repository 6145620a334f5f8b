"""Function calling: which tools a chat request hands its template, and the tool calls in the
answer. The parser reads the Hermes / Qwen format, one call per
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the text outside the tags stays the
answer's content. A call whose JSON does not parse, or that names no function, stays content, tags
included: the client sees what the model wrote rather than an error."""
from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Literal

from megatron_async.models.chat_template import ChatTemplate
from megatron_async.serve.openai_protocol import BadRequest, ChatCompletionRequest, NamedToolChoice
from megatron_async.serve.tag_stream import TagStream

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_CALL_PARSERS = ("hermes",)
"""Names ``--tool-call-parser`` accepts, besides "auto" and "none"."""

ToolCallPiece = tuple[Literal["content"], str] | tuple[Literal["call"], int]
"""("content", text) or ("call", index of the call in ``calls``)."""


def choose_parser(flag: str, template: ChatTemplate | None) -> str | None:
    """The server's tool-call parser: ``flag`` names one, or "auto" picks the one the chat
    template asks for (its tool instructions mention ``<tool_call>``), or "none"."""
    if flag == "none":
        return None
    if flag == "auto":
        return "hermes" if template is not None and TOOL_CALL_OPEN in template.source else None
    if flag not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {flag!r}; known: auto, none, {', '.join(TOOL_CALL_PARSERS)}")
    return flag


def template_tools(req: ChatCompletionRequest, template: ChatTemplate | None = None) -> list[dict] | None:
    """The tools the chat template is given (None: none at all). ``tool_choice`` "none" gives
    none; a named function gives that one alone. "required" and a named function are enforced by
    a grammar (structured_fields.tool_choice_spec). Tools for a ``template`` that does not render
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


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(body: str, call_id: str) -> dict | None:
    """One tagged call as an OpenAI tool call (arguments as a JSON string), or None when it is
    not ``{"name": str, "arguments": object}``."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return {"id": call_id, "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class HermesToolCalls:
    """One answer's tool calls as it streams: ``feed(delta)`` / ``finish()`` return ("content",
    text) and ("call", index) pieces in answer order. A call is released whole when its
    closing tag arrives (its JSON must parse before it can be told from content)."""

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self._tags = TagStream(TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
        self._new_id = new_id
        self._body: list[str] = []
        self.calls: list[dict] = []

    def _route(self, pieces) -> list[ToolCallPiece]:
        out: list[ToolCallPiece] = []
        for kind, text in pieces:
            if kind == "outside":
                out.append(("content", text))
            elif kind == "inside":
                self._body.append(text)
            elif kind == "open":
                self._body = []
            else:
                body = "".join(self._body)
                call = parse_call(body, self._new_id())
                if call is None:
                    out.append(("content", f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"))
                else:
                    out.append(("call", len(self.calls)))
                    self.calls.append(call)
        return out

    def feed(self, text: str) -> list[ToolCallPiece]:
        return self._route(self._tags.feed(text))

    def finish(self) -> list[ToolCallPiece]:
        """The rest; a call left open (the answer was cut) is content, its tag included."""
        out = self._route(self._tags.finish())
        if self._tags.inside:
            out.append(("content", TOOL_CALL_OPEN + "".join(self._body)))
        return out
