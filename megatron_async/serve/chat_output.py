"""A chat answer's text as OpenAI message fields: ``reasoning_content`` (with a reasoning parser),
``content`` and ``tool_calls`` (with a tool-call parser and tools in the request), whole or as
stream deltas. The whole message is built by streaming the whole text through the same parsers,
so a streamed answer's deltas always add up to the non-streamed message. Without parsers the
text is the content, untouched.

Both parsers split the text at an opening and a closing tag (``TagStream``), one delta at a time.
Text is released as soon as it cannot be part of a tag: a suffix that may be the start of the
next tag is held back until the next delta decides it, so a tag split across tokens never leaks
out as text. Whitespace touching a tag is dropped (models write ``</think>\\n\\n`` and
``\\n<tool_call>\\n``); for that, trailing whitespace is held back too until something other than a
tag follows it. Feeding the whole text at once gives the same pieces, concatenated, as feeding it
in any split: the non-streamed and streamed answers of one output agree.

Reasoning (``--reasoning-parser``): Qwen3 and DeepSeek-R1 style models think inside
``<think>...</think>`` before they answer; Qwen3's templates may open ``<think>`` in the prompt
(thinking models, or ``enable_thinking``): then the answer starts inside the section, and its text
up to ``</think>`` is reasoning. Tool calls (``--tool-call-parser``): the Hermes / Qwen format, one
call per ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; a call whose JSON does not
parse, or that names no function, stays content, tags included: the client sees what the model
wrote rather than an error."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Literal

from megatron_async.models.chat_template import ChatTemplate

Piece = tuple[Literal["outside", "inside", "open", "close"], str]
"""("outside" | "inside", text) or ("open" | "close", "") when a tag is passed."""


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class TagStream:
    """``feed(delta)`` -> pieces released now; ``finish()`` -> the rest. ``inside``: the text
    starts inside the tags (the prompt opened them). ``once``: after the first closing tag the
    rest is outside text, never scanned again (a reasoning section comes once, at the start)."""

    def __init__(self, open_tag: str, close_tag: str, inside: bool = False, once: bool = False):
        self.open_tag, self.close_tag, self.once = open_tag, close_tag, once
        self.inside = inside
        self._pending = ""  # text not released yet: a possible tag start or whitespace before one
        self._after_tag = inside  # drop the whitespace that follows a tag
        self._scanning = True

    def _kind(self) -> Literal["outside", "inside"]:
        return "inside" if self.inside else "outside"

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        out: list[Piece] = []
        while self._pending:
            if self._after_tag:
                self._pending = self._pending.lstrip()
                if not self._pending:
                    break
                self._after_tag = False
            if not self._scanning:
                out.append((self._kind(), self._pending))
                self._pending = ""
                break
            tag = self.close_tag if self.inside else self.open_tag
            at = self._pending.find(tag)
            if at >= 0:
                if before := self._pending[:at].rstrip():
                    out.append((self._kind(), before))
                out.append(("close" if self.inside else "open", ""))
                self._pending = self._pending[at + len(tag):]
                self._scanning = not (self.inside and self.once)
                self.inside = not self.inside
                self._after_tag = True
                continue
            held = _partial_tag_length(self._pending, tag)
            head = self._pending[: len(self._pending) - held]
            released = head.rstrip()
            if released:
                out.append((self._kind(), released))
            self._pending = self._pending[len(released):]
            break
        return out

    def finish(self) -> list[Piece]:
        """Releases what was held back (no tag followed it). Call once, at the end."""
        rest = self._pending.lstrip() if self._after_tag else self._pending
        self._pending = ""
        return [(self._kind(), rest)] if rest else []


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3",)
"""Names ``--reasoning-parser`` accepts."""


def starts_inside(prompt: str) -> bool:
    """Whether the rendered prompt leaves a ``<think>`` section open for the answer."""
    return prompt.rstrip().endswith(THINK_OPEN)


def reasoning_stream(parser: str, prompt: str) -> TagStream:
    """The splitter for one answer: "inside" pieces are reasoning, "outside" ones the answer."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(REASONING_PARSERS)}")
    return TagStream(THINK_OPEN, THINK_CLOSE, inside=starts_inside(prompt), once=True)


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


