"""Only the request book (inference/engines/request_book.py) changes a request's state after
admission; the context and its slot managers write only the resource fields they own (blocks,
slots, prefix hashes). Checked on the source: every assignment to, or in-place change of, a
field of ``DynamicInferenceRequest`` (read from inference/request.py, so a new field is the
book's until it is listed here) in the library's inference code and the LLM, by any spelling
(``field_writes``: setattr-style calls, attribute dicts, aliases)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_async"
BOOK = "inference/engines/request_book.py"

IDENTITY = {"request_id", "prompt_tokens", "sampling_params", "seed", "eos_ids", "stop_sequences", "banned_ids",
            "arrival_order"}
"""Given at construction, never changed (the request's own methods aside)."""

RESOURCE_OWNERS = {
    "block_ids": {"inference/contexts/dynamic_context.py", "inference/contexts/prefix_blocks.py"},
    "num_hashed_blocks": {"inference/contexts/prefix_blocks.py"},
    "last_block_hash": {"inference/contexts/prefix_blocks.py"},
    "mamba_store_points": {"inference/contexts/prefix_blocks.py"},
    "weights_epoch": {"inference/contexts/dynamic_context.py"},
    # the routing rank's hashes, adopted at admission, or those prompt sharing computed for its key
    "prompt_digests": {"inference/contexts/prefix_blocks.py", "inference/contexts/prompt_sharing.py"},
    "state_slot": {"inference/contexts/mamba_states.py"},
    "sampling_slot": {"inference/contexts/sampling_state.py"},
    "spec_slot": {"inference/contexts/spec_state.py"},
    "lora_slot": {"inference/contexts/lora_rows.py"},  # its adapter's slot and prefix key, bound at admission
    "lora_key": {"inference/contexts/lora_rows.py"},
    "decode_slot": {"inference/contexts/decode_rows.py"},  # its row in the decode-only snapshot's arrays
    "spec_drafts_fresh": {"inference/contexts/spec_state.py", BOOK},  # a new slot holds no drafts
    "spec_acceptance": {"inference/speculative/policy.py", "inference/speculative/step_choice.py"},  # the policy's estimate, told by the book
    "spec_positions": {"inference/speculative/policy.py", "inference/speculative/step_choice.py"},  # its evidence (adaptive rule)
    "routed_experts": {BOOK, "inference/routed_experts.py"},  # land_routing: called by the book's land()
    "prompt_log_probs": {BOOK, "inference/engines/prompt_log_probs.py"},  # land_prompt_scores: likewise
    "prompt_top_n_logprobs": {BOOK, "inference/engines/prompt_log_probs.py"},
    "text": {BOOK, "inference/stop_conditions.py"},  # its TextStream, fed by finish_reason: likewise
    "grammar": {"inference/engines/grammar_masks.py"},  # built at admission; the library's state advances itself
    "share_key": {"inference/contexts/prompt_sharing.py"},  # identical prompts: which holder's blocks to wait for
    "waited_for_prompt": {"inference/contexts/prompt_sharing.py"},
    "queued_after": {"inference/engines/scheduler.py"},  # the admission count when queued (priority aging)
}
"""Fields the context (or a component the book calls) keeps on the request for its resources."""

OTHER_OBJECTS = {("inference/engines/step_accounting.py", "st.generated_tokens"),
                 ("inference/text_generation_controllers/model_runner.py", "batch.routed_experts"),
                 ("inference/text_generation_controllers/model_runner.py", "pending.routed_experts"),
                 ("inference/records.py", "sp.__dict__")}
"""Same-named attributes of other objects (EngineStats.generated_tokens, ForwardBatch.routed_experts, a
decoded SamplingParams' fields)."""

MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update", "add", "discard",
            "setdefault", "popitem", "appendleft", "extendleft", "popleft", "fill", "put", "resize", "itemset"}
"""Methods that change the container (or array) they are called on."""

SETATTR = {"setattr", "delattr", "__setattr__", "__delattr__"}
"""``setattr(obj, name, v)`` / ``delattr(obj, name)`` / ``object.__setattr__(obj, name, v)`` /
``obj.__setattr__(name, v)``."""

IMMUTABLE = {"int", "float", "bool", "str", "bytes", "None", "Status", "FinishReason", "frozenset", "tuple", "object"}
"""Annotations of fields whose values cannot be changed in place, an alias of one being a copy
(``object``: ``last_block_hash``, a hash key)."""

