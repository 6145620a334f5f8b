"""llguidance behind the backend interface: the engine's tokenizer as an ``LLTokenizer``, specs
as grammar text (validated once, cached by the spec's key), template matchers per spec that the
requests copy (a new ``LLMatcher`` costs ~0.5 ms at a 150k vocabulary, a ``deep_copy`` ~10 us),
and batched mask filling on the library's own threads (the GIL is released).

The copies of one template share its lexer (llguidance's ``Parser`` keeps it behind an
``Arc<Mutex<_>>`` that clones share), so the executor's threads serialize on it: 128 copies of
one template filled on 2 threads with the process using one core (AMD EPYC, Qwen3-sized
vocabulary, the structured benchmark's schema: 10.2 us a row, CPU time 10.5). So a spec has
``TEMPLATES_PER_THREAD`` templates per thread and its requests are dealt round robin over them:
a step's rows are copies of independent families. A template's lock is held for a whole mask
(and a whole consume), and the executor (rayon) hands its threads contiguous runs of the list,
split further wherever a thread steals work, so the rows go to it grouped by family
(``_grouped``): neighbouring rows are one family, and a family is small enough (128 rows, 8
threads: 4 rows) that two threads rarely hold runs of the same one; as dealt, every run held one
row of each family in the same order and all threads queued on each lock in turn. Once a
family's lexer has seen the schema's states, more families cost no more a row (one thread, 8
against 32 families: 2.18 / 2.56 ms against 2.15 / 2.31 ms a step for 128 rows; ``python -m
benchmarks grammar-fill``, docs/PERFORMANCE.md).

llguidance builds masks lazily per step (no precomputation), so it compiles anything in
milliseconds, including the length-bounded strings and counted repetitions that make xgrammar
slow or wrong; its steps cost more than xgrammar's precomputed masks (spec.prefers_guidance)."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
import torch

from megatron_async.inference.structured.request_grammar import BaseGrammar
from megatron_async.inference.structured.spec import GrammarError, StructuredOutputs

TEMPLATES_PER_THREAD = 4
"""Template matchers a spec keeps per fill thread (module doc)."""
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer, eos_ids, vocab_size: int, threads: int = 4, cache_size: int = 256):
        """``tokenizer``: a ``tokenizers.Tokenizer``; ``vocab_size``: the model's rows (masks cover
        every row; rows without a token are never allowed); ``eos_ids``: every id that ends
        generation; ``threads``: the executor's mask-filling threads."""
        eos = sorted(set(int(e) for e in eos_ids))
        if not eos:
            raise GrammarError("structured outputs need an EOS id (the grammar's end); this model has none")
        self.vocab_size, self.eos_ids = vocab_size, tuple(eos)
        self.tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.families = threads * TEMPLATES_PER_THREAD
        """Template matchers per spec, each request a copy of one (dealt round robin)."""
        self._texts: OrderedDict[tuple, str] = OrderedDict()
        self._templates: OrderedDict[tuple, list] = OrderedDict()  # [dealt, template, ...] per spec
        self._cache_size = cache_size
        self._lock = threading.Lock()  # validation runs on the server's threads too

    def compile(self, spec: StructuredOutputs) -> str:
        """The spec's validated grammar text (GrammarError with llguidance's message if invalid)."""
        with self._lock:
            text = self._texts.get(spec.key)
            if text is not None:
                self._texts.move_to_end(spec.key)
                return text
        text = self._convert(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer)
        if is_error:
            raise GrammarError(f"invalid {spec.kind}: {messages[0] if messages else 'it does not compile'}")
        with self._lock:
            _put(self._texts, spec.key, text, self._cache_size)
        return text

    def _convert(self, spec: StructuredOutputs) -> str:
        try:
            if spec.kind in ("json", "json_object"):
                schema = json.loads(spec.value) if spec.kind == "json" else {"type": "object"}
                if isinstance(schema, dict) and spec.whitespace == "compact":
                    schema = {**schema, "x-guidance": {**_COMPACT, **schema.get("x-guidance", {})}}
                return llguidance.grammar_from("json_schema", json.dumps(schema))
            if spec.kind == "grammar":
                return llguidance.grammar_from("gbnf", spec.value)  # GBNF / EBNF, or Lark as it is
            return llguidance.grammar_from(spec.kind, spec.value)  # regex, choice
        except (ValueError, RecursionError) as e:
            raise GrammarError(f"invalid {spec.kind}: {e}") from None

    def matcher(self, spec: StructuredOutputs, stop_ids=None) -> GuidanceGrammar:
        """A request's grammar: a copy of the spec's template matcher."""
        text = self.compile(spec)
        with self._lock:
            family = self._templates.get(spec.key)
            if family is None:
                family = [0]  # [requests dealt, template of family 0, 1, ...]
                _put(self._templates, spec.key, family, self._cache_size)
            else:
                self._templates.move_to_end(spec.key)
            i = family[0] % self.families
            family[0] += 1
            if i + 1 == len(family):
                family.append(llguidance.LLMatcher(self.tokenizer, text, log_level=0))
            template = family[i + 1]
        return GuidanceGrammar(self, template.deep_copy(), stop_ids, family=i)

    def fill_many(self, grammars: list[GuidanceGrammar], rows: list[int], bitmask: torch.Tensor) -> None:
        """The masks of several grammars at once (``bitmask``: CPU int32, contiguous)."""
        W = bitmask.shape[1]
        self.executor.unsafe_compute_mask_ptr([(grammars[i].m, rows[i]) for i in _grouped(grammars)],
                                              bitmask.data_ptr(), W * 4, bitmask.shape[0])

    def accept_many(self, grammars: list[GuidanceGrammar], tokens: list[list[int]]) -> list[bool]:
        """``BaseGrammar.accept`` of each; those advancing by one token (a decode step's) in one
        call on the executor's threads, without the GIL (~3 us a row in Python otherwise)."""
        ok, single = [True] * len(grammars), []
        for i, (g, new) in enumerate(zip(grammars, tokens)):
            if len(new) == 1 and not g.ended:
                single.append((i, g, g.library_token(int(new[0]))))
            else:
                ok[i] = g.accept(new)
        if single:
            single = [single[k] for k in _grouped([g for _, g, _ in single])]
            res = self.executor.consume_token_par([(g.m, t) for _, g, t in single])
            for (i, g, t), r in zip(single, res):
                ok[i] = r
                if r:
                    g.advanced(t)
        return ok


class GuidanceGrammar(BaseGrammar):
    def __init__(self, backend: GuidanceBackend, matcher, stop_ids=None, family: int = 0):
        super().__init__(backend, stop_ids)
        self.m = matcher
        self.family = family
        """The spec's template this matcher copies (``GuidanceBackend.matcher``)."""
        if self.m.is_error():  # validated before: only resource limits can land here
            raise GrammarError(self.m.get_error())

    def _consume(self, token: int) -> bool:
        return self.m.consume_token(token)

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        self.m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)


def _grouped(grammars: list[GuidanceGrammar]) -> list[int]:
    """Indices of ``grammars`` with each family's together (the executor's order, module doc)."""
    return sorted(range(len(grammars)), key=lambda i: grammars[i].family)


def _put(cache: OrderedDict, key, value, size: int) -> None:
    cache[key] = value
    while len(cache) > size:
        cache.popitem(last=False)
