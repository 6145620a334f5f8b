"""Startup warm-up: build every Triton kernel variant a configuration can reach and capture
every CUDA graph it can replay, before the first request, so serving never compiles or captures.

Triton builds a kernel once per specialization: its constexpr arguments (tile sizes picked
from shapes, the decode kernel's split count, the sampler's filter / mass flags) and its
integer arguments' classes (== 1, divisible by 16, other). A step's sizes reach kernels only
as the token count T and the row count R, so eager warm-up runs steps on padding snapshots
(dummy KV block, padding state slot) over:
- decode steps at one row count per class of (R == 1, R % 16, next power of two, decode
  split count);
- one-row mixed steps at token counts 1 .. max_tokens around every power of two (p - 1, p,
  p + 16), which covers every class of T and every T-derived tile choice (fused MoE blocks);
- every sampling variant (greedy, temperature, filtered, full: penalties + log-probs) once for
  decode and once for a mixed step;
- a LoRA engine: the greedy decode and mixed steps again without the LoRA ops (the base
  forward of steps where no row has an adapter);
- speculative decoding: one window of each length 2 .. K + 1, a window beside a multi-token
  row (the eager layout of verify rows next to a prefill chunk) and, with graphs, uniform
  verify steps (every row W tokens and samples, the verify graphs' layout) of each captured
  width W at the decode row counts.
Then the graph runner captures its whole plan (graph_plan.py). Under expert parallelism only
the collective runner's graphs are captured (every rank at once: collectives inside), with no
eager pass; with ``build_threads`` their shapes are first captured dry, the exchanges stood in
for, and their kernels built at once, split over the host's ranks (collective_prebuild.py); after
such a whole pass on every rank they too capture without their eager runs, a failed capture
retried by every rank together (capture_agreement.py).

With ``build_threads`` (CUDA, Triton), the eager shapes are first captured dry and their kernels
built on that many threads (kernel_prebuild.py): when the memory profile sized the KV pool, its
probe context's dry pass did that already (one pass of compiles, memory_profiling.py), and the
warm-up captures only two of those shapes again, to check that this context meets no other
kernel. Only shapes that could not be captured dry then run eagerly, and the graphs are captured
without running their steps first (the dry pass showed that the steps capture as they are;
otherwise each graph's step runs once before its capture).
Every kernel an eager step can meet is built and loaded."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from megatron_async.inference import triton_builds
from megatron_async.inference.text_generation_controllers.collective_prebuild import (
    prebuild_collective, wants_collective_prebuild,
)
from megatron_async.inference.text_generation_controllers.graph_plan import SamplingVariant, variant_flags
from megatron_async.inference.text_generation_controllers.kernel_list import build_share, prebuild_listed
from megatron_async.inference.text_generation_controllers.kernel_prebuild import PrebuildReport
from megatron_async.step_shape import StepShape

log = logging.getLogger("megatron_async")


@dataclass
class WarmupReport:
    seconds: float
    eager_steps: int
    graphs_captured: int
    triton_builds: int
    """Kernel builds during warm-up (0 where Triton has no build hook, e.g. the CPU interpreter)."""
    memory_bytes: int
    """Growth of the device memory the caching allocator reserved (graph pools, sampler state)."""
    prebuild: PrebuildReport | None = None
    """The threaded build of the eager shapes' kernels (None: not done)."""
    eager_seconds: float = 0.0
    """The eager steps (with the kernel builds they made)."""
    capture_seconds: float = 0.0
    """The graph captures (each with one eager run of its step first, unless counted in
    ``captures_without_eager_run``)."""
    capture_builds: int = 0
    """Triton builds during the captures (kernels no eager shape reached)."""
    captures_without_eager_run: int = 0
    """Graphs captured without running their step first (after a whole dry pass)."""
    capture_retries: int = 0
    """Graphs captured again after an eager run because a capture without one failed (under expert
    parallelism: on any rank, every rank retrying it together)."""


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def decode_row_counts(max_rows: int, split_count=None) -> list[int]:
    """One row count per compile class in 1 .. max_rows (``split_count(R)``: the decode
    attention's split count, a constexpr of its kernel)."""
    seen, out = set(), []
    for r in range(1, max_rows + 1):
        cls = (r == 1, r % 16 == 0, _next_pow2(r), split_count(r) if split_count else None)
        if cls not in seen:
            seen.add(cls)
            out.append(r)
    return out


def mixed_token_counts(max_tokens: int) -> list[int]:
    counts, p = {1, 2, max_tokens}, 2
    while p <= 2 * max_tokens:
        counts |= {p - 1, p, p + 16}
        p *= 2
    return sorted(c for c in counts if 2 <= c <= max_tokens)