DYNAMIC = "?"
"""The field of a write whose name the check cannot read (``setattr(req, name, v)``): nobody's."""


def request_fields() -> set[str]:
    return set(_request_annotations())


def mutable_fields() -> set[str]:
    """Fields whose value can change in place (containers, arrays, objects): an alias of one writes
    the request when it is changed."""
    return {name for name, ann in _request_annotations().items()
            if not set(re.findall(r"[A-Za-z_]\w*", ann)) <= IMMUTABLE | {"Optional"}}


def _request_annotations() -> dict[str, str]:
    tree = ast.parse((PACKAGE / "inference" / "request.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DynamicInferenceRequest")
    return {s.target.id: ast.unparse(s.annotation) for s in cls.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _own_nodes(scope: ast.AST):
    """The nodes of ``scope`` outside the functions and classes nested in it."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


class _Scope:
    """A function (or the module): whether its ``self`` is the object its method belongs to, and
    which of its names alias a request's mutable field."""

    def __init__(self, node: ast.AST, self_is_own: bool, fields: set[str]):
        """``fields``: the mutable fields an alias can change."""
        self.alias_fields = fields
        self.self_is_own = self_is_own and not any(
            isinstance(n, ast.Name) and n.id == "self" and not isinstance(n.ctx, ast.Load) for n in _own_nodes(node))
        self.aliases: dict[str, str] = {}
        pairs = []
        for n in _own_nodes(node):
            if isinstance(n, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and n.value is not None:
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    if isinstance(t, ast.Name):
                        pairs.append((t.id, n.value))
                    elif isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple) and len(t.elts) == len(n.value.elts):
                        pairs += [(te.id, ve) for te, ve in zip(t.elts, n.value.elts) if isinstance(te, ast.Name)]
        changed = True
        while changed:  # an alias of an alias aliases the same field
            changed = False
            for name, value in pairs:
                if (field := self.field_read(value, fields)) is not None and self.aliases.get(name) != field:
                    self.aliases[name], changed = field, True

    def exempt(self, obj: ast.expr) -> bool:
        """``obj`` is the method's own ``self`` (a request's own methods may change it)."""
        return isinstance(obj, ast.Name) and obj.id == "self" and self.self_is_own

    def field_read(self, value: ast.expr, fields: set[str]) -> str | None:
        """The request field of ``fields`` that ``value`` is (``x.f``, ``getattr(x, "f")``, an alias)."""
        if isinstance(value, ast.Attribute) and value.attr in fields and not self.exempt(value.value):
            return value.attr
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "getattr"
                and len(value.args) >= 2 and _literal(value.args[1]) in fields and not self.exempt(value.args[0])):
            return _literal(value.args[1])
        return self.aliases.get(value.id) if isinstance(value, ast.Name) else None


def _inner_self_is_own(fn: ast.AST, scope: _Scope, in_class: bool) -> bool:
    """A method whose first parameter is ``self`` owns it; a function nested in one without a
    parameter of that name sees the method's; any other ``self`` is just a name."""
    args = fn.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    every = positional + [a.arg for a in args.kwonlyargs] + [a.arg for a in (args.vararg, args.kwarg) if a]
    if in_class and not isinstance(fn, ast.Lambda):
        return positional[:1] == ["self"]
    return "self" not in every and scope.self_is_own


def _write_targets(node: ast.AST) -> list[ast.expr]:
    """What ``node`` writes: assignment and deletion targets, a mutator call's object."""
    if isinstance(node, (ast.Assign, ast.Delete)):
        return [e for t in node.targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
    if isinstance(node, ast.AugAssign) or isinstance(node, ast.AnnAssign) and node.value is not None:
        return [node.target]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        return [node.func.value]
    return []


def _attribute_dict(node: ast.expr, scope: _Scope) -> bool:
    """``node`` is another object's attribute dict: ``vars(x)`` or ``x.__dict__``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" and node.args:
        return not scope.exempt(node.args[0])
    return isinstance(node, ast.Attribute) and node.attr == "__dict__" and not scope.exempt(node.value)


def _target_writes(target: ast.expr, stmt: ast.AST, scope: _Scope, fields: set[str]) -> list[tuple[str, str]]:
    """The request fields that writing ``target`` (in ``stmt``) changes."""
    node = target
    while isinstance(node, (ast.Subscript, ast.Attribute, ast.Starred, ast.NamedExpr)):
        inner = node.value
        if isinstance(node, ast.Attribute) and node.attr in fields and not scope.exempt(inner):
            return [(node.attr, ast.unparse(node))]
        if isinstance(node, ast.NamedExpr):  # (g := req.generated_tokens).append(t)
            if (field := scope.field_read(inner, scope.alias_fields)) is not None:
                return [(field, ast.unparse(target))]
        elif isinstance(node, ast.Subscript) and _attribute_dict(inner, scope):  # vars(x)["f"] = v
            return [(_literal(node.slice) if _literal(node.slice) in fields else DYNAMIC, ast.unparse(node))]
        node = inner
    if isinstance(stmt, ast.Call) and _attribute_dict(target, scope):  # vars(x).update(f=v)
        return [(DYNAMIC, ast.unparse(target))]
    # through an alias: a change of what it holds, not a new binding of the name
    changes_value = target is not node or isinstance(stmt, (ast.AugAssign, ast.Call))
    if isinstance(node, ast.Name) and node.id in scope.aliases and changes_value:
        field = scope.aliases[node.id]
        return [(field, f"{ast.unparse(target)} ({node.id}: a request's {field})")]
    return []


def _setattr_writes(call: ast.Call, scope: _Scope, fields: set[str]) -> list[tuple[str, str]]:
    """The request fields a ``setattr``-style call changes (``?``: a name the check cannot read)."""
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    if name not in SETATTR:
        return []
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call) and ast.unparse(func.value.func) == "super":
        obj, args = ast.Name("self", ast.Load()), call.args  # super().__setattr__(name, v)
    elif isinstance(func, ast.Attribute) and not (isinstance(func.value, ast.Name) and func.value.id == "object"):
        obj, args = func.value, call.args  # x.__setattr__(name, v)
    else:
        obj, args = (call.args[0] if call.args else None), call.args[1:]  # setattr(x, ...), object.__setattr__(x, ...)
    if obj is None or scope.exempt(obj):
        return []
    field = _literal(args[0]) if args else None
    if field is None:
        return [(DYNAMIC, ast.unparse(call))]
    return [(field, ast.unparse(call))] if field in fields else []


def field_writes(tree: ast.Module, fields: set[str], mutable: set[str] | None = None) -> list[tuple[str, str]]:
    """(field, written expression) of every change of a request field, by any spelling: ``x.f =
    / += / del``, ``x.f[i] = ...``, ``x.f.append(...)``-style calls, ``x.f.g = ...`` (into the
    field's object), ``setattr`` / ``delattr`` / ``object.__setattr__`` / ``x.__setattr__``,
    writes through ``vars(x)`` or ``x.__dict__`` (a field name the check cannot read counts as
    ``?``), and changes through a local alias of a mutable field (``toks = req.generated_tokens;
    toks.append(t)``). ``self.f`` is exempt only in a method whose first parameter is ``self``,
    never rebound (the request's own methods), and in the functions nested in it."""
    alias_fields = fields if mutable is None else fields & mutable
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, scope: _Scope, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, _Scope(child, _inner_self_is_own(child, scope, in_class), alias_fields), False)
                continue
            for target in _write_targets(child):
                found.extend(_target_writes(target, child, scope, fields))
            if isinstance(child, ast.Call):
                found.extend(_setattr_writes(child, scope, fields))
            visit(child, scope, isinstance(child, ast.ClassDef) or in_class and not isinstance(child, ast.ClassDef))

    visit(tree, _Scope(tree, False, alias_fields), False)
    return found


def violations(relpath: str, tree: ast.Module, fields: set[str], mutable: set[str] | None = None) -> list[str]:
    bad = []
    for name, expr in field_writes(tree, fields, mutable):
        if (relpath, expr) in OTHER_OBJECTS:
            continue
        allowed = set() if name in IDENTITY or name == DYNAMIC else RESOURCE_OWNERS.get(name, {BOOK})
        if relpath not in allowed:
            bad.append(expr)
    return bad


def test_only_the_book_changes_request_state():
    fields, mutable = request_fields(), mutable_fields()
    assert {"status", "num_computed_tokens", "generated_tokens", "block_ids"} <= fields
    assert not (set(RESOURCE_OWNERS) | IDENTITY) - fields, "a listed field is gone from DynamicInferenceRequest"
    sources = [*(PACKAGE / "inference").rglob("*.py"), PACKAGE / "llm.py"]
    bad = {}
    for path in sources:
        rel = path.relative_to(PACKAGE).as_posix()
        if v := violations(rel, ast.parse(path.read_text()), fields, mutable):
            bad[rel] = v
    assert not bad, f"request fields changed outside their owner (go through the RequestBook): {bad}"


def test_the_check_sees_each_kind_of_change():
    fields = request_fields()
    src = ("req.status = 1\nreq.num_inflight += 1\nreq.block_ids[0] = 2\nreq.generated_tokens.append(3)\n"
           "a.finish_reason, b.error = 1, 2\nself.status = 4\nst.generated_tokens += 1\nreq.seed = 5\n")
    tree = ast.parse(src)
    assert sorted(violations("inference/contexts/dynamic_context.py", tree, fields)) == [
        "a.finish_reason", "b.error", "req.generated_tokens", "req.num_inflight", "req.seed", "req.status",
        "self.status", "st.generated_tokens"]  # a module's ``self`` is just a name
    assert sorted(violations(BOOK, tree, fields)) == ["req.block_ids", "req.seed"]
    assert violations("inference/engines/step_accounting.py", ast.parse("st.generated_tokens += 1"), fields) == []


def _changed(source: str) -> list[str]:
    """The fields ``source`` changes, as the library check sees them."""
    return [f for f, _ in field_writes(ast.parse(source), request_fields(), mutable_fields())]


def test_the_check_sees_every_spelling_of_a_change():
    """setattr-style calls, attribute dicts, aliases of a request or of its mutable fields, and a
    ``self`` that is not the method's own object: each is a change of a request field."""
    assert {"generated_tokens", "block_ids", "prompt_log_probs"} <= mutable_fields()
    assert not {"status", "num_computed_tokens", "seed", "eos_ids"} & mutable_fields()
    spellings = {
        "setattr(req, 'status', 1)": ["status"],
        "setattr(req, name, value)": [DYNAMIC],
        "delattr(req, 'error')": ["error"],
        "object.__setattr__(req, 'status', 1)": ["status"],
        "req.__setattr__('num_inflight', 1)": ["num_inflight"],
        "vars(req)['status'] = 1": ["status"],
        "req.__dict__['finish_reason'] = 1": ["finish_reason"],
        "vars(req).update(status=1)": [DYNAMIC],
        "r = req\nr.status = 1": ["status"],
        "def f(rs):\n    for r in rs:\n        r.num_computed_tokens += 1": ["num_computed_tokens"],
        "toks = req.generated_tokens\ntoks.append(3)": ["generated_tokens"],
        "def f(req):\n    b = req.block_ids\n    b[0] = 2\n    del b[1:]": ["block_ids", "block_ids"],
        "lps = getattr(req, 'prompt_log_probs')\nlps += [0.5]": ["prompt_log_probs"],
        "a = req.generated_tokens\nb2 = a\nb2.clear()": ["generated_tokens"],
        "(g := req.generated_tokens).append(1)": ["generated_tokens"],
        "req.sampling_params.seed = 1": ["seed"],
        "t = req.text\nt.cursor = 0": ["text"],
        "def f(self):\n    self.status = 1": ["status"],
        "class Book:\n    def f(self, req):\n        self = req\n        self.status = 1": ["status"],
        "for self in reqs:\n    self.status = 1": ["status"],
        "hook = lambda self: setattr(self, 'status', 1)": ["status"],
    }
    for source, expected in spellings.items():
        assert _changed(source) == expected, source
    unchanged = [
        "class Req:\n    def f(self):\n        self.status = 1\n        setattr(self, 'seed', 2)",
        "class Req:\n    def f(self):\n        def inner():\n            self.status = 2\n        return inner",
        "class Req:\n    def __setattr__(self, name, value):\n        object.__setattr__(self, name, value)\n"
        "        super().__setattr__(name, value)",
        "toks = req.generated_tokens\ntoks = list(toks)\nn = len(toks)",  # a new binding, not a change
        "n = req.num_computed_tokens\nn += 1",  # an int: the alias is a copy
        "x = req.status\nout.append(req.generated_tokens[-1])\nself.stats.update(a=1)",
    ]
    for source in unchanged:
        assert _changed(source) == [], source
    # what the book may change (through its helpers) and what nobody may
    assert violations(BOOK, ast.parse("setattr(req, 'status', 1)"), request_fields()) == []
    assert violations(BOOK, ast.parse("setattr(req, name, 1)\nvars(req).update(x=1)"), request_fields()) == [
        "setattr(req, name, 1)", "vars(req)"]
