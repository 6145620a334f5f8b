"""Layering of the package, read from the source: every spelling of an import counts, wherever it
sits in a module: ``import a.b``, ``from a import b``, relative ``from ..a import b``, inside a
function, a class, a ``match`` case or a ``try``, and the dynamic ones (``importlib.import_module``,
``__import__``, ``runpy.run_module`` with a literal name, relative ones with a literal
``package``; with a computed name, every module named by a string constant of the module, as the
lazy exports of ``megatron_async/__init__.py`` and the model registry are). ``if TYPE_CHECKING:``
blocks are annotations only and count where a test says so.

Dependencies point one way (``LAYERS``): the step's data types (``forward_batch``,
``step_shape``) and ``config`` at the bottom, then ``kernels``, ``parallel``, ``models``, ``weight_transfer``, then
``inference`` and the entry points (``llm``, ``serve``, ``dp_engine``, ``coordinator``, ``client``,
``tools``) above, where the process roles never import the HTTP server (``ROLES_NEVER_IMPORT``). No import cycle
between modules (annotations included), none between the subpackages (and modules) of
``inference``, and library code never imports measurement or test code: ``benchmarks``,
``tests``, ``scripts``, ``megatron_async.testing``, ``megatron_async.tools``. The data-parallel
routing policies are one module (``inference/dp_routing.py``) that the coordinator and rank 0 of a
job of data-parallel ranks both read, reaching only the config and the prefix cache's hashes."""
from __future__ import annotations

import ast

from tests.helpers.import_reader import (
    import_graph, imported_names, in_roots, library_trees, module_imports, sources,
)

LAYERS = (
    ("megatron_async.config", "megatron_async.forward_batch", "megatron_async.step_shape"),
    ("megatron_async.kernels",),
    ("megatron_async.parallel",),
    ("megatron_async.models",),
    ("megatron_async.weight_transfer",),
    ("megatron_async.inference",),
)
"""From the bottom up: a module imports only from its own layer or those below. Everything
else (``llm``, ``serve``, ``tools``, ``testing``, the package itself) is the top layer."""

ROLES_NEVER_IMPORT = {
    "megatron_async.llm": ("megatron_async.serve",),
    "megatron_async.dp_engine": ("megatron_async.serve", "megatron_async.client"),
    "megatron_async.coordinator": ("megatron_async.serve", "megatron_async.dp_engine", "megatron_async.client",
                                   "megatron_async.llm"),
    "megatron_async.client": ("megatron_async.serve", "megatron_async.dp_engine", "megatron_async.llm"),
}
"""The entry points, one room per process role: the offline engine (``llm``), an engine serving a
data-parallel coordinator (``dp_engine``), the coordinator and its client import nothing of the
HTTP server (``serve``), which uses them; the coordinator and the client (no torch) import no
engine side."""

NOT_LIBRARY = ("benchmarks", "tests", "scripts", "megatron_async.testing", "megatron_async.tools")
"""What the library never imports, by any spelling: measurement and test code."""

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



def _rooms(graph: dict[str, set[str]], rooms: tuple[str, ...]) -> dict[str, set[str]]:
    """The graph between ``rooms`` (packages or modules; a module belongs to the longest room
    that holds it, modules of no room are left out)."""

    def room(module: str) -> str | None:
        return max((r for r in rooms if in_roots(module, (r,))), key=len, default=None)

    out: dict[str, set[str]] = {r: set() for r in rooms}
    for module, deps in graph.items():
        if room(module):
            out[room(module)].update(room(d) for d in deps if room(d) not in (None, room(module)))
    return out


def layer(module: str) -> int:
    return next((i for i, rooms in enumerate(LAYERS) if in_roots(module, rooms)), len(LAYERS))


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Modules -> what they import from a layer above their own."""
    found = {m: sorted(d for d in deps if layer(d) > layer(m)) for m, deps in graph.items()}
    return {m: d for m, d in found.items() if d}


def role_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Module of a role -> what it imports of the rooms ``ROLES_NEVER_IMPORT`` forbids it."""
    found = {}
    for module, deps in graph.items():
        banned = next((b for role, b in ROLES_NEVER_IMPORT.items() if in_roots(module, (role,))), ())
        if bad := sorted(d for d in deps if in_roots(d, banned)):
            found[module] = bad
    return found


def not_library_imports(sources: dict[str, tuple[ast.Module, bool]]) -> dict[str, list[str]]:
    """Library module -> the measurement or test code it imports (``sources``: module -> (syntax
    tree, is a package's ``__init__``); modules leaving the package are not library code)."""
    found = {}
    for module, (tree, is_package) in sources.items():
        bad = sorted(n for n in imported_names(tree, module, is_package) if in_roots(n, NOT_LIBRARY))
        if bad:
            found[module] = bad
    return found



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


