"""Incremental detokenization and string stop words, on the host, one token at a time.

Decoding tokens one by one is wrong for byte-level BPE (a multi-byte character split over
tokens decodes to U+FFFD halves) and for decoders that merge tokens (SentencePiece drops
the leading space of the first token it sees). So a window of earlier tokens is decoded
with the new ones and only the part after the window's old text is taken, and text is held
back while it ends in an incomplete character. Stop strings are searched in the stable
text, across token boundaries, and text that might still become the start of a stop string
is held back too, so the emitted deltas always concatenate to the final text."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first generated one (leading-space rules)


class IncrementalDetokenizer:
    """The window rule above, run by the `tokenizers` package's ``DecodeStream`` where the
    tokenizer is one of its own (one native call a step instead of two decodes from Python).
    Its window is this class's, so both give the same text; ``_prefix`` / ``_read`` follow it
    so that ``flush`` and a fall-back to the Python path pick up where it stopped."""

    def __init__(self, tokenizer, prompt_tokens: list[int], skip_special_tokens: bool):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_tokens[-_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix = 0  # window start
        self._read = len(context)  # tokens up to here are in ``text``
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = self._native_stream(context) if self._backend is not None else None

    def _native_stream(self, context: list[int]):
        stream = DecodeStream(skip_special_tokens=self._skip)
        # Stepping the context leaves the stream in this class's starting state (window at 0,
        # its text read) only when the context decodes to complete, non-empty text; otherwise
        # (a token-id prompt ending inside a character, only special tokens) the Python path.
        try:
            return stream if context and stream.step(self._backend, context) is not None else None
        except Exception:  # noqa: BLE001 - the tokenizers package raises plain Exceptions
            return None

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def extend(self, tokens: list[int]) -> str:
        """Add tokens; returns the text that became stable ('' while it is incomplete)."""
        self._ids.extend(tokens)
        if self._stream is None or not tokens:
            return self._advance(final=False)
        try:
            # (one id steps faster than a list of one: most steps land one token a request)
            delta = self._stream.step(self._backend, tokens[0] if len(tokens) == 1 else tokens)
        except Exception:  # noqa: BLE001 - the decoder rewrote earlier text (its "invalid prefix")
            self._stream = None  # the Python path from here on: it takes the new text as it is
            return self._advance(final=False)
        if delta is None:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return delta

    def flush(self) -> str:
        """The rest of the text, complete or not (end of the stream)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        old = self._decode(self._ids[self._prefix : self._read])
        new = self._decode(self._ids[self._prefix :])
        if len(new) <= len(old) and not final:
            return ""  # e.g. a skipped special token: nothing visible yet
        if new.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # a character's bytes are split over tokens: wait for the rest
        # The window keeps the previous read segment, so decoders that look at neighbours
        # (leading spaces, merged tokens) see the same context on both sides.
        delta = new[len(old):]
        self._prefix, self._read = self._read, len(self._ids)
        return delta


class TextStream:
    """A request's generated text: detokenizer + stop strings + what was already emitted.

    Without stop strings, tokens are only buffered until text is asked for (``take_delta``
    or ``finish``), so a request whose text nobody streams is decoded once, at its end."""

    def __init__(self, tokenizer, prompt_tokens: list[int], stop_strings: list[str],
                 skip_special_tokens: bool, include_stop_str_in_output: bool):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_tokens, skip_special_tokens)
        self._stops = stop_strings
        self._include_stop = include_stop_str_in_output
        longest = max((len(s) for s in stop_strings), default=0)
        # Chars that may be the start of a stop string completed by later tokens.
        self._hold = 0 if include_stop_str_in_output else max(longest - 1, 0)
        self.text = ""
        """Stable text so far (the final generated_text once finished)."""
        self._emitted = 0
        self._buffered: list[int] = []
        self._source: list[int] | None = None
        self._fed = 0  # tokens of ``_source`` already given to the detokenizer
        self._end: int | None = None  # ``_source`` tokens past this have no text (EOS)
        self.needs_tokens = True
        """Feed every generated token with ``append`` (False: the stream reads its request's
        token list when text is asked for, see ``follow``)."""
        self.stopped_by: str | None = None
        self._done = False

    def follow(self, tokens: list[int]) -> None:
        """A stream without stop strings reads the generated tokens from ``tokens`` (its
        request's own list, appended to in place) when text is asked for, so landing a token
        costs it nothing; a stream with stop strings keeps being fed by ``append``."""
        if not self._stops:
            self._source, self._fed, self.needs_tokens = tokens, len(tokens), False

    def end_before_last(self) -> None:
        """The newest token ended the request without text of its own (EOS): a followed list
        holds it, but the text stops before it (a fed stream never received it)."""
        if self._source is not None:
            self._end = len(self._source) - 1

    def append(self, token: int, check_stops: bool = True) -> bool:
        """Feed a generated token; True when a stop string completed (text already trimmed).
        ``check_stops=False`` (before min_tokens): the text grows, no stop is looked for."""
        self._buffered.append(token)
        return bool(self._stops) and self._catch_up(check_stops)

    def _catch_up(self, check_stops: bool = True) -> bool:
        if self._source is not None:
            tokens = self._source[self._fed : self._end]
            self._fed += len(tokens)
        else:
            tokens, self._buffered = self._buffered, []
        delta = self._detok.extend(tokens) if tokens else ""
        if not delta:
            return False
        old_len = len(self.text)
        self.text += delta
        return check_stops and bool(self._stops) and self._find_stop(old_len)

    def _find_stop(self, old_len: int) -> bool:
        best = None
        for s in self._stops:
            at = self.text.find(s, max(0, old_len - len(s) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return False
        at, s = best
        self.text = self.text[: at + len(s)] if self._include_stop else self.text[:at]
        self.stopped_by = s
        self._done = True
        return True

    def finish(self) -> None:
        """The request ended: no more text will come (the undecided tail is final now)."""
        if self._done:
            return
        self._catch_up()
        if not self._done:  # (a stop string found while catching up ends it already)
            self.text += self._detok.flush()
            self._done = True

    def take_delta(self) -> str:
        """Text not yet emitted that can no longer change."""
        if not self._done:
            self._catch_up()
        end = len(self.text) if self._done else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
