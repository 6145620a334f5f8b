"""Triton's CPU interpreter without re-patching ``triton.language`` at every device-function call.

A kernel launch (``GridExecutor.__call__``) swaps the language's builtins for interpreted ones
and restores them when the grid is done. Every call of a ``@triton.jit`` helper inside the
kernel (``InterpretedFunction.__call__``) patches them again: ``inspect.getmembers`` over
``tl``, ``tl.tensor``, ``tl.math`` and ``tl.core``, about 5 ms a call, finding nothing left to
patch when the helper sees the same language modules as the running kernel, and its scope is
never restored. That was ~40 % of the interpreted sampler's time. Here a launch patches each
language module once: a helper that sees one the launch has not patched yet (tl.core, from
Triton's own helpers) patches as before, once, and a call outside a launch is left alone. Imports nothing of megatron_async, like interpreter_dot."""
from __future__ import annotations

import inspect


def skip_repatching_in_device_calls() -> None:
    """Idempotent; a no-op without triton or with an interpreter of another shape."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    grid, fn_cls = getattr(interpreter, "GridExecutor", None), getattr(interpreter, "InterpretedFunction", None)
    if grid is None or fn_cls is None or not hasattr(fn_cls, "rewrite") or getattr(fn_cls.__call__, "skips_patch", False):
        return
    languages = (tl, tl.core)
    patched: list[frozenset[int]] = []  # the language modules each running launch patched, innermost last
    seen: dict[int, frozenset[int]] = {}

    def langs_of(fn) -> frozenset[int]:
        key = id(fn)
        if key not in seen:
            seen[key] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in languages)
        return seen[key]

    launch = grid.__call__

    def launch_and_track(self, *args, **kwargs):
        patched.append(langs_of(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    call = fn_cls.__call__

    def call_without_repatching(self, *args, **kwargs):
        if not patched:  # outside a launch: as Triton does
            return call(self, *args, **kwargs)
        langs = langs_of(self.fn)
        if not langs <= patched[-1]:  # e.g. tl.core from triton's own helpers: patched once per launch
            interpreter._patch_lang(self.fn)  # its scope is never restored, as in Triton's own call
            patched[-1] = patched[-1] | langs
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    call_without_repatching.skips_patch = True
    grid.__call__ = launch_and_track
    fn_cls.__call__ = call_without_repatching
