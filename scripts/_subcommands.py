"""Dispatch of a tool script's subcommands: each subcommand is one file of a folder (name with
dashes for underscores), run as ``__main__`` with the remaining arguments; its summary is the
first line of the file's docstring. The files stay runnable on their own."""
from __future__ import annotations

import ast
import runpy
import sys
import textwrap
from pathlib import Path


def subcommands(folder: Path) -> dict[str, Path]:
    return {p.stem.replace("_", "-"): p for p in sorted(folder.glob("*.py")) if not p.name.startswith("_")}


def summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def dispatch(folder: Path, usage: str) -> None:
    commands = subcommands(folder)
    name = sys.argv[1] if len(sys.argv) > 1 else None
    if name not in commands:
        width = max(map(len, commands))
        lines = [f"  {n:<{width}}  {textwrap.shorten(summary(p), 100)}" for n, p in commands.items()]
        print(f"usage: {usage} SUBCOMMAND [--help | ARGS]\n\nsubcommands:\n" + "\n".join(lines), file=sys.stderr)
        sys.exit(0 if name in ("-h", "--help") else 2)
    path = commands[name]
    root = str(folder.resolve().parents[1])
    sys.argv = [str(path), *sys.argv[2:]]
    # as `python path` would: the file's folder first (sibling imports), then the tree it belongs to
    sys.path[:0] = [str(path.parent), root]
    runpy.run_path(str(path), run_name="__main__")