def warmup_shape(tokens: int, rows: int, decode: bool, variant: SamplingVariant, vocab: int) -> StepShape:
    """The shape of a padded step of ``tokens`` over ``rows`` sampling ``variant``: what the warm-up
    runs and captures, and memory profiling's largest step."""
    f = variant_flags(variant, vocab)
    return StepShape(num_tokens=tokens, num_rows=rows, max_query_len=tokens - rows + 1, max_kv_len=1,
                     is_decode_only=decode, any_sampling=f.any_sampling, any_top_k_top_p=any(f.filters),
                     filters=f.filters, max_top_n=f.max_top_n, any_log_probs=f.any_log_probs,
                     any_penalties=f.any_penalties)


def _verify_shape(rows: int, width: int, drafts: list[int], vocab: int, uniform: bool) -> StepShape:
    """``rows`` rows of ``width`` tokens and samples each (the padding snapshot of that width);
    ``drafts``: the drafts each row verifies; ``uniform``: the verify-graph layout."""
    shape = warmup_shape(rows * width, rows, False, SamplingVariant.GREEDY, vocab)
    shape.max_query_len = width
    shape.num_samples, shape.sample_base, shape.num_drafts = rows * width, list(range(0, rows * width, width)), drafts
    shape.verify_width = width if uniform else 0
    shape.num_multi_rows = sum(k == 0 for k in drafts)  # rows of `width` tokens that verify nothing
    return shape


def verify_shapes(runner, split=None) -> list[tuple[StepShape, int]]:
    """Speculative decoding's eager shapes, each with the width of its padding snapshot."""
    ctx, vocab = runner.context, runner.model.vocab_size
    K = ctx.num_speculative_tokens
    if K == 0:
        return []
    W = K + 1
    out = [(_verify_shape(1, k + 1, [k], vocab, False), k + 1) for k in range(1, K + 1)]
    if 2 * W <= ctx.max_tokens:  # a window beside a multi-token row that verifies nothing
        out.append((_verify_shape(2, W, [K, 0], vocab, False), W))
    widths = runner.graphs.plan.verify_sizes if runner.graphs is not None else {}
    for w, sizes in widths.items():  # the verify graphs' layouts, also run eager (a variant without a graph)
        out += [(_verify_shape(r, w, [w - 1] * r, vocab, True), w) for r in decode_row_counts(sizes[-1], split)]
    return out


def eager_shapes(runner) -> list[tuple[StepShape, int]]:
    """(shape, verify width of its padding snapshot: 0 = one token per row, the rest to the last)."""
    ctx, vocab = runner.context, runner.model.vocab_size
    split = _decode_split_count(runner)
    shapes = [warmup_shape(r, r, True, SamplingVariant.GREEDY, vocab) for r in decode_row_counts(ctx.max_requests, split)]
    shapes += [warmup_shape(t, 1, t == 1, SamplingVariant.GREEDY, vocab) for t in mixed_token_counts(ctx.max_tokens)]
    if ctx.lora_skips:  # steps without adapter rows run the base forward (the fused kernels LoRA's path skips)
        shapes += [replace(s, any_lora=False) for s in shapes]
    if ctx.long_tile_min_query:  # steps with a long row run the prefill attention's long-row launch
        shapes += [replace(s, long_tiles=True) for s in shapes if s.num_tokens >= ctx.long_tile_min_query > 1]
    for v in list(SamplingVariant)[1:]:
        shapes += [warmup_shape(2, 2, True, v, vocab), warmup_shape(3, 2, False, v, vocab)]
    return [(s, 0) for s in shapes] + verify_shapes(runner, split)


def _decode_split_count(runner):
    """The Triton decode kernel's split count as a function of rows (None: another backend)."""
    ctx = runner.context
    if not runner.model.kernels.triton_attention or not ctx.device.is_cuda:
        return None
    from megatron_async.kernels.decode_splits import choose_num_splits

    spec = runner.model.kv_cache_spec()
    dev = ctx.device.device
    return lambda r: choose_num_splits(r, spec.num_kv_heads, ctx.max_blocks_per_request, ctx.block_size, dev)


def _left_on_any_rank(shapes: list, left: list, agree) -> list:
    """Of ``shapes``, those any rank's dry pass left to run eagerly (``agree``: the ranks' max;
    None: this rank's ``left``): TP ranks run their eager steps together, each step's
    all-reduces needing every rank."""
    if agree is None:
        return left
    anyone = agree([int(s in left) for s in shapes])
    return [s for s, flag in zip(shapes, anyone) if flag]


