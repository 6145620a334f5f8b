"""Layering of the package, read from the source: imports anywhere in a module (also inside
functions); ``if TYPE_CHECKING:`` blocks are annotations only and count where a test says so.

Dependencies point one way (``LAYERS``): the step's data types (``forward_batch``,
``step_shape``) and ``config`` at the bottom, then ``kernels``, ``parallel``, ``models``, then
``inference`` and the entry points (``llm``, ``serve``, ``tools``) above. No import cycle
between modules (annotations included), none between the subpackages (and modules) of
``inference``, and library code never imports ``megatron_async.testing``."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_async"

LAYERS = (
    ("megatron_async.config", "megatron_async.forward_batch", "megatron_async.step_shape"),
    ("megatron_async.kernels",),
    ("megatron_async.parallel",),
    ("megatron_async.models",),
    ("megatron_async.inference",),
)
"""From the bottom up: a module imports only from its own layer or those below. Everything
else (``llm``, ``serve``, ``tools``, ``testing``, the package itself) is the top layer."""


def _imports(tree: ast.Module, modules: set[str], annotations: bool = False) -> set[str]:
    """Modules of the package ``tree`` imports (``from pkg import sub`` counts as ``pkg.sub``
    when ``pkg.sub`` is a module)."""
    found = set()

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not annotations:
                visit(node.orelse)
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_async"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules
                found.update(subs or {node.module})
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("megatron_async"))
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []) if isinstance(getattr(node, field, None), list) else [])

    visit(tree.body)
    return found


def import_graph(annotations: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``annotations``: TYPE_CHECKING imports too)."""
    sources = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in PACKAGE.rglob("*.py")}
    return {name: _imports(ast.parse(path.read_text()), set(sources), annotations) for name, path in sources.items()}


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


def _in(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def _rooms(graph: dict[str, set[str]], rooms: tuple[str, ...]) -> dict[str, set[str]]:
    """The graph between ``rooms`` (packages or modules; a module belongs to the longest room
    that holds it, modules of no room are left out)."""

    def room(module: str) -> str | None:
        return max((r for r in rooms if _in(module, (r,))), key=len, default=None)

    out: dict[str, set[str]] = {r: set() for r in rooms}
    for module, deps in graph.items():
        if room(module):
            out[room(module)].update(room(d) for d in deps if room(d) not in (None, room(module)))
    return out


def layer(module: str) -> int:
    return next((i for i, rooms in enumerate(LAYERS) if _in(module, rooms)), len(LAYERS))


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Modules -> what they import from a layer above their own."""
    found = {m: sorted(d for d in deps if layer(d) > layer(m)) for m, deps in graph.items()}
    return {m: d for m, d in found.items() if d}


def test_no_module_import_cycle():
    assert _cycle(import_graph()) is None


def test_no_module_cycle_through_annotations():
    """Type annotations are dependencies too: a TYPE_CHECKING import never closes a circle."""
    assert _cycle(import_graph(annotations=True)) is None


def test_layers_import_nothing_above():
    """The step types, kernels/, parallel/, models/ and inference/ read nothing of a layer above
    theirs (kernels/ and models/ nothing of inference/), also not lazily inside a function nor
    for annotations."""
    assert upward_imports(import_graph(annotations=True)) == {}


def test_upward_import_detector_sees_a_planted_import():
    """The check above fails on an upward import: one planted in kernels/ (inside a function,
    where a lazy import would hide) and one in models/ for annotations only."""
    graph = import_graph(annotations=True)
    graph["megatron_async.kernels.attention"] = graph["megatron_async.kernels.attention"] | {
        "megatron_async.inference.contexts.dynamic_context"}
    sources = {"megatron_async.models.decoder", "megatron_async.inference.speculative.mtp_drafter"}
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from megatron_async.inference.speculative import mtp_drafter\n")
    graph["megatron_async.models.decoder"] |= _imports(tree, sources, annotations=True)
    assert upward_imports(graph) == {
        "megatron_async.kernels.attention": ["megatron_async.inference.contexts.dynamic_context"],
        "megatron_async.models.decoder": ["megatron_async.inference.speculative.mtp_drafter"]}


def test_contexts_engines_controllers_are_layered():
    rooms = ("megatron_async.inference.contexts", "megatron_async.inference.engines",
             "megatron_async.inference.text_generation_controllers", "megatron_async.models")
    assert _cycle(_rooms(import_graph(), rooms)) is None


def inference_rooms(graph: dict[str, set[str]]) -> tuple[str, ...]:
    """The subpackages and modules directly under ``megatron_async.inference``."""
    prefix = "megatron_async.inference."
    return tuple(sorted({prefix + m[len(prefix):].split(".")[0] for m in graph if m.startswith(prefix)}))


def test_inference_subpackages_form_no_cycle():
    """contexts/, engines/, text_generation_controllers/, speculative/, communication/ and the
    modules beside them (the step types step_plan.py and async_pipeline.py among them) import
    each other one way only, annotations included."""
    graph = import_graph(annotations=True)
    assert _cycle(_rooms(graph, inference_rooms(graph))) is None


def test_inference_room_cycle_detector_sees_a_planted_import():
    """A context reading the step plan from engines/ (where it used to live) closes a circle."""
    graph = import_graph(annotations=True)
    graph["megatron_async.inference.contexts.general_rows"] |= {"megatron_async.inference.engines.scheduler"}
    assert _cycle(_rooms(graph, inference_rooms(graph))) is not None


def test_cycle_detector_finds_a_planted_cycle():
    graph = import_graph()
    graph["megatron_async.config"] = graph["megatron_async.config"] | {"megatron_async.llm"}
    assert _cycle(graph) is not None


def test_library_never_imports_testing():
    offenders = {m: sorted(d for d in deps if d.startswith("megatron_async.testing"))
                 for m, deps in import_graph().items() if not m.startswith("megatron_async.testing")}
    assert {m: d for m, d in offenders.items() if d} == {}
