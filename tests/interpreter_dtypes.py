"""Triton's CPU interpreter with its tl -> numpy dtype lookup cached.

``interpreter._get_np_dtype`` builds a 19-entry dict of ``tl`` dtypes (each key hashed through
a Python ``__hash__``) at every call, and the interpreter calls it for every cast, splat and
binary op: ~6 % of an interpreted engine step. Here the same table is built once, keyed by the
dtype's name (what ``tl.dtype`` hashes and compares by). Imports nothing of megatron_async, like
interpreter_dot."""
from __future__ import annotations


def cache_interpreter_np_dtypes() -> None:
    """Idempotent; a no-op without triton or with an interpreter of another shape."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or getattr(original, "cached", False):
        return
    by_name: dict[str, object] = {}
    pointer, block = tl.pointer_type, tl.block_type

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, block):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, pointer):
            return original(tt_dtype)
        name = tt_dtype.name
        np_dtype = by_name.get(name)
        if np_dtype is None:
            np_dtype = by_name[name] = original(tt_dtype)  # raises KeyError for an unknown dtype, as before
        return np_dtype

    get_np_dtype.cached = True
    interpreter._get_np_dtype = get_np_dtype
