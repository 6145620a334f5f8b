"""The end-of-run throughput summary shared by the main job and the benchmark."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from megatron_async.inference.engines.engine_stats import EngineStats
from megatron_async.tools.driver import WorkloadRun


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
    """Arrival (``add_request``) to first token on the host; p50 / p99 over requests."""
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    """Gap between consecutive tokens of a request on the host; p50 / p99 over all gaps."""
    itl_p99_ms: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def peak_gpu_memory_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


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
        timed_out=run.timed_out,
        **run.latency_ms(),
    )


def format_summary(s: RunSummary) -> str:
    mem = f"{s.peak_gpu_memory_gb:.2f} GiB" if s.peak_gpu_memory_gb is not None else "n/a (cpu)"
    failed = f" ({s.failed_requests} rejected)" if s.failed_requests else ""
    rows = [
        ("requests", f"{s.finished_requests}/{s.requests} finished{failed}" + (" [TIMED OUT]" if s.timed_out else "")),
        ("output tokens", f"{s.output_tokens}"),
        ("wall time", f"{s.wall_time_s:.2f} s"),
        ("output tokens/s", f"{s.output_tokens_per_s:,.1f}"),
        ("mean prefill step", f"{s.mean_prefill_step_ms:.2f} ms"),
        ("mean decode step", f"{s.mean_decode_step_ms:.2f} ms (mean batch {s.mean_decode_batch:.1f})"),
        ("steps", f"{s.steps} ({s.decode_steps} decode-only)"),
        ("overlap ratio", f"{s.overlap_ratio:.1%} of decode steps launched ahead ({s.drains} drains)"),
        ("TTFT p50 / p99", f"{_ms(s.ttft_p50_ms)} / {_ms(s.ttft_p99_ms)}"),
        ("inter-token p50 / p99", f"{_ms(s.itl_p50_ms)} / {_ms(s.itl_p99_ms)}"),
        ("paused / evicted", f"{s.paused} / {s.evicted}"),
        ("prefix hit tokens", f"{s.prefix_hit_tokens}"),
        ("peak GPU memory", mem),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f} ms"
