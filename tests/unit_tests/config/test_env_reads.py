"""No module of the package reads an environment variable other than the allowed ones: a switch
is an ``InferenceConfig`` field (or a flag), and the environment holds only secrets and paths
that must stay out of argv, what a launcher or another library defines, and nothing the engine
decides from. Checked on the source, every spelling: ``os.environ.get(X)``, ``os.environ[X]``,
``X in os.environ``, ``os.getenv(X)``, ``os.environ.pop / setdefault`` of X, and the same
through ``from os import environ, getenv`` or an alias of ``os``. A name given by a constant
(``ENV = "..."``), a parameter's default or a loop over a literal is resolved to its value."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "megatron_async"

SECRETS = {"MEGATRON_ASYNC_API_KEY", "MEGATRON_ASYNC_SECRET", "MEGATRON_ASYNC_SECRET_FILE",
           "MEGATRON_ASYNC_CLIENT_SECRET", "MEGATRON_ASYNC_CLIENT_SECRET_FILE"}
PATHS = {"XDG_RUNTIME_DIR", "TRITON_CACHE_DIR", "PYTHONPATH", "LD_PRELOAD"}
LAUNCHER = {"RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
"""What torchrun gives every process it starts."""
OTHER_LIBRARIES = {"TRITON_INTERPRET", "OMP_NUM_THREADS", "NCCL_NVLS_ENABLE"}
"""Read to follow another library's setting (Triton's interpreter mode), or set as its default."""
SERVE_PROFILER = {"MEGATRON_ASYNC_FRONTEND_PROFILER"}
"""The HTTP front end's profiler hook (serve/frontend.py)."""
ALLOWED = SECRETS | PATHS | LAUNCHER | OTHER_LIBRARIES | SERVE_PROFILER

READ_METHODS = {"get", "pop", "setdefault", "__getitem__", "__contains__"}


class _Reads(ast.NodeVisitor):
    """Every environment variable a module reads, as the syntax names it (unresolved)."""

    def __init__(self):
        self.os_names, self.environ_names, self.getenv_names = {"os"}, set(), set()
        self.reads: list[ast.expr] = []

    def visit_Import(self, node):
        for a in node.names:
            if a.name == "os":
                self.os_names.add(a.asname or "os")

    def visit_ImportFrom(self, node):
        if node.module == "os":
            for a in node.names:
                if a.name == "environ":
                    self.environ_names.add(a.asname or a.name)
                elif a.name == "getenv":
                    self.getenv_names.add(a.asname or a.name)

    def _is_environ(self, node) -> bool:
        return ((isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
                 and node.value.id in self.os_names)
                or (isinstance(node, ast.Name) and node.id in self.environ_names))

    def _is_getenv(self, node) -> bool:
        return ((isinstance(node, ast.Attribute) and node.attr == "getenv" and isinstance(node.value, ast.Name)
                 and node.value.id in self.os_names)
                or (isinstance(node, ast.Name) and node.id in self.getenv_names))

    def visit_Call(self, node):
        f = node.func
        if self._is_getenv(f) and node.args:
            self.reads.append(node.args[0])
        elif (isinstance(f, ast.Attribute) and f.attr in READ_METHODS and self._is_environ(f.value)
              and node.args):
            self.reads.append(node.args[0])
        self.generic_visit(node)

    def visit_Subscript(self, node):
        if self._is_environ(node.value) and isinstance(node.ctx, ast.Load):
            self.reads.append(node.slice)
        self.generic_visit(node)

    def visit_Compare(self, node):
        if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(
                self._is_environ(c) for c in node.comparators):
            self.reads.append(node.left)
        self.generic_visit(node)


def _strings(node) -> set[str] | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        values = [_strings(e) for e in node.elts]
        return set().union(*values) if values and all(v is not None for v in values) else None
    return None


def _bindings(tree: ast.Module) -> dict[str, set[str]]:
    """Names bound to strings anywhere in a module: constants, parameter defaults, loops over literals."""
    bound: dict[str, set[str]] = {}

    def bind(target, value_strings):
        name = target.id if isinstance(target, ast.Name) else target.arg if isinstance(target, ast.arg) else None
        if name is not None and value_strings is not None:
            bound.setdefault(name, set()).update(value_strings)

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    for te, ve in zip(t.elts, node.value.elts):
                        bind(te, _strings(ve))
                else:
                    bind(t, _strings(node.value))
        elif isinstance(node, (ast.For, ast.comprehension)):
            bind(node.target, _strings(node.iter))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args
            for a, d in zip(args[len(args) - len(node.args.defaults):], node.args.defaults):
                bind(a, _strings(d) or (bound.get(d.id) if isinstance(d, ast.Name) else None))
    return bound


def env_reads(source: str, constants: dict[str, set[str]] | None = None) -> set[str]:
    """The names of the environment variables ``source`` reads; ``?<expr>`` where a name cannot be resolved.
    ``constants``: string constants of the other modules (an imported ``ENV`` name)."""
    tree = ast.parse(source)
    visitor = _Reads()
    visitor.visit(tree)
    bound = {**(constants or {}), **_bindings(tree)}
    names: set[str] = set()
    for expr in visitor.reads:
        key = expr.id if isinstance(expr, ast.Name) else expr.attr if isinstance(expr, ast.Attribute) else None
        resolved = _strings(expr) or (bound.get(key) if key else None)
        names |= resolved if resolved else {f"?{ast.unparse(expr)}"}
    return names


def _package_constants(sources: dict[Path, str]) -> dict[str, set[str]]:
    constants: dict[str, set[str]] = {}
    for source in sources.values():
        for name, values in _bindings(ast.parse(source)).items():
            if name.isupper():
                constants.setdefault(name, set()).update(values)
    return constants


def test_the_package_reads_no_environment_switch():
    sources = {p: p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    constants = _package_constants(sources)
    bad = {str(p.relative_to(ROOT)): sorted(extra) for p, src in sources.items()
           if (extra := env_reads(src, constants) - ALLOWED)}
    assert not bad, ("environment variables read outside the allow-list (make a switch an InferenceConfig "
                     f"field or a flag): {bad}")


def test_every_spelling_of_a_read_is_caught():
    source = '''
import os
import os as o
from os import environ, getenv as ge
from os import environ as env
SWITCH = "A_CONST"

def f(name="A_DEFAULT"):
    os.environ.get("A_GET")
    os.environ["A_ITEM"]
    os.getenv("A_GETENV")
    o.environ.get("A_ALIAS")
    environ.get("A_FROM")
    env["A_FROM_AS"]
    ge("A_GETENV_FROM")
    "A_IN" in os.environ
    os.environ.pop("A_POP", None)
    os.environ.setdefault("A_SETDEFAULT", "1")
    os.environ.get(SWITCH)
    os.environ.get(name)
    [k for k in ("A_LOOP",) if k not in os.environ]
    os.environ.get(unknown)
    os.environ["WRITTEN"] = "1"
'''
    assert env_reads(source) == {"A_GET", "A_ITEM", "A_GETENV", "A_ALIAS", "A_FROM", "A_FROM_AS", "A_GETENV_FROM",
                                 "A_IN", "A_POP", "A_SETDEFAULT", "A_CONST", "A_DEFAULT", "A_LOOP", "?unknown"}
    assert env_reads("from x import ENV\nimport os\nos.environ.get(ENV)", {"ENV": {"IMPORTED"}}) == {"IMPORTED"}
