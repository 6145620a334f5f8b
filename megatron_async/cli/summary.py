"""The end-of-run throughput summary shared by the main job and the benchmark."""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from megatron_async.cli.driver import WorkloadRun
from megatron_async.inference.engines.engine_stats import EngineStats


@dataclass(frozen=True)
class RunSummary:
    requests: int
    finished_requests: int
    failed_requests: int
    output_tokens: int
    wall_time_s: float
    output_tokens_per_s: float
    mean_prefill_step_ms: float
    mean_decode_step_ms: float
    steps: int
    decode_steps: int
    mean_decode_batch: float
    overlap_ratio: float
    drains: int
    paused: int
    evicted: int
    prefix_hit_tokens: int
    peak_gpu_memory_gb: float | None
    """None on CPU."""
    timed_out: bool
    ttft_p50_ms: float | None = None
    """Time to first token (from add_request to the end of the step that delivered it), median."""
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    """Time per output token after the first, per request, median over requests."""
    tpot_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    """Gap between consecutive tokens of a request on the host; p50 / p99 over all gaps."""
    itl_p99_ms: float | None = None
    spec_draft_tokens: int = 0
    """Speculative decoding: drafts verified, and accepted."""
    spec_accepted_tokens: int = 0
    allocator_retries: int = 0
    """``allocator_retries`` over the process's life (start-up included)."""
    builds_after_warmup: int = 0
    """Triton kernels built, and CUDA graphs captured, while serving (the warm-up missed them)."""
    captures_after_warmup: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between ranks; None when empty."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def peak_gpu_memory_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def allocator_retries(device: torch.device) -> int:
    """Allocations the CUDA caching allocator retried after freeing its cache (each a device-wide
    synchronization and frees: memory pressure)."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if device.type == "cuda" else 0


def summarize(run: WorkloadRun, stats: EngineStats, device: torch.device) -> RunSummary:
    done = [o for o in run.outputs if o is not None]
    failed = sum(o.finish_reason == "error" for o in done)
    return RunSummary(
        requests=len(run.outputs),
        finished_requests=len(done) - failed,
        failed_requests=failed,
        output_tokens=run.output_tokens,
        wall_time_s=run.wall_time,
        output_tokens_per_s=run.output_tokens / run.wall_time if run.wall_time > 0 else 0.0,
        mean_prefill_step_ms=stats.mean_prefill_step_ms,
        mean_decode_step_ms=stats.mean_decode_step_ms,
        steps=stats.steps,
        decode_steps=stats.decode_steps,
        mean_decode_batch=run.mean_decode_batch,
        overlap_ratio=stats.overlap_ratio,
        drains=stats.drains,
        paused=stats.paused,
        evicted=stats.evicted,
        prefix_hit_tokens=stats.prefix_hit_tokens,
        peak_gpu_memory_gb=peak_gpu_memory_gb(device),
        allocator_retries=allocator_retries(device),
        timed_out=run.timed_out,
        spec_draft_tokens=stats.spec_draft_tokens,
        spec_accepted_tokens=stats.spec_accepted_tokens,
        builds_after_warmup=stats.triton_builds_after_warmup,
        captures_after_warmup=stats.graph_captures_after_warmup,
        **run.latency_ms(),
    )


def _p50_p99(p50: float | None, p99: float | None) -> str:
    return "n/a" if p50 is None else f"p50 {p50:.1f} ms, p99 {p99:.1f} ms"


def format_summary(s: RunSummary) -> str:
    mem = (f"{s.peak_gpu_memory_gb:.2f} GiB ({s.allocator_retries} allocator retries)"
           if s.peak_gpu_memory_gb is not None else "n/a (cpu)")
    failed = f" ({s.failed_requests} rejected)" if s.failed_requests else ""
    rows = [
        ("requests", f"{s.finished_requests}/{s.requests} finished{failed}" + (" [TIMED OUT]" if s.timed_out else "")),
        ("output tokens", f"{s.output_tokens}"),
        ("wall time", f"{s.wall_time_s:.2f} s"),
        ("output tokens/s", f"{s.output_tokens_per_s:,.1f}"),
        ("TTFT", _p50_p99(s.ttft_p50_ms, s.ttft_p99_ms)),
        ("TPOT", _p50_p99(s.tpot_p50_ms, s.tpot_p99_ms)),
        ("inter-token latency", _p50_p99(s.itl_p50_ms, s.itl_p99_ms)),
        ("mean prefill step", f"{s.mean_prefill_step_ms:.2f} ms"),
        ("mean decode step", f"{s.mean_decode_step_ms:.2f} ms (mean batch {s.mean_decode_batch:.1f})"),
        ("steps", f"{s.steps} ({s.decode_steps} decode-only)"),
        ("overlap ratio", f"{s.overlap_ratio:.1%} of decode steps launched ahead ({s.drains} drains)"),
        ("paused / evicted", f"{s.paused} / {s.evicted}"),
        ("prefix hit tokens", f"{s.prefix_hit_tokens}"),
        ("peak GPU memory", mem),
        ("after warm-up", f"{s.builds_after_warmup} Triton builds, {s.captures_after_warmup} graph captures"),
    ]
    if s.spec_draft_tokens:
        rate = s.spec_accepted_tokens / s.spec_draft_tokens
        rows.insert(-2, ("speculative drafts", f"{s.spec_accepted_tokens}/{s.spec_draft_tokens} accepted ({rate:.1%})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)



def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux /proc, 10 ms ticks); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in ticks since boot
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@dataclass(frozen=True)
class StartupTimes:
    """The main job's start-up on the host clock, from the process's start."""

    entered_s: float | None
    """The job's code starts (Python and its imports before it)."""
    ready_s: float | None
    """The engine is built and warmed up."""
    first_token_s: float | None
    """The first request's first token (requests arrive when every rank's engine is ready)."""
    ranks_wait_s: float = 0.0
    """After ``ready_s``, how long this rank waited for the job's other ranks to end their start-up
    (0 alone); the run's clock starts after it."""


def format_startup(times: StartupTimes, profile) -> str:
    """The start-up profile (``LLM.startup``) under the times from the process's start."""
    def at(x):
        return "n/a" if x is None else f"{x:.1f} s"

    others = f", waited {times.ranks_wait_s:.1f} s for the other ranks" if times.ranks_wait_s >= 0.05 else ""
    rows = [("process start to", f"job code {at(times.entered_s)}, engine ready {at(times.ready_s)}{others}, "
                                  f"first token {at(times.first_token_s)}"),
            ("engine built in", f"{profile.total_seconds:.2f} s (Triton cache {profile.cache_dir or 'n/a'})")]
    rows += [(f"  {name}", value) for name, value in profile.rows()]
    width = max(len(k) for k, _ in rows)
    return "start-up:\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