def test_process_roles_import_no_http_server():
    """``llm`` joins a coordinator through dp_engine/, never through the web server's package;
    dp_engine/, coordinator/ and client/ import nothing of serve/ (annotations included)."""
    assert role_imports(import_graph(annotations=True)) == {}


def test_role_check_sees_a_planted_import():
    graph = import_graph(annotations=True)
    _plant(graph, "megatron_async.dp_engine.link", "def f():\n    from ..serve import engine_loop\n")
    _plant(graph, "megatron_async.llm",
           "import importlib\nJOIN = importlib.import_module('megatron_async.serve.app')\n")
    _plant(graph, "megatron_async.coordinator.core", "from ..dp_engine.engine_ops import run_engine_op\n")
    assert role_imports(graph) == {"megatron_async.dp_engine.link": ["megatron_async.serve.engine_loop"],
                                   "megatron_async.llm": ["megatron_async.serve.app"],
                                   "megatron_async.coordinator.core": ["megatron_async.dp_engine.engine_ops"]}


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


ROUTING = "megatron_async.inference.dp_routing"
ROUTING_NAMES = ("PrefixView", "choose", "place", "routing_keys", "keys_of", "packed_keys", "keys_from_bytes",
                 "digest_keys")
"""The routing policies and the view of the engines' caches: defined in ``ROUTING`` only."""


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph.get(module, ())
    return seen


def routing_reaches_beyond(graph: dict[str, set[str]]) -> set[str]:
    """What ``ROUTING`` imports, directly or not, beyond the config and the prefix cache's hashes."""
    allowed = ("megatron_async.config", "megatron_async.inference.contexts.kv_block_allocator", ROUTING)
    return {m for m in _reach(graph, ROUTING) if not in_roots(m, allowed)}


def routing_definitions(trees: dict[str, tuple[ast.Module, bool]]) -> dict[str, str]:
    """``ROUTING_NAMES`` defined at the top of a module other than ``ROUTING``: name -> module."""
    return {node.name: module for module, (tree, _) in trees.items() if module != ROUTING for node in tree.body
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in ROUTING_NAMES}


def test_data_parallel_routing_has_one_light_definition():
    """Which engine a request goes to is decided by one module, inference/dp_routing.py, for the
    coordinator (its own process, without torch: coordinator/core.py) and for rank 0 of a job of
    data-parallel ranks (engines/rank_router.py) alike. It reaches nothing but the config and the
    prefix cache's hashes (no engine, communicator, torch-importing module or coordinator), and no
    other module defines its policies or keys."""
    graph = import_graph(annotations=True)
    assert routing_reaches_beyond(graph) == set()
    assert ROUTING in graph["megatron_async.coordinator.core"]
    assert ROUTING in graph["megatron_async.inference.engines.rank_router"]
    assert routing_definitions(library_trees()) == {}


def test_routing_checks_see_a_planted_dependency_and_a_second_definition():
    graph = import_graph(annotations=True)
    _plant(graph, ROUTING, "def view():\n    from .engines import step_consensus\n")
    assert "megatron_async.inference.engines.step_consensus" in routing_reaches_beyond(graph)
    copy = {"megatron_async.inference.engines.rank_router": (ast.parse("def choose(x):\n    return x\n"), False)}
    assert routing_definitions(copy) == {"choose": "megatron_async.inference.engines.rank_router"}


def test_library_imports_no_measurement_or_test_code():
    """Nothing under megatron_async/ imports benchmarks, tests, scripts, megatron_async.testing
    or megatron_async.tools, by any spelling (annotations included)."""
    assert not_library_imports(library_trees()) == {}


# ---------------------------------------------------------------------------- the checks themselves
def _plant(graph: dict[str, set[str]], module: str, source: str, annotations: bool = False) -> None:
    """Add to ``graph`` what ``source`` imports, as if written in ``module``."""
    modules = set(graph)
    graph[module] = graph[module] | module_imports(ast.parse(source), modules, module, module in _packages(), annotations)


def _packages() -> set[str]:
    return {name for name, path in sources().items() if path.name == "__init__.py"}


