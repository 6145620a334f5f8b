"""Only the request book (inference/engines/request_book.py) changes a request's state after
admission; the context and its slot managers write only the resource fields they own (blocks,
slots, prefix hashes). Checked on the source: every assignment to, or in-place change of, a
field of ``DynamicInferenceRequest`` (read from inference/request.py, so a new field is the
book's until it is listed here) in the library's inference code and the LLM."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_async"
BOOK = "inference/engines/request_book.py"

IDENTITY = {"request_id", "prompt_tokens", "sampling_params", "seed", "eos_ids", "stop_sequences",
            "arrival_order", "text"}
"""Given at construction, never changed (the request's own methods aside)."""

RESOURCE_OWNERS = {
    "block_ids": {"inference/contexts/dynamic_context.py"},
    "num_hashed_blocks": {"inference/contexts/dynamic_context.py"},
    "last_block_hash": {"inference/contexts/dynamic_context.py"},
    "mamba_store_points": {"inference/contexts/dynamic_context.py"},
    "weights_epoch": {"inference/contexts/dynamic_context.py"},
    "state_slot": {"inference/contexts/mamba_states.py"},
    "sampling_slot": {"inference/contexts/sampling_state.py"},
    "spec_slot": {"inference/contexts/spec_state.py"},
    "spec_drafts_fresh": {"inference/contexts/spec_state.py", BOOK},  # a new slot holds no drafts
    "spec_acceptance": {"inference/speculative/policy.py"},  # the policy's average, told by the book
    "routed_experts": {BOOK, "inference/routed_experts.py"},  # land_routing: called by the book's land()
}
"""Fields the context (or a component the book calls) keeps on the request for its resources."""

OTHER_OBJECTS = {("inference/engines/step_accounting.py", "st.generated_tokens"),
                 ("inference/text_generation_controllers/model_runner.py", "batch.routed_experts")}
"""Same-named attributes of other objects (EngineStats.generated_tokens, ForwardBatch.routed_experts)."""

MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update"}


def request_fields() -> set[str]:
    tree = ast.parse((PACKAGE / "inference" / "request.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DynamicInferenceRequest")
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def field_writes(tree: ast.Module, fields: set[str]) -> list[tuple[str, str]]:
    """(field, written expression) of every ``x.f = / += / del``, ``x.f[i] = ...`` and
    ``x.f.append(...)``-style change of a field ``f`` on an object other than ``self``."""
    def owned(node) -> ast.Attribute | None:
        while isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Attribute) and node.attr in fields and not (
                isinstance(node.value, ast.Name) and node.value.id == "self"):
            return node
        return None

    found = []
    for n in ast.walk(tree):
        targets = []
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            targets = [n.target]
        elif isinstance(n, ast.Delete):
            targets = n.targets
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS:
            targets = [n.func.value]
        for t in targets:
            for t in t.elts if isinstance(t, ast.Tuple) else [t]:
                if (a := owned(t)) is not None:
                    found.append((a.attr, ast.unparse(a)))
    return found


def violations(relpath: str, tree: ast.Module, fields: set[str]) -> list[str]:
    bad = []
    for name, expr in field_writes(tree, fields):
        if (relpath, expr) in OTHER_OBJECTS:
            continue
        allowed = set() if name in IDENTITY else RESOURCE_OWNERS.get(name, {BOOK})
        if relpath not in allowed:
            bad.append(expr)
    return bad


def test_only_the_book_changes_request_state():
    fields = request_fields()
    assert {"status", "num_computed_tokens", "generated_tokens", "block_ids"} <= fields
    assert not (set(RESOURCE_OWNERS) | IDENTITY) - fields, "a listed field is gone from DynamicInferenceRequest"
    sources = [*(PACKAGE / "inference").rglob("*.py"), PACKAGE / "llm.py"]
    bad = {}
    for path in sources:
        rel = path.relative_to(PACKAGE).as_posix()
        if v := violations(rel, ast.parse(path.read_text()), fields):
            bad[rel] = v
    assert not bad, f"request fields changed outside their owner (go through the RequestBook): {bad}"


def test_the_check_sees_each_kind_of_change():
    fields = request_fields()
    src = ("req.status = 1\nreq.num_inflight += 1\nreq.block_ids[0] = 2\nreq.generated_tokens.append(3)\n"
           "a.finish_reason, b.error = 1, 2\nself.status = 4\nst.generated_tokens += 1\nreq.seed = 5\n")
    tree = ast.parse(src)
    assert sorted(violations("inference/contexts/dynamic_context.py", tree, fields)) == [
        "a.finish_reason", "b.error", "req.generated_tokens", "req.num_inflight", "req.seed", "req.status",
        "st.generated_tokens"]
    assert sorted(violations(BOOK, tree, fields)) == ["req.block_ids", "req.seed"]
    assert violations("inference/engines/step_accounting.py", ast.parse("st.generated_tokens += 1"), fields) == []
