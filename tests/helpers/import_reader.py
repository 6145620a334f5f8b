"""The package's import statements read from its source, every spelling of an import wherever it
sits in a module (see tests/unit_tests/test_import_graph.py, which holds the layering rules and
tests this reader): ``import_graph`` (module -> the package's modules it imports),
``imported_names`` and ``import_statements`` of one syntax tree."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_async"

_DYNAMIC_IMPORTS = {"import_module", "__import__", "run_module"}
"""Calls that import the module they name (importlib.import_module, __import__, runpy.run_module)."""
_PATH_LOADERS = {"run_path", "spec_from_file_location", "SourceFileLoader"}
"""Calls that load a module from a file path (runpy.run_path, importlib.util's loaders)."""
_MODULE_NAME = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\.?(?::[A-Za-z_]\w*)?")
"""A string constant that names a module: ``pkg.mod``, ``pkg.mod:attr`` or a prefix ``pkg.``."""
_TOP_FOLDERS = ("benchmarks", "tests", "scripts")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _annotation_only(tree: ast.Module) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` bodies."""
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
            for stmt in node.body for n in ast.walk(stmt)}


def _absolute(name: str, level: int, package: str) -> str | None:
    """``name`` imported with ``level`` leading dots from a module of ``package`` (None: above the top)."""
    if level == 0:
        return name
    parts = package.split(".")
    if level - 1 >= len(parts):
        return None
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _call_name(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _dynamic_target(call: ast.Call, package: str) -> str | None | bool:
    """The module a dynamic import call names: a name, None (above the top), or False (computed)."""
    name = _literal(call.args[0]) if call.args else _literal(next((k.value for k in call.keywords if k.arg == "name"), None))
    if name is None:
        return False
    level = len(name) - len(name.lstrip("."))
    if level:
        pkg = _literal(call.args[1]) if len(call.args) > 1 else _literal(
            next((k.value for k in call.keywords if k.arg == "package"), None))
        return _absolute(name[level:], level, pkg or package)
    return name


def _path_target(call: ast.Call) -> str | None:
    """A literal ``.py`` path loaded by ``call``, as a dotted module name from its first folder
    that is a top-level one of the repository (``../benchmarks/run.py`` -> ``benchmarks.run``)."""
    for arg in [*call.args, *(k.value for k in call.keywords)]:
        path = _literal(arg)
        if path is not None and path.endswith(".py"):
            parts = [p for p in Path(path.removesuffix(".py")).parts if p not in (".", "..", "/")]
            tops = [i for i, p in enumerate(parts) if p in (*_TOP_FOLDERS, "megatron_async")]
            return ".".join(parts[tops[0] if tops else 0:])
    return None


def import_statements(tree: ast.Module, module: str, is_package: bool = False,
                      annotations: bool = False) -> list[tuple[str, tuple[str, ...], bool]]:
    """(base, names, certain) of every import in ``tree``, made absolute (``module``: the dotted
    name of its source; ``is_package``: it is a package's ``__init__``): ``from base import
    names`` or ``import base`` (names empty). ``certain`` is False for the string constants of a
    module that imports a computed name (any of them may be imported). ``annotations``: ``if
    TYPE_CHECKING:`` imports too."""
    package = module if is_package else module.rpartition(".")[0]
    skip = set() if annotations else _annotation_only(tree)
    found: list[tuple[str, tuple[str, ...], bool]] = []
    computed = False
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, (), True) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module or "", node.level, package)
            if base is not None:
                found.append((base, tuple(a.name for a in node.names if a.name != "*"), True))
        elif isinstance(node, ast.Call) and _call_name(node.func) in _DYNAMIC_IMPORTS:
            target = _dynamic_target(node, package)
            computed |= target is False
            if target:
                found.append((target, (), True))
        elif isinstance(node, ast.Call) and _call_name(node.func) in _PATH_LOADERS:
            if target := _path_target(node):
                found.append((target, (), True))
    if computed:
        for node in ast.walk(tree):
            if (s := _literal(node)) is not None and (m := _MODULE_NAME.fullmatch(s)) and m.group(1) != module:
                found.append((m.group(1), (), False))
    return found


def imported_names(tree: ast.Module, module: str, is_package: bool = False, annotations: bool = True) -> set[str]:
    """Every dotted name ``tree`` may import: each base, and ``base.name`` for each name taken from it."""
    return {n for base, names, _ in import_statements(tree, module, is_package, annotations)
            for n in (base, *(f"{base}.{a}" for a in names))}


def module_imports(tree: ast.Module, modules: set[str], module: str, is_package: bool = False,
             annotations: bool = False) -> set[str]:
    """Modules of the package ``tree`` imports (``from pkg import sub`` counts as ``pkg.sub``
    when ``pkg.sub`` is a module, else as ``pkg``; a string constant only when it names a module)."""
    found = set()
    for base, names, certain in import_statements(tree, module, is_package, annotations):
        if certain:
            found.update({f"{base}.{a}" for a in names} & modules or {base})
        elif base in modules:
            found.add(base)
    return {m for m in found if in_roots(m, ("megatron_async",))}


def sources() -> dict[str, Path]:
    return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in PACKAGE.rglob("*.py")}


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A source file's tree, parsed once per run (the checks only walk it)."""
    return ast.parse(path.read_text())


@functools.cache
def _read_graph(annotations: bool) -> dict[str, frozenset[str]]:
    found = sources()
    return {name: frozenset(module_imports(parsed(path), set(found), name, path.name == "__init__.py", annotations))
            for name, path in found.items()}


def import_graph(annotations: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``annotations``: TYPE_CHECKING imports too): a
    fresh copy of the graph read once per run, which a test may plant imports in."""
    return {name: set(imports) for name, imports in _read_graph(annotations).items()}


def in_roots(module: str, roots: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``roots`` or inside one."""
    return any(module == r or module.startswith(r + ".") for r in roots)


def library_trees() -> dict[str, tuple[ast.Module, bool]]:
    """Module -> (its syntax tree, whether it is a package's ``__init__``)."""
    return {name: (parsed(path), path.name == "__init__.py") for name, path in sources().items()}