def test_every_spelling_of_an_import_is_seen():
    modules = {"megatron_async.llm", "megatron_async.inference", "megatron_async.inference.engines",
               "megatron_async.inference.engines.scheduler", "megatron_async.kernels.attention"}
    here = "megatron_async.kernels.attention"
    spellings = {
        "import megatron_async.llm": "megatron_async.llm",
        "from megatron_async import llm": "megatron_async.llm",
        "from ..inference.engines import scheduler": "megatron_async.inference.engines.scheduler",
        "from ..inference import engines": "megatron_async.inference.engines",
        "from .. import llm": "megatron_async.llm",
        "def f():\n    from ..inference.engines import scheduler": "megatron_async.inference.engines.scheduler",
        "class A:\n    def f(self):\n        with x:\n            import megatron_async.llm": "megatron_async.llm",
        "match a:\n    case 1:\n        import megatron_async.llm": "megatron_async.llm",
        "try:\n    pass\nexcept* E:\n    import megatron_async.llm": "megatron_async.llm",
        "import importlib\nimportlib.import_module('megatron_async.llm')": "megatron_async.llm",
        "from importlib import import_module\nimport_module('..llm', package='megatron_async.kernels')":
            "megatron_async.llm",
        "import_module('.engines.scheduler', 'megatron_async.inference')": "megatron_async.inference.engines.scheduler",
        "x = __import__('megatron_async.llm')": "megatron_async.llm",
        "import runpy\nrunpy.run_module('megatron_async.llm')": "megatron_async.llm",
        "_LAZY = {'LLM': 'megatron_async.llm:LLM'}\ndef load(n):\n    return importlib.import_module(_LAZY[n])":
            "megatron_async.llm",
    }
    for source, target in spellings.items():
        assert target in module_imports(ast.parse(source), modules, here), source
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..inference.engines import scheduler\n"
    assert module_imports(ast.parse(typed), modules, here) == set()
    assert module_imports(ast.parse(typed), modules, here, annotations=True) == {"megatron_async.inference.engines.scheduler"}
    # a package's __init__: one dot is the package itself
    assert module_imports(ast.parse("from .engines import scheduler"), modules, "megatron_async.inference", True) == {
        "megatron_async.inference.engines.scheduler"}


def test_upward_import_detector_sees_a_planted_import():
    """The layering check fails on an upward import: a relative one in kernels/ inside a function
    (where a lazy import would hide), a literal importlib one in parallel/, and one in models/ for
    annotations only."""
    graph = import_graph(annotations=True)
    _plant(graph, "megatron_async.kernels.attention",
           "def backend():\n    from ..inference.contexts import dynamic_context\n")
    _plant(graph, "megatron_async.parallel.state",
           "import importlib\nSERVE = importlib.import_module('megatron_async.serve.app')\n")
    _plant(graph, "megatron_async.models.decoder", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                   "    from megatron_async.inference.speculative import mtp_drafter\n",
           annotations=True)
    assert upward_imports(graph) == {
        "megatron_async.kernels.attention": ["megatron_async.inference.contexts.dynamic_context"],
        "megatron_async.parallel.state": ["megatron_async.serve.app"],
        "megatron_async.models.decoder": ["megatron_async.inference.speculative.mtp_drafter"]}


def test_inference_room_cycle_detector_sees_a_planted_import():
    """A context reading the step plan from engines/ (where it used to live) closes a circle."""
    graph = import_graph(annotations=True)
    _plant(graph, "megatron_async.inference.contexts.general_rows", "from ..engines import scheduler\n")
    assert _cycle(_rooms(graph, inference_rooms(graph))) is not None


def test_cycle_detector_finds_a_planted_cycle():
    """config -> llm closes a circle, whether config's part imports it relatively or its
    package's __init__ does lazily."""
    for module, source in (("megatron_async.config.parts", "from ..llm import LLM\n"),
                           ("megatron_async.config", "def llm():\n    from .. import llm\n    return llm\n")):
        graph = import_graph()
        assert _cycle(graph) is None
        _plant(graph, module, source)
        assert _cycle(graph) is not None, source


def test_not_library_detector_sees_every_spelling():
    plants = {
        "import benchmarks": "benchmarks",
        "from benchmarks.serving import run": "benchmarks.serving",
        "import tests.unit_tests.helpers": "tests.unit_tests.helpers",
        "from scripts import measure": "scripts",
        "from ..testing import multiprocess": "megatron_async.testing",
        "from .. import tools": "megatron_async.tools",
        "def main():\n    from megatron_async.tools.cli import parse\n": "megatron_async.tools.cli",
        "if TYPE_CHECKING:\n    from tests.helpers import Fake\n": "tests.helpers",
        "importlib.import_module('benchmarks.cli')": "benchmarks.cli",
        "importlib.import_module('.tools.cli', package='megatron_async')": "megatron_async.tools.cli",
        "__import__('scripts.measure')": "scripts.measure",
        "_RUN = 'benchmarks.main:run'\ndef run():\n    return importlib.import_module(_RUN.split(':')[0])":
            "benchmarks.main",
        "runpy.run_path('benchmarks/serving.py')": "benchmarks.serving",
    }
    for source, name in plants.items():
        found = not_library_imports({"megatron_async.serve.app": (ast.parse(source), False)})
        assert name in found.get("megatron_async.serve.app", []), source
    fine = "import benchmarking_lib\nfrom megatron_async.tooling import x\nfrom .tests_data import y\n"
    assert not_library_imports({"megatron_async.serve.app": (ast.parse(fine), False)}) == {}
