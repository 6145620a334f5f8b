"""Layering of the package, read from the source (runtime imports; ``if TYPE_CHECKING:`` blocks
are annotations only): no import cycle between modules, none between the contexts, engines and
controllers packages, and library code never imports ``megatron_async.testing``."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_async"


def _runtime_imports(tree: ast.Module) -> set[str]:
    found = set()

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_async"):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("megatron_async"))
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []) if isinstance(getattr(node, field, None), list) else [])

    visit(tree.body)
    return found


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = _runtime_imports(ast.parse(path.read_text()))
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := dfs(w)):
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := dfs(v)):
            return found
    return None


def test_no_module_import_cycle():
    assert _cycle(import_graph()) is None


def test_contexts_engines_controllers_are_layered():
    rooms = ("megatron_async.inference.contexts", "megatron_async.inference.engines",
             "megatron_async.inference.text_generation_controllers", "megatron_async.models")

    def room(module: str) -> str | None:
        return next((r for r in rooms if module == r or module.startswith(r + ".")), None)

    graph: dict[str, set[str]] = {r: set() for r in rooms}
    for module, deps in import_graph().items():
        if room(module):
            graph[room(module)].update(room(d) for d in deps if room(d) not in (None, room(module)))
    assert _cycle(graph) is None


def test_library_never_imports_testing():
    offenders = {m: sorted(d for d in deps if d.startswith("megatron_async.testing"))
                 for m, deps in import_graph().items() if not m.startswith("megatron_async.testing")}
    assert {m: d for m, d in offenders.items() if d} == {}
