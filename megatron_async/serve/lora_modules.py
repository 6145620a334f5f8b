"""``--lora-modules NAME=PATH [NAME=PATH ...]`` (vLLM's flag): the LoRA adapters the server loads
before it serves, each a PEFT adapter directory served under its name (a request's ``model``).
The flag turns ``--enable-lora`` on. Their names and directories are checked before the model is
built, the adapters themselves once it is (every tensor-parallel rank loads them); a bad one stops
the start with its reason (docs/LORA.md)."""
from __future__ import annotations

import argparse
import os


def lora_module(text: str) -> tuple[str, str]:
    """argparse type of one ``NAME=PATH``."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH (an adapter's name and its PEFT directory)")
    return name.strip(), path.strip()


def add_lora_module_args(g) -> None:
    g.add_argument("--lora-modules", nargs="+", type=lora_module, default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) loaded before serving, each served under NAME (a request's "
                        "model); turns --enable-lora on. POST /v1/load_lora_adapter loads more (admin endpoints)")


def resolve_lora_args(args: argparse.Namespace, served: str) -> str | None:
    """``--lora-modules`` turns ``--enable-lora`` on; why the server must not start with them (None:
    it may). ``served``: the served model's name, which no adapter may take."""
    modules = args.lora_modules or []
    if modules and args.engine:
        return "--lora-modules needs an engine in this process: with --engine, the engines load their own adapters"
    if modules:
        args.enable_lora = True
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        return f"--lora-modules names an adapter twice: {sorted(n for n in set(names) if names.count(n) > 1)}"
    for name, path in modules:
        if name == served:
            return f"--lora-modules {name}={path}: {name!r} is the served model's name (--served-model-name)"
        if not os.path.isdir(path):
            return f"--lora-modules {name}={path}: {path!r} is not a directory (a PEFT adapter's)"
    return None


def load_lora_modules(llm, args: argparse.Namespace) -> str | None:
    """Load ``--lora-modules`` into ``llm``; why one could not be loaded (None: all were)."""
    from megatron_async.models.lora import LoRAError

    for name, path in args.lora_modules or []:
        try:
            llm.load_lora(name, path)
        except (LoRAError, OSError) as e:
            return f"--lora-modules {name}={path}: {e}"
    return None
