"""Triton's CPU interpreter without the Python type bookkeeping that changes no result.

Every interpreted op makes a ``tl.tensor`` whose ``__init__`` turns the type's shape into a
``tl.tuple`` of ``constexpr`` (each tuple deriving its ``tuple_type`` value by value), and most
ops build a new ``tl.block_type`` (validating the shape, formatting its name) for a type they
have seen many times: ~25 % of an interpreted sampler's time. Here a shape's constexpr values
and their ``tuple_type`` are made once, and each tensor still gets its own ``tl.tuple`` (a new
list, as before); the builder's ``get_block_ty`` and ``block_type.with_element_ty`` hand back
one ``block_type`` per (element type, shape), an immutable value that is compared by element
type and shape only. Broadcasts of same-rank blocks and scalar splats work on int lists, a binary op
on two tensors of one fp32 / int32 / int64 type and shape skips the type checks that would
change nothing, a cast to a tensor's own type returns it without comparing names, and
comparing a dtype with itself or another plain dtype compares names without unwrapping.
Integer add / sub / mul skip building the overflow check whose ``device_assert`` the
interpreter drops unread (its options never set ``debug``). Imports nothing of megatron_async,
like interpreter_dot."""
from __future__ import annotations

import builtins
import math

import numpy as np


def cache_interpreter_block_types() -> None:
    """Idempotent; a no-op without triton or with an interpreter of another shape."""
    try:
        import triton.language as tl
        from triton.language import core
        from triton.runtime import interpreter
    except ImportError:
        return
    tensor, block_type, builder = core.tensor, core.block_type, getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or getattr(tensor.__init__, "cached_shapes", False):
        return
    if not all(hasattr(cls, name) for cls, name in ((builder, "get_block_ty"), (block_type, "with_element_ty"))):
        return
    constexpr, tl_tuple, tuple_type = core.constexpr, core.tuple, core.tuple_type
    shapes: dict[tuple, tuple] = {}

    def shape_parts(shape: tuple):
        parts = shapes.get(shape)
        if parts is None:
            values = [constexpr(s) for s in shape]
            parts = shapes[shape] = (constexpr(math.prod(shape)), values,
                                     tuple_type([v.type for v in values]))
        return parts

    new_tuple = object.__new__

    def tensor_init(self, handle, type):
        """As ``tl.tensor.__init__``: handle, shape (a tl.tuple of constexpr), numel, type, dtype."""
        self.handle = handle
        if builtins.type(type) is block_type or type.is_block():
            shape = type.shape  # a tl.tuple of ints (hashed and compared in Python): keyed by its values
            key = builtins.tuple(shape.values) if builtins.type(shape) is tl_tuple else builtins.tuple(shape)
        else:
            key = ()
        numel, values, shape_type = shape_parts(key)
        self.numel = numel
        self.type = type
        self.dtype = type.scalar
        shape = new_tuple(tl_tuple)  # what tl.tuple(values, shape_type) makes: its own list, that type
        shape.values = list(values)
        shape.type = shape_type
        self.shape = shape

    blocks: dict[tuple, object] = {}

    def block_of(element_ty, shape):
        # keyed by what block_type.__eq__ compares: the element type (by its class, name and
        # address space: pointer types compare by these) and the shape
        key = (type(element_ty), getattr(element_ty, "name", None), getattr(element_ty, "address_space", None),
               tuple(shape))
        ty = blocks.get(key)
        if ty is None:
            ty = block_type(element_ty, shape)
            if all(type(s) is int for s in key[3]):  # not constexpr dims: those are built each time, as before
                blocks[key] = ty
        return ty

    def get_block_ty(self, dtype, shape):
        return block_of(dtype, shape)

    def with_element_ty(self, scalar_ty):
        return block_of(scalar_ty, self.shape)

    semantic = getattr(interpreter, "interpreter_semantic", None)
    broadcast = getattr(semantic, "broadcast_impl_value", None)
    build = getattr(semantic, "builder", None)

    def broadcast_impl_value(lhs, rhs):
        """Triton's ``broadcast_impl_value`` for two blocks of one rank and for a block and a
        scalar, on the shapes' int lists (Triton compares them as ``tl.tuple``, in Python): the
        same splats and broadcasts, to the same shapes; anything else (ranks to expand,
        incompatible dims and their error) goes through Triton's own."""
        lhs_ty, rhs_ty = lhs.type, rhs.type
        lhs_block, rhs_block = builtins.type(lhs_ty) is block_type, builtins.type(rhs_ty) is block_type
        if lhs_block and rhs_block:
            lhs_shape, rhs_shape = lhs_ty.shape.values, rhs_ty.shape.values
            if lhs_shape == rhs_shape:
                return lhs, rhs
            if len(lhs_shape) != len(rhs_shape):
                return broadcast(lhs, rhs)
            ret_shape = []
            for left, right in zip(lhs_shape, rhs_shape):
                if left == 1:
                    ret_shape.append(right)
                elif right == 1 or right == left:
                    ret_shape.append(left)
                else:
                    return broadcast(lhs, rhs)
            if lhs_shape != ret_shape:
                lhs = semantic.make_tensor(build.create_broadcast(lhs.handle, ret_shape),
                                           block_of(lhs_ty.scalar, ret_shape))
            if rhs_shape != ret_shape:
                rhs = semantic.make_tensor(build.create_broadcast(rhs.handle, ret_shape),
                                           block_of(rhs_ty.scalar, ret_shape))
            return lhs, rhs
        # a scalar splat to the block's shape (create_splat reads only the shape of the type it is given)
        if lhs_block and not rhs_ty.is_block():
            rhs_ty = lhs_ty.with_element_ty(rhs_ty.scalar)
            return lhs, semantic.make_tensor(build.create_splat(rhs_ty, rhs.handle), rhs_ty)
        if rhs_block and not lhs_ty.is_block():
            lhs_ty = rhs_ty.with_element_ty(lhs_ty.scalar)
            return semantic.make_tensor(build.create_splat(lhs_ty, lhs.handle), lhs_ty), rhs
        return broadcast(lhs, rhs)

    if broadcast is not None:
        semantic.broadcast_impl_value = broadcast_impl_value

    type_check, cast = getattr(semantic, "binary_op_type_checking_impl", None), getattr(semantic, "cast", None)
    plain_dtype, same_kind = core.dtype, frozenset({"fp32", "int32", "int64"})

    def binary_op_type_checking_impl(lhs, rhs, *args, **kwargs):
        """Two tensors of one fp32 / int32 / int64 dtype and one shape: Triton's checks find no
        pointer, a computation type equal to theirs (no cast) and nothing to broadcast, so they
        come back as they are; anything else goes through those checks."""
        if builtins.type(lhs) is tensor and builtins.type(rhs) is tensor:
            ld, rd = lhs.dtype, rhs.dtype
            if ld is rd and builtins.type(ld) is plain_dtype and ld.name in same_kind:
                lt, rt = lhs.type, rhs.type
                if lt is rt or (builtins.type(lt) is block_type and builtins.type(rt) is block_type
                                and lt.shape.values == rt.shape.values):
                    return lhs, rhs
        return type_check(lhs, rhs, *args, **kwargs)

    def cast_or_keep(input, dst_ty, *args, **kwargs):
        """A tensor already of the destination's scalar type is returned as it is, as Triton's
        ``cast`` does after comparing the two by name in Python."""
        if builtins.type(input) is tensor and isinstance(dst_ty, plain_dtype) and input.type.scalar is dst_ty.scalar:
            return input
        return cast(input, dst_ty, *args, **kwargs)

    if type_check is not None and cast is not None:
        semantic.binary_op_type_checking_impl = binary_op_type_checking_impl
        semantic.cast = cast_or_keep
    sanitize = getattr(semantic, "binary_op_sanitize_overflow_impl", None)
    options = getattr(getattr(semantic, "builder", None), "options", None)

    def binary_op_sanitize_overflow_impl(lhs, rhs, binary_op):
        """Without ``debug`` (the interpreter's options never set it) Triton's overflow check ends in
        a ``device_assert`` that returns at once: the int64 copies, the op and the range test it
        builds before are dropped unread. Its two type assertions are kept; with ``debug``, Triton's."""
        if options.debug:
            return sanitize(lhs, rhs, binary_op)
        lhs_sca_ty, rhs_sca_ty = lhs.type.scalar, rhs.type.scalar
        if lhs_sca_ty.int_bitwidth >= 64 or not options.sanitize_overflow:
            return
        assert lhs_sca_ty == rhs_sca_ty, f"expected matching operand types, got {lhs_sca_ty} and {rhs_sca_ty}"
        assert lhs_sca_ty.is_int(), f"expected integer type, got {lhs_sca_ty}"

    if sanitize is not None and hasattr(options, "debug") and hasattr(options, "sanitize_overflow"):
        semantic.binary_op_sanitize_overflow_impl = binary_op_sanitize_overflow_impl

    convert = getattr(interpreter, "_convert_float", None)
    tables: dict[tuple, object] = {}

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        """Triton's ``_convert_float`` (bit by bit, each element from its own bits alone) read from
        a table of its own outputs for every 8- or 16-bit input, built once per conversion."""
        bits = input_dtype.primitive_bitwidth
        if bits not in (8, 16) or input.dtype.itemsize * 8 != bits:
            return convert(input, input_dtype, output_dtype, rounding_mode)
        as_bits = np.dtype(f"uint{bits}")
        key = (input_dtype.name, output_dtype.name, rounding_mode)
        table = tables.get(key)
        if table is None:
            table = tables[key] = convert(np.arange(1 << bits, dtype=as_bits), input_dtype, output_dtype,
                                          rounding_mode)
        return table[np.ascontiguousarray(input).view(as_bits)].reshape(input.shape)

    if convert is not None:
        interpreter._convert_float = convert_float

    dtype_eq = plain_dtype.__eq__

    def dtype_equal(self, other) -> bool:
        """``tl.dtype.__eq__`` (names compared) without unwrapping a plain dtype or itself."""
        if self is other:
            return True
        if builtins.type(other) is plain_dtype:
            return self.name == other.name
        return dtype_eq(self, other)

    plain_dtype.__eq__ = dtype_equal
    tensor_init.cached_shapes = True
    tensor.__init__ = tensor_init
    builder.get_block_ty = get_block_ty
    block_type.with_element_ty = with_element_ty
    assert tl.tensor is tensor
