"""``Grammars``: the engine's one entry point to the grammar libraries.

``mode`` "auto" (the default) compiles with xgrammar, whose precomputed masks keep a step of many
constrained rows cheap, except the specs ``spec.prefers_guidance`` flags (length-bounded strings,
long counted repetitions, Lark grammars), which go to llguidance; "xgrammar" or "guidance" uses
one library for everything. Each library loads on first use. A spec whose library is missing
is refused with a GrammarError that says what to install ("auto" without xgrammar uses
llguidance for everything)."""
from __future__ import annotations

import importlib.util
import os

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a server's front-end processes check specs without loading torch
    import torch

from megatron_async.inference.structured.request_grammar import BaseGrammar
from megatron_async.inference.structured.spec import GrammarError, StructuredOutputs, prefers_guidance

MODES = ("auto", "xgrammar", "guidance")
_PACKAGES = {"xgrammar": "xgrammar", "guidance": "llguidance"}
INSTALL_HINT = "pip install 'megatron_async[structured]'"


def installed(backend: str) -> bool:
    """Whether the library of ``backend`` ("xgrammar" / "guidance") can be imported."""
    return importlib.util.find_spec(_PACKAGES[backend]) is not None


def any_installed() -> bool:
    return installed("xgrammar") or installed("guidance")


class Grammars:
    def __init__(self, tokenizer, eos_ids, vocab_size: int, mode: str = "auto", threads: int = 4):
        """``tokenizer``: a ``tokenizers.Tokenizer`` (None: every spec is refused); ``eos_ids``:
        every id that ends generation; ``vocab_size``: the model's rows; ``threads``: each
        library's mask-filling threads."""
        if mode not in MODES:
            raise ValueError(f"structured outputs backend must be one of {MODES}, got {mode!r}")
        self.mode, self.threads = mode, max(1, min(threads, os.cpu_count() or 1))
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_ids = tuple(sorted(set(int(e) for e in eos_ids)))
        self._backends: dict[str, object] = {}

    def settings(self) -> tuple:
        """What ``Grammars(tokenizer, *settings)`` needs to compile as this one does (picklable:
        a server's front-end processes check specs with their own)."""
        return self.eos_ids, self.vocab_size, self.mode, self.threads

    def backend_name(self, spec: StructuredOutputs) -> str:
        """The library that serves ``spec`` ("xgrammar" or "guidance"); GrammarError when it is
        not installed."""
        name = self.mode
        if name == "auto":
            name = "guidance" if prefers_guidance(spec) or not installed("xgrammar") else "xgrammar"
        if not installed(name):
            why = " (this spec has length-bounded strings or long repetitions)" if self.mode == "auto" else ""
            raise GrammarError(f"structured outputs{why} need the {_PACKAGES[name]} package, which is not "
                               f"installed: {INSTALL_HINT}")
        return name

    def backend_for(self, spec: StructuredOutputs):
        name = self.backend_name(spec)
        backend = self._backends.get(name)
        if backend is None:
            if self.tokenizer is None:
                raise GrammarError("structured outputs need the model's tokenizer (tokenizer.json); this engine has none")
            if name == "xgrammar":
                from megatron_async.inference.structured.xgrammar_backend import XGrammarBackend as cls
            else:
                from megatron_async.inference.structured.guidance_backend import GuidanceBackend as cls
            backend = self._backends[name] = cls(self.tokenizer, self.eos_ids, self.vocab_size, threads=self.threads)
        return backend

    def validate(self, spec: StructuredOutputs) -> None:
        """Compile ``spec`` (cached); GrammarError with the library's message when it does not."""
        self.backend_for(spec).compile(spec)

    def matcher(self, spec: StructuredOutputs, stop_ids=None) -> BaseGrammar:
        """A new request's grammar (``stop_ids``: the ids that end the request)."""
        return self.backend_for(spec).matcher(spec, stop_ids)


def fill_masks(grammars: list[BaseGrammar], rows: list[int], bitmask: torch.Tensor) -> None:
    """The next masks of ``grammars`` into ``bitmask`` rows ``rows``, each library's share in one
    batched call on its threads."""
    live = []
    for i, g in enumerate(grammars):
        if g.ended:  # its request finished: nothing follows (xgrammar raises if asked)
            bitmask[rows[i]] = -1
        else:
            live.append(i)
    groups = _by_backend(grammars, live)
    for idx in groups:
        grammars[idx[0]].backend.fill_many([grammars[i] for i in idx], [rows[i] for i in idx], bitmask)
    for idx in groups:
        for i in idx:
            grammars[i].fix_stop_bits(bitmask, rows[i])


def accept_landed(grammars: list[BaseGrammar], tokens: list[list[int]]) -> list[bool]:
    """``grammars[i].accept(tokens[i])`` for every i, each library's share in one batched call
    where it has one (``accept_many``)."""
    ok = [True] * len(grammars)
    for idx in _by_backend(grammars, range(len(grammars))):
        many = getattr(grammars[idx[0]].backend, "accept_many", None)
        res = many([grammars[i] for i in idx], [tokens[i] for i in idx]) if many is not None else [
            grammars[i].accept(tokens[i]) for i in idx]
        for i, r in zip(idx, res):
            ok[i] = r
    return ok


def _by_backend(grammars: list[BaseGrammar], indices) -> list[list[int]]:
    """``indices`` of ``grammars`` grouped by library (one batched call each)."""
    groups: dict[int, list[int]] = {}
    for i in indices:
        groups.setdefault(id(grammars[i].backend), []).append(i)
    return list(groups.values())
