"""python -m benchmarks SUBCOMMAND [ARGS]: every measurement of the engine, one subcommand each.

Each subcommand is one module of ``benchmarks/commands/`` (its name with dashes for underscores),
run as ``__main__`` with the remaining arguments; its summary is the first paragraph of the
module's docstring. Run from the repository's root (the ``benchmarks`` package sits beside
``megatron_async``, outside the installed package).

    python -m benchmarks                               # the list of subcommands
    python -m benchmarks side-by-side --smoke          # the side-by-side benchmark on a CPU
    python -m benchmarks host-step --rows 64 128
"""
from __future__ import annotations

import ast
import runpy
import sys
import textwrap
from pathlib import Path

COMMANDS = Path(__file__).resolve().parent / "commands"


def subcommands() -> dict[str, Path]:
    return {p.stem.replace("_", "-"): p for p in sorted(COMMANDS.glob("*.py")) if not p.name.startswith("_")}


def summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def main() -> None:
    commands = subcommands()
    name = sys.argv[1] if len(sys.argv) > 1 else None
    if name not in commands:
        width = max(map(len, commands))
        lines = [f"  {n:<{width}}  {textwrap.shorten(summary(p), 100)}" for n, p in commands.items()]
        print("usage: python -m benchmarks SUBCOMMAND [--help | ARGS]\n\nsubcommands:\n" + "\n".join(lines),
              file=sys.stderr)
        sys.exit(0 if name in ("-h", "--help") else 2)
    sys.argv = [name, *sys.argv[2:]]  # run_module puts the module's path first
    runpy.run_module(f"benchmarks.commands.{commands[name].stem}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
