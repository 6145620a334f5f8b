"""Nothing that reaches a socket is unpickled: no module of the package uses pickle, by any
spelling. ``ALLOWED`` holds one file, which writes ``marshal`` bytes and loads none (the server's
front-end processes and their engine process speak the wire too, and their settings travel as
JSON); a file may join it only with the reason its pickle never crosses a socket. Read from the source with test_import_graph.py's import reader
(tests/helpers/import_reader.py, which sees every spelling of an import: relative, lazy,
``importlib`` / ``__import__`` with a literal name).

What counts as pickle: importing a module that unpickles (``pickle``, ``cloudpickle``, ``dill``,
``shelve``, ``marshal``, ``joblib``, ``multiprocessing.connection`` / ``.managers`` /
``.reduction``), a call that unpickles what a peer sent (ZMQ's ``recv_pyobj`` / ``send_pyobj``,
``torch.distributed``'s ``*_object`` / ``*_object_list`` collectives, pandas' pickles),
``torch.load`` without ``weights_only=True`` and ``numpy.load`` with ``allow_pickle=True``. The
project's sockets speak its own wire (inference/communication/wire.py: msgpack, checked readers)."""
from __future__ import annotations

import ast

from tests.helpers.import_reader import PACKAGE, imported_names

UNPICKLING_MODULES = ("pickle", "_pickle", "cPickle", "cloudpickle", "dill", "shelve", "marshal", "joblib",
                      "multiprocessing.connection", "multiprocessing.managers", "multiprocessing.reduction")
UNPICKLING_CALLS = frozenset({
    "recv_pyobj", "send_pyobj", "all_gather_object", "gather_object", "broadcast_object_list",
    "scatter_object_list", "send_object_list", "recv_object_list", "read_pickle", "to_pickle"})
TORCH_LOADS = ("torch.load", "torch.serialization.load")

ALLOWED: dict[str, str] = {
    "weight_transfer/ipc.py": "marshal.dumps only: a payload's tensor entries as bytes, compared with those of the "
                              "entries checked last (nothing is ever loaded)",
}
"""Files of megatron_async/ that may use pickle, and why their pickle never touches a network socket."""


def _in(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def _keyword(call: ast.Call, name: str, missing=None):
    """The literal value of keyword ``name`` (``missing`` when absent, "computed" when not a literal)."""
    kw = next((k for k in call.keywords if k.arg == name), None)
    if kw is None:
        return missing
    return kw.value.value if isinstance(kw.value, ast.Constant) else "computed"


def pickle_uses(tree: ast.Module, module: str, is_package: bool = False) -> list[str]:
    """What in ``tree`` (the source of ``module``) unpickles, or may: each as a short label."""
    found = sorted({f"import {n}" for n in imported_names(tree, module, is_package) if _in(n, UNPICKLING_MODULES)}
                   | {f"import {n}" for n in imported_names(tree, module, is_package) if n in TORCH_LOADS})
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        name = node.func.attr if isinstance(node.func, ast.Attribute) else func
        if name in UNPICKLING_CALLS:
            found.append(f"{func}()")
        elif func in TORCH_LOADS and _keyword(node, "weights_only") is not True:
            found.append(f"{func}() without weights_only=True")
        elif func in ("np.load", "numpy.load") and _keyword(node, "allow_pickle", False) is not False:
            found.append(f"{func}(allow_pickle=...)")
    return found


def package_pickle_uses() -> dict[str, list[str]]:
    """File (relative to megatron_async/) -> its pickle uses, for every file that has any."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        module = ".".join(("megatron_async", *rel.with_suffix("").parts)).removesuffix(".__init__")
        if uses := pickle_uses(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            out[rel.as_posix()] = uses
    return out


def test_no_module_uses_pickle_outside_the_allow_list():
    found = package_pickle_uses()
    assert {f: u for f, u in found.items() if f not in ALLOWED} == {}, (
        "pickle in a module of the package: speak the wire (inference/communication/wire.py, msgpack) on "
        "anything another process can reach, or add the file to ALLOWED with why no socket carries it")
    assert sorted(set(ALLOWED) - set(found)) == [], "these files no longer use pickle: drop them from ALLOWED"


def test_every_spelling_of_pickle_is_seen():
    module = "megatron_async.serve.app"
    plants = [
        "import pickle", "import cloudpickle as cp", "from pickle import loads", "from _pickle import Unpickler",
        "def f():\n    import dill", "from . import pickle_free\nimport shelve",
        "import importlib\nimportlib.import_module('pickle')", "x = __import__('marshal')",
        "from multiprocessing.connection import Listener", "from multiprocessing import connection",
        "import multiprocessing.managers", "msg = sock.recv_pyobj()", "sock.send_pyobj(x)",
        "dist.all_gather_object(out, x)", "torch.distributed.broadcast_object_list(xs, src=0)",
        "state = torch.load(path)", "state = torch.load(path, weights_only=False)", "from torch import load",
        "a = np.load(p, allow_pickle=True)", "if TYPE_CHECKING:\n    import pickle",
    ]
    for source in plants:
        assert pickle_uses(ast.parse(source), module), source
    safe = ("import json\njson.loads(s)", "state = torch.load(path, weights_only=True)", "a = np.load(p)",
            "a = numpy.load(p, allow_pickle=False)", "comm.broadcast_object(x, codec)", "import msgpack",
            "'''pickle is not used here'''\n# import pickle", "from .pickle_free import x", "import picklez")
    for source in safe:
        assert pickle_uses(ast.parse(source), module) == [], source
