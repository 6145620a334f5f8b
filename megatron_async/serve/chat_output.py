"""A chat answer's text as OpenAI message fields: ``reasoning_content`` (with a reasoning parser),
``content`` and ``tool_calls`` (with a tool-call parser and tools in the request), whole or as
stream deltas. The whole message is built by streaming the whole text through the same parsers,
so a streamed answer's deltas always add up to the non-streamed message. Without parsers the
text is the content, untouched."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_async.serve.reasoning import reasoning_stream
from megatron_async.serve.responses import chat_chunk_choice
from megatron_async.serve.tool_calls import HermesToolCalls, new_call_id


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
