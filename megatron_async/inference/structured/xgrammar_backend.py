"""xgrammar behind the backend interface: specs compiled once (xgrammar's own cache keys them by
their text), a matcher per request, batched mask filling on xgrammar's threads (the GIL is
released).

xgrammar precomputes, per compiled grammar, which tokens each grammar position accepts, so its
per-step masks are fast (a few to tens of microseconds a row); the price is a compile of 0.1 s or
more for a typical schema at a 150k vocabulary and seconds for length-bounded strings, which
``spec.prefers_guidance`` sends to llguidance in "auto" mode."""
from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr

from megatron_async.inference.structured.request_grammar import BaseGrammar
from megatron_async.inference.structured.spec import GrammarError, StructuredOutputs

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def library_message(e: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[01:37:26] /project/cpp/x.cc:4944: ")."""
    return _LOG_PREFIX.sub("", str(e).strip()).strip()


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, eos_ids, vocab_size: int, threads: int = 4):
        """``tokenizer``: a ``tokenizers.Tokenizer`` (xgrammar reads its byte-level metadata through
        transformers' fast-tokenizer wrapper); the rest as ``GuidanceBackend``'s."""
        from transformers import PreTrainedTokenizerFast

        eos = sorted(set(int(e) for e in eos_ids))
        if not eos:
            raise GrammarError("structured outputs need an EOS id (the grammar's end); this model has none")
        self.vocab_size, self.eos_ids = vocab_size, tuple(eos)
        info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer),
                                                  vocab_size=vocab_size, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, spec: StructuredOutputs):
        """The spec's compiled grammar (GrammarError with xgrammar's message if invalid)."""
        c = self.compiler
        try:
            if spec.kind in ("json", "json_object"):
                schema = spec.value if spec.kind == "json" else '{"type": "object"}'
                return c.compile_json_schema(schema, any_whitespace=spec.whitespace == "flexible", strict_mode=True)
            if spec.kind == "regex":
                return c.compile_regex(spec.value)
            if spec.kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in json.loads(spec.value)))
            return c.compile_grammar(spec.value)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(f"invalid {spec.kind}: {library_message(e)}") from None

    def matcher(self, spec: StructuredOutputs, stop_ids=None) -> XGrammarGrammar:
        return XGrammarGrammar(self, xgr.GrammarMatcher(self.compile(spec)), stop_ids)

    def fill_many(self, grammars: list[XGrammarGrammar], rows: list[int], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask([g.m for g in grammars], bitmask, indices=list(rows))


class XGrammarGrammar(BaseGrammar):
    def __init__(self, backend: XGrammarBackend, matcher, stop_ids=None):
        super().__init__(backend, stop_ids)
        self.m = matcher

    def _consume(self, token: int) -> bool:
        return self.m.accept_token(token)

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)