def _add(deltas: list[dict], key: str, text: str) -> None:
    """Append text to the last delta when it holds only that field (deltas keep answer order)."""
    if deltas and list(deltas[-1]) == [key]:
        deltas[-1][key] += text
    else:
        deltas.append({key: text})


class ChatOutputStream:
    """One choice's deltas: ``feed(text)`` as the engine streams, ``finish()`` once at the end.
    A tool call takes two deltas, as OpenAI streams them: its index, id and function name (empty
    arguments), then its arguments."""

    def __init__(self, reasoning_parser: str | None, tool_call_parser: str | None, prompt: str, new_id=new_call_id,
                 max_tool_calls: int | None = None):
        self._reasoning = reasoning_stream(reasoning_parser, prompt) if reasoning_parser else None
        self._tools = HermesToolCalls(new_id) if tool_call_parser else None
        self._max_calls = max_tool_calls

    @property
    def tool_calls(self) -> list[dict]:
        return self._tools.calls[: self._max_calls] if self._tools is not None else []

    def _content(self, deltas: list[dict], text: str) -> None:
        if self._tools is None:
            _add(deltas, "content", text)
            return
        self._tool_pieces(deltas, self._tools.feed(text))

    def _tool_pieces(self, deltas: list[dict], pieces) -> None:
        for kind, value in pieces:
            if kind == "content":
                _add(deltas, "content", value)
                continue
            index, call = value, self._tools.calls[value]
            if self._max_calls is not None and index >= self._max_calls:
                continue  # parallel_tool_calls false: only the first call is returned
            fn = call["function"]
            deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                           "function": {"name": fn["name"], "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fn["arguments"]}}]})

    def _route(self, deltas: list[dict], pieces) -> None:
        for kind, text in pieces:
            if kind == "inside":
                _add(deltas, "reasoning_content", text)
            elif kind == "outside":
                self._content(deltas, text)

    def feed(self, text: str) -> list[dict]:
        deltas: list[dict] = []
        if not text:
            return deltas
        if self._reasoning is None:
            self._content(deltas, text)
        else:
            self._route(deltas, self._reasoning.feed(text))
        return deltas

    def finish(self) -> list[dict]:
        deltas: list[dict] = []
        if self._reasoning is not None:
            self._route(deltas, self._reasoning.finish())
        if self._tools is not None:
            self._tool_pieces(deltas, self._tools.finish())
        return deltas

    def finish_reason(self, engine_reason: str) -> str:
        """An answer that stopped after calling tools finishes with "tool_calls"."""
        return "tool_calls" if self.tool_calls and engine_reason == "stop" else engine_reason


@dataclass(frozen=True)
class ChatOutputFormat:
    """How one request's answers are parsed. ``tool_call_parser``: set only when the request
    gives the template tools. ``prompt``: the rendered prompt (it may open a reasoning section)."""

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    prompt: str = ""
    max_tool_calls: int | None = None
    """1 for a request with ``parallel_tool_calls: false`` (later calls are dropped); None: all."""

    def stream(self, new_id=new_call_id) -> ChatOutputStream:
        return ChatOutputStream(self.reasoning_parser, self.tool_call_parser, self.prompt, new_id, self.max_tool_calls)

    def message(self, text: str, engine_reason: str, new_id=new_call_id) -> tuple[dict, str]:
        """(the whole answer's message, its finish_reason)."""
        s = self.stream(new_id)
        deltas = s.feed(text) + s.finish()
        content = "".join(d.get("content", "") for d in deltas)
        msg: dict = {"role": "assistant", "content": content}
        if self.reasoning_parser:
            msg["reasoning_content"] = "".join(d.get("reasoning_content", "") for d in deltas) or None
        if s.tool_calls:
            msg["tool_calls"] = s.tool_calls
        if msg.get("reasoning_content") or s.tool_calls:
            msg["content"] = content or None
        return msg, s.finish_reason(engine_reason)

