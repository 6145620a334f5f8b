"""No file over 400 lines and no library function over 80: a file holds one responsibility and a
function one step of it (split by responsibility, not by cutting in the middle). Checked on the
source of every module under ``megatron_async/`` (a file's lines, and every function's lines
from its ``def`` to its last line, decorators aside) and on the lines of every Python file of the
benchmarks, tests, scripts and examples. Nested functions, methods and Triton
``@triton.jit`` functions count too: each on its own, and inside the function that holds it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_async"

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80

def file_lines(source: str) -> int:
    return len(source.splitlines())


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """Qualified name (``Class.method.inner``) -> lines, of every function longer than ``limit``."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and (n := child.end_lineno - child.lineno + 1) > limit:
                    found[name] = n
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _library_sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_no_library_file_over_400_lines():
    big = {rel: n for rel, src in _library_sources() if (n := file_lines(src)) > MAX_FILE_LINES}
    assert not big, f"files over {MAX_FILE_LINES} lines (split them by responsibility): {big}"


def _repository_sources():
    """Every Python file of the checkout outside the package too (benchmarks, tests, scripts,
    examples): a file of measurement or test code holds one responsibility as well."""
    for folder in ("benchmarks", "tests", "scripts", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_no_benchmark_test_or_script_file_over_400_lines():
    big = {rel: n for rel, src in _repository_sources() if (n := file_lines(src)) > MAX_FILE_LINES}
    assert not big, f"files over {MAX_FILE_LINES} lines (split them by responsibility): {big}"


def test_no_library_function_over_80_lines():
    long = {f"{rel}:{name}": n for rel, src in _library_sources() for name, n in long_functions(src).items()}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into steps with a meaning): {long}"


def _function(name: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    return f"{indent}def {name}():\n{body}"


def test_the_checks_see_planted_oversize():
    """Each spelling of a long function is caught: top level, async, a method, a nested function
    (named on its own besides its parent), a decorated Triton-style kernel; 80 lines pass, 81 do
    not; a file of 401 lines is over."""
    assert long_functions(_function("fits", 79)) == {}  # def line + 79 = 80 lines
    assert long_functions(_function("top", 80)) == {"top": 81}
    assert long_functions("async " + _function("coro", 80)) == {"coro": 81}
    method = "class Room:\n" + _function("method", 80, indent="    ")
    assert long_functions(method) == {"Room.method": 81}
    nested = "def outer():\n" + _function("inner", 80, indent="    ") + "    return inner\n"
    assert long_functions(nested) == {"outer": 83, "outer.inner": 81}
    kernel = "@triton.jit\n" + _function("_kernel", 80)
    assert long_functions(kernel) == {"_kernel": 81}  # the decorator line does not count
    assert file_lines("x = 1\n" * 401) == 401 > MAX_FILE_LINES