def _run_eager(runner, shapes: list) -> None:
    ctx, dev = runner.context, runner.device
    saved = runner.last_samples.clone()
    for shape, width in shapes:
        if shape.any_penalties:
            ctx.sampling_state.ensure_allocated()
        snapshot = ctx.padding_snapshot(shape.num_rows, shape.num_tokens, width)
        ctx.gpu_view.buffer.copy_(snapshot.to(dev.device))
        runner.compute_step(shape)
    runner.last_samples.copy_(saved)


def warm_token_mask(runner) -> None:
    """Build the grammar token-mask kernel for the dtypes the sampler hands it (the model's, and
    float32 after the penalties) when a grammar library is installed."""
    from megatron_async.inference.structured.grammars import any_installed
    from megatron_async.kernels.token_mask import apply_token_bitmask

    if not (runner.sampler.reads_model_dtype and any_installed()):
        return
    dev, vocab = runner.device.device, runner.model.vocab_size
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32, device=dev)
    row_map = torch.zeros(2, dtype=torch.int32, device=dev)
    for dtype in {getattr(runner.model, "dtype", torch.float32), torch.float32}:
        apply_token_bitmask(torch.zeros(2, vocab, dtype=dtype, device=dev), bitmask, row_map, triton=True)


def can_prebuild(runner, build_threads: int) -> bool:
    """Threaded builds need CUDA and a Triton with build hooks."""
    return bool(build_threads) and runner.device.is_cuda and triton_builds.install()


@torch.inference_mode()
def run_warmup(runner, graphs: bool = True, eager: bool = True, build_threads: int = 0,
               built_before=frozenset(), agree=None) -> WarmupReport:
    """Warm ``runner`` up (nothing may be in flight). ``eager``: the eager compile pass (with
    ``build_threads``: its kernels built at once, kernel_prebuild.py, but for the shapes named in
    ``built_before``, built by the memory profile's dry pass); ``graphs``: capture the graph
    runner's plan (when the runner has one). ``agree``: the element-wise max of a list of ints over
    the ranks sharing steps (host-side): with it, a collective runner's graphs too capture without
    their eager runs after a whole dry pass (capture_agreement.py)."""
    dev = runner.device
    triton_builds.install()
    builds0, t0 = triton_builds.builds(), time.perf_counter()
    mem0 = torch.cuda.memory_reserved(dev.device) if dev.is_cuda else 0
    shapes = eager_shapes(runner) if eager else []
    pre = None
    if shapes and can_prebuild(runner, build_threads):
        pre = prebuild_listed(runner, shapes, build_threads, also=lambda: warm_token_mask(runner),
                              built_before=built_before, share=build_share(runner))
        shapes = _left_on_any_rank(shapes, pre.left, agree)
    elif graphs and wants_collective_prebuild(runner) and can_prebuild(runner, build_threads):
        pre = prebuild_collective(runner, build_threads)
    t_eager = time.perf_counter()
    _run_eager(runner, shapes)
    if eager:
        warm_token_mask(runner)  # built by the prebuild's deferral when there was one: launches only
    t_capture, builds_capture = time.perf_counter(), triton_builds.builds()
    captured = skipped = retried = 0
    if graphs and runner.graphs is not None:  # after a whole dry pass, graphs capture without eager runs
        skipped, retried = runner.graphs.captures_without_eager_run, runner.graphs.capture_retries
        built = pre is not None and not pre.left
        if runner.graphs.collective or agree is not None:  # on every rank or on none, and only where a failed
            built = agree is not None and agree([int(not built)])[0] == 0  # capture can be retried by all
        captured = runner.graphs.warmup(built=built, agree=agree)
        skipped = runner.graphs.captures_without_eager_run - skipped
        retried = runner.graphs.capture_retries - retried
    if dev.is_cuda:
        torch.cuda.synchronize(dev.device)
    t_end = time.perf_counter()
    mem = torch.cuda.memory_reserved(dev.device) - mem0 if dev.is_cuda else 0
    if pre is not None and not eager:
        log.info("start-up build under expert parallelism: the dry pass recorded and built %d kernels (%s); the graph "
                 "captures built %d more", pre.kernels, pre.describe(), triton_builds.builds() - builds_capture)
    return WarmupReport(t_end - t0, len(shapes), captured, triton_builds.builds() - builds0, mem, pre,
                        t_capture - t_eager, t_end - t_capture, triton_builds.builds() - builds_capture, skipped,
                        retried)
