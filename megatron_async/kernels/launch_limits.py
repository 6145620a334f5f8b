"""Whether a kernel's launch settings fit the device, and the one rule every tile table follows
where they do not.

A Triton launch whose pipeline stages need more shared memory than the device grants one block
fails (``OutOfResources``) on every call; the tables in kernels/ are tuned on one device and one
operand type, yet a shape, a dtype (4-byte operands take twice the bytes) or a smaller device
reaches them. ``fit`` checks a table's choice against ``DeviceLimits`` and falls back to the same
tiles with fewer stages (the same arithmetic, so the same bits), then to the table's smaller
entries, never to anything bigger; where nothing fits it raises ``LaunchLimitError`` naming the
need and the limit instead of failing inside the compiler.

The estimate is an upper bound on what Triton allocates: every stage holds its operand tiles in
the type they are loaded in (Triton's pipeliner keeps one stage fewer in flight; the spare stage
covers the bytes it adds, such as a layout conversion of a dot operand), and the epilogue (the
accumulator staged for its layout change or a TMA store) runs after the loop's buffers are free.
Limits are plain numbers, so a CPU test can ask what an H100 would pick for fp32 operands."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch

from megatron_async.kernels import cuda_device

T = TypeVar("T")


@dataclass(frozen=True)
class DeviceLimits:
    """What one block of a launch may use."""
    shared_memory: int | None
    """Opt-in shared memory per block, bytes; None: no limit (Triton's CPU interpreter)."""
    registers: int = 65_536
    """32-bit registers of the SM's file (sm_80 / sm_90): a block's threads share them."""
    thread_registers: int = 255
    """Registers one thread may address."""


H100 = DeviceLimits(232_448)
A100 = DeviceLimits(166_912)
INTERPRETER = DeviceLimits(None)


def device_limits(device: torch.device) -> DeviceLimits:
    """The limits of ``device`` as its driver reports them (none off CUDA)."""
    if device.type != "cuda":
        return INTERPRETER
    return DeviceLimits(cuda_device.shared_memory_optin(device))


@dataclass(frozen=True)
class Footprint:
    """What one program of a tiled loop holds on chip."""
    stage_bytes: int
    """Shared memory of one pipeline stage: the operand tiles of one step of the loop."""
    num_stages: int
    num_warps: int
    accumulators: int
    """float32 values the loop carries in registers (output tiles), spread over the block's threads."""
    resident_bytes: int = 0
    """Shared memory held through the whole loop (an attention program's query tile)."""
    epilogue_bytes: int = 0
    """Shared memory the epilogue stages once the loop's buffers are free."""

    @property
    def shared_bytes(self) -> int:
        return max(self.resident_bytes + self.num_stages * self.stage_bytes, self.epilogue_bytes)

    @property
    def accumulator_registers(self) -> int:
        """Registers per thread the accumulators alone take (each value lives in one thread)."""
        threads = 32 * self.num_warps
        return -(-self.accumulators // threads)


def gemm_footprint(block_m: int, block_n: int, block_k: int, num_stages: int, num_warps: int,
                   a_bytes: int, b_bytes: int, b_tiles: int = 1, out_bytes: int = 4) -> Footprint:
    """A tiled GEMM: per stage a [block_m, block_k] A tile and ``b_tiles`` [block_k, block_n] B tiles
    (gate and up: 2), one float32 accumulator per B tile, an epilogue staging one [block_m, block_n]
    output tile of ``out_bytes`` (its stored type; 4: the float32 accumulator itself)."""
    return Footprint(stage_bytes=block_k * (block_m * a_bytes + b_tiles * block_n * b_bytes), num_stages=num_stages,
                     num_warps=num_warps, accumulators=b_tiles * block_m * block_n,
                     epilogue_bytes=block_m * block_n * out_bytes)


def attention_footprint(rows: int, block_n: int, block_d: int, num_stages: int, num_warps: int,
                        q_bytes: int, kv_bytes: int) -> Footprint:
    """A flash-attention program: a [rows, block_d] query tile and the [rows, block_n] probabilities
    (the second dot's operand) held throughout, per stage one key and one value tile
    [block_n, block_d]; the output and the scores accumulate in float32."""
    return Footprint(stage_bytes=2 * block_n * block_d * kv_bytes, num_stages=num_stages, num_warps=num_warps,
                     accumulators=rows * (block_d + block_n),
                     resident_bytes=rows * block_d * q_bytes + rows * block_n * max(q_bytes, kv_bytes))


class AttentionTiles(NamedTuple):
    rows: int
    """Matrix rows of a program (query tokens x the group's heads)."""
    block_n: int
    num_stages: int


def attention_tiles(rows: int, block_n: int, block_d: int, num_stages: int, num_warps: int, q_bytes: int,
                    kv_bytes: int, limits: DeviceLimits, smaller: Sequence[tuple[int, int]] = ()) -> AttentionTiles:
    """(rows, keys a tile, stages) of an attention launch: the given ones where ``limits`` hold them,
    else fewer stages, then the (rows, keys) of ``smaller`` (a kernel whose tiles fix its summation
    order passes none)."""
    def footprint(t: AttentionTiles) -> Footprint:
        return attention_footprint(t.rows, t.block_n, block_d, t.num_stages, num_warps, q_bytes, kv_bytes)
    table = tuple(AttentionTiles(r, n, num_stages) for r, n in smaller if r <= rows and n <= block_n)
    return fit(AttentionTiles(rows, block_n, num_stages), footprint, limits, table)


def refusal(footprint: Footprint, limits: DeviceLimits) -> str | None:
    """Why ``footprint`` cannot launch within ``limits`` (None: it can). Registers: accumulators past
    a thread's share of the file cannot stay in registers and spill to local memory every step."""
    if limits.shared_memory is not None and footprint.shared_bytes > limits.shared_memory:
        return f"{footprint.shared_bytes:,} bytes of shared memory > {limits.shared_memory:,}"
    cap = min(limits.thread_registers, limits.registers // (32 * footprint.num_warps))
    if footprint.accumulator_registers > cap:
        return f"{footprint.accumulator_registers} accumulator registers a thread > {cap}"
    return None


def fits(footprint: Footprint, limits: DeviceLimits) -> bool:
    return refusal(footprint, limits) is None


REGISTER_GRANULE = 256
"""Registers are given to a warp in blocks of this many (a thread's count rounded up to 8)."""
MAX_THREADS_AN_SM = 2048
MAX_PROGRAMS_AN_SM = 32


def resident_programs(num_warps: int, thread_registers: int, shared_bytes: int, limits: DeviceLimits) -> int:
    """Programs of one launch an SM holds at once: by its register file (each thread at
    ``thread_registers``, a warp's share rounded to ``REGISTER_GRANULE``), by shared memory
    (``shared_bytes`` a program plus the 1 KB the runtime reserves for each, out of the SM's opt-in
    maximum plus its own reserved KB) and by threads. A persistent kernel launching k programs an SM
    gets the overlap it was tuned for only where this is >= k."""
    per_warp = -(-thread_registers * 32 // REGISTER_GRANULE) * REGISTER_GRANULE
    held = min(limits.registers // (per_warp * num_warps), MAX_THREADS_AN_SM // (32 * num_warps), MAX_PROGRAMS_AN_SM)
    if limits.shared_memory is not None and shared_bytes:
        held = min(held, (limits.shared_memory + 1024) // (shared_bytes + 1024))
    return held


class LaunchLimitError(ValueError):
    """No launch setting of a table fits the device."""


def _with_stages(tiles: T, field: str, stages: int) -> T:
    if dataclasses.is_dataclass(tiles):
        return dataclasses.replace(tiles, **{field: stages})
    return tiles._replace(**{field: stages})  # a NamedTuple


def fit(preferred: T, footprint: Callable[[T], Footprint], limits: DeviceLimits, table: Sequence[T] = (),
        stages: str = "num_stages") -> T:
    """``preferred`` where it fits ``limits``; else the same tiles on fewer stages (field ``stages``),
    then the entries of ``table`` no bigger than ``preferred`` (shared memory per stage, largest
    first), each at the most stages that fit. Raises ``LaunchLimitError`` where none fits."""
    base = footprint(preferred).stage_bytes
    smaller = sorted((t for t in table if t != preferred and footprint(t).stage_bytes <= base),
                     key=lambda t: footprint(t).stage_bytes, reverse=True)
    for tiles in (preferred, *smaller):
        for n in range(getattr(tiles, stages), 0, -1):
            candidate = _with_stages(tiles, stages, n)
            if fits(footprint(candidate), limits):
                return candidate
    raise LaunchLimitError(f"no launch of {preferred} fits the device: "
                           f"{refusal(footprint(_with_stages(preferred, stages, 1)), limits)}")


def check(tiles: T, footprint: Footprint, limits: DeviceLimits) -> T:
    """``tiles`` (an explicit launch: a sweep's or a test's) if ``footprint`` fits, else ``LaunchLimitError``."""
    why = refusal(footprint, limits)
    if why is not None:
        raise LaunchLimitError(f"{tiles} does not fit the device: {why}")
    return tiles
