"""Splits streamed model text at an opening and a closing tag (``<think>`` / ``</think>``,
``<tool_call>`` / ``</tool_call>``), one delta at a time. Text is released as soon as it cannot
be part of a tag: a suffix that may be the start of the next tag is held back until the next
delta decides it, so a tag split across tokens never leaks out as text. Whitespace touching a tag
is dropped (models write ``</think>\\n\\n`` and ``\\n<tool_call>\\n``); for that, trailing whitespace
is held back too until something other than a tag follows it.

Feeding the whole text at once gives the same pieces, concatenated, as feeding it in any split:
the non-streamed and streamed answers of one output agree."""
from __future__ import annotations

from typing import Literal

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
