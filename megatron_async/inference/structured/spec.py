"""``SamplingParams.structured_outputs``: what the generated text must match.

Exactly one kind is given, with vLLM's names: ``json`` (a JSON schema, as a dict or its JSON
text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of a list of strings) or
``grammar`` (GBNF / EBNF, or a Lark grammar). The spec keeps a canonical text of its value
(``key``), so a schema given as a dict and as a string share one compiled grammar, while two
schemas that differ in key order stay apart: properties are generated in the schema's order.

``whitespace``: "compact" (JSON with ``", "`` and ``": "`` separators and no other whitespace, so a
small model cannot loop on spaces and newlines) or "flexible" (any JSON whitespace).

No torch and no grammar library here: the server's front-ends build and check specs too."""
from __future__ import annotations

import json as _json
import re
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
WHITESPACE = ("compact", "flexible")


class SpecError(ValueError):
    """The spec is malformed (no kind, two kinds, a value of the wrong type), before any grammar
    library sees it."""


class GrammarError(ValueError):
    """A grammar library refused the spec (the message is the library's), or the library the spec
    needs is not installed."""


@dataclass(frozen=True, eq=False)
class StructuredOutputs:
    json: Any = None
    """A JSON schema: a dict, a bool, or its JSON text."""
    json_object: bool | None = None
    """True: any JSON object."""
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    """GBNF / EBNF (rules written ``name ::= ...``), or Lark (``name: ...``)."""
    whitespace: str = "compact"

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) is not None and not (k == "json_object" and self.json_object is False)]
        if len(given) != 1:
            raise SpecError(f"structured outputs need exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}")
        if self.whitespace not in WHITESPACE:
            raise SpecError(f"structured outputs whitespace must be one of {WHITESPACE}, got {self.whitespace!r}")
        kind = given[0]
        object.__setattr__(self, "_key", (kind, _canonical(kind, getattr(self, kind)), self.whitespace))

    @property
    def kind(self) -> str:
        return self._key[0]

    @property
    def value(self) -> str:
        """The canonical text: a schema or choice list as compact JSON (key order kept), a regex or
        grammar as given, "" for ``json_object``."""
        return self._key[1]

    @property
    def key(self) -> tuple[str, str, str]:
        """(kind, canonical value, whitespace): equal keys compile to the same grammar."""
        return self._key

    def as_fields(self) -> dict:
        """Plain values (a msgpack map) that ``StructuredOutputs(**fields)`` rebuilds this spec from."""
        value = {"json": self.value, "json_object": True, "choice": _json.loads(self.value) if self.kind == "choice" else None
                 }.get(self.kind, self.value)
        return {self.kind: value, "whitespace": self.whitespace}

    def __eq__(self, other):
        return isinstance(other, StructuredOutputs) and self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def __repr__(self):
        value = self.value if len(self.value) <= 60 else self.value[:57] + "..."
        return f"StructuredOutputs({self.kind}={value!r}, whitespace={self.whitespace!r})"


def _dumps(v: Any) -> str:
    return _json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def _canonical(kind: str, value: Any) -> str:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = _json.loads(value)
            except (ValueError, RecursionError) as e:
                raise SpecError(f"the json schema is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise SpecError(f"a json schema must be an object (or its JSON text), got {type(value).__name__}")
        try:
            return _dumps(value)
        except (TypeError, ValueError, RecursionError) as e:
            raise SpecError(f"the json schema cannot be written as JSON: {e}") from None
    if kind == "json_object":
        if value is not True:
            raise SpecError(f"json_object must be true, got {value!r}")
        return ""
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(s, str) and s for s in value):
            raise SpecError("choice must be a non-empty list of non-empty strings")
        return _dumps(list(value))
    if not isinstance(value, str) or not value:
        raise SpecError(f"{kind} must be a non-empty string, got {value!r}")
    return value


_COUNTED = re.compile(r"\{\s*\d*\s*,?\s*(\d+)\s*\}")


def prefers_guidance(spec: StructuredOutputs, max_count: int = 8) -> bool:
    """The "auto" backend's rule: True for specs llguidance serves better than xgrammar. JSON
    strings with ``minLength`` / ``maxLength`` (xgrammar 0.2.8 lets raw control characters into
    such strings, invalid JSON, and compiles them for seconds at a 150k vocabulary), patterns or
    regexes with a counted repetition above ``max_count`` (slow compiles and steps), and Lark
    grammars (llguidance's own syntax; GBNF / EBNF go to xgrammar)."""
    if spec.kind == "regex":
        return _large_count(spec.value, max_count)
    if spec.kind == "grammar":
        return "::=" not in spec.value
    if spec.kind != "json":
        return False
    stack = [_json.loads(spec.value)]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if "minLength" in x or "maxLength" in x:
                return True
            if isinstance(x.get("pattern"), str) and _large_count(x["pattern"], max_count):
                return True
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False


def _large_count(regex: str, max_count: int) -> bool:
    return any(int(n) > max_count for n in _COUNTED.findall(regex))
