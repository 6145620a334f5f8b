"""Benchmark output: the per-(mode, workload) result record, the printed tables, the step-time plot."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

HF_PEERS = ("hf_generate", "hf_generate_static", "hf_generate_batch")


@dataclass
class ModeResult:
    mode: str
    workload: str = "greedy"
    """greedy | sampled (temperature 0.8, top-p 0.95, seeded per request)."""
    status: str = "ok"
    """ok | skipped | timed_out | error"""
    reason: str | None = None
    settings: str = ""
    """What this side ran with (HF: batch size, cache, compile; engine: mode flags)."""
    output_tokens: int = 0
    wall_time_s: float = 0.0
    output_tokens_per_s: float = 0.0
    tokens_per_s_runs: list[float] = field(default_factory=list)
    """Output tokens/s of every timed run (benchmark ``--repeats``); the row is the median run."""
    ratio_to: dict[str, float] = field(default_factory=dict)
    """Output tokens/s over each HF peer's on the same workload."""
    mean_decode_step_ms: float | None = None
    mean_mixed_step_ms: float | None = None
    """Host wall time of steps that bookkept a launch with a prefill chunk (engine modes)."""
    startup_warmup: dict | None = None
    """The engine's startup warm-up: seconds, memory_gib, graphs, triton_builds."""
    mean_decode_batch: float | None = None
    decode_floor_ms: float | None = None
    decode_expert_share: float | None = None
    """MoE: the share of routed experts' weights the decode floor counts, measured by routing
    replay for a step of ``mean_decode_batch`` rows (``benchmarks/active_experts.py``)."""
    step_over_floor: float | None = None
    mixed_floor_ms: float | None = None
    """Floor of a mean mixed step (``roofline.mixed_floor``): its least FLOPs (its prefill tokens'
    matmuls and causal attention; MoE: each token through its top-k experts) at the measured matmul
    rate, plus its weights read once and its rows' KV read and written, at the copy bandwidth."""
    mixed_flop_floor_ms: float | None = None
    """The FLOPs' part of ``mixed_floor_ms``."""
    mixed_over_floor: float | None = None
    latency_ms: dict[str, float | None] = field(default_factory=dict)
    """ttft_p50_ms, ttft_p99_ms, itl_p50_ms, itl_p99_ms (engine modes)."""
    run_idle_share: float | None = None
    """Device idle share of the whole profiled second run (CUPTI intervals); None on CPU."""
    decode_idle_share: float | None = None
    """Device idle share of the profiled run's decode-only launch windows; None on CPU."""
    profiled_tokens_per_s: float | None = None
    """Throughput of the profiled second run (shows how much the profiler perturbed it)."""
    idle_profile: dict | None = None
    same_tokens_as_serial: float | None = None
    """Share of requests whose tokens equal the serial engine's on the same workload (graph modes:
    the serial graphs mode's; other modes: the eager serial one's)."""
    first_step_ms: float | None = None
    max_step_ms: float | None = None
    slow_steps: int = 0
    """Steps slower than 5x the median step of their kind (decode-only / mixed): compiles, captures."""
    triton_builds: int | None = None
    """Triton kernel builds (compile or disk-cache load) inside the timed run; None without Triton hooks."""
    graph_captures: int | None = None
    built_kernels: list[str] = field(default_factory=list)
    """Names of the Triton kernels built inside the timed run (first 20)."""
    summary: dict | None = None
    step_times: list[tuple[float, float, bool]] = field(default_factory=list)
    """(seconds since start, step ms, decode-only) per engine step."""

    def as_dict(self) -> dict:
        return asdict(self)


def add_ratios(results: list[ModeResult]) -> None:
    for r in results:
        if r.status not in ("ok", "timed_out"):
            continue
        peers = {p.mode: p.output_tokens_per_s for p in results
                 if p.mode in HF_PEERS and p.workload == r.workload and p.status == "ok" and p.output_tokens_per_s > 0}
        r.ratio_to = {p: r.output_tokens_per_s / v for p, v in peers.items()}


def _fmt(v: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if v is None else format(v * scale, spec)


def _pair(a: float | None, b: float | None, spec: str = ".1f") -> str:
    return "n/a" if a is None and b is None else f"{_fmt(a, spec)}/{_fmt(b, spec)}"


def _best_peer(r: ModeResult) -> str:
    if not r.ratio_to:
        return "n/a"
    best = min(r.ratio_to, key=r.ratio_to.get)  # the fastest peer gives the smallest ratio
    return f"{r.ratio_to[best]:.2f} ({best.removeprefix('hf_generate').strip('_') or 'gen'})"


def _tok_s(r: ModeResult) -> str:
    """The row's tok/s, and the range over its timed runs when there were several."""
    runs = r.tokens_per_s_runs
    spread = f" ({min(runs):,.0f}-{max(runs):,.0f})" if len(runs) > 1 else ""
    return f"{r.output_tokens_per_s:,.1f}{spread}"


def format_table(results: list[ModeResult]) -> str:
    head = ["mode", "workload", "status", "out tok/s", "x best HF", "decode ms", "mixed ms", "batch", "step/floor", "mixed/floor",
            "TTFT p50/p99 ms", "ITL p50/p99 ms", "idle run %", "idle decode %", "prof tok/s", "=serial",
            "builds/captures", "max step ms"]
    rows = [head]
    for r in results:
        if r.status in ("skipped", "error"):
            rows.append([r.mode, r.workload, r.status, (r.reason or "")[:80]])
            continue
        lat = r.latency_ms or {}
        builds = "n/a" if r.triton_builds is None else f"{r.triton_builds}/{r.graph_captures or 0}"
        rows.append([
            r.mode, r.workload, r.status, _tok_s(r), _best_peer(r),
            _fmt(r.mean_decode_step_ms, ".2f"), _fmt(r.mean_mixed_step_ms, ".2f"), _fmt(r.mean_decode_batch, ".1f"), _fmt(r.step_over_floor, ".2f"),
            _fmt(r.mixed_over_floor, ".2f"), _pair(lat.get("ttft_p50_ms"), lat.get("ttft_p99_ms")), _pair(lat.get("itl_p50_ms"), lat.get("itl_p99_ms"), ".2f"),
            _fmt(r.run_idle_share, ".1f", 100.0), _fmt(r.decode_idle_share, ".1f", 100.0),
            _fmt(r.profiled_tokens_per_s, ",.0f"), _fmt(r.same_tokens_as_serial, ".0%"), builds, _fmt(r.max_step_ms, ".0f"),
        ])
    widths = [max(len(row[i]) for row in rows if i < len(row) and (len(row) == len(head) or i < 2)) for i in range(len(head))]
    lines = []
    for n, row in enumerate(rows):
        if len(row) < len(head):
            lines.append(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}: {row[3]}")
        else:
            lines.append("  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("-" * len(lines[0]))
    settings = sorted({(r.mode, r.settings) for r in results if r.settings})
    lines += ["", "settings:"] + [f"  {m}: {s}" for m, s in settings]
    floors = [_floor_line(r) for r in results if r.decode_floor_ms]
    if floors:
        lines += ["", "floors:"] + floors
    return "\n".join(lines)


def _floor_line(r: ModeResult) -> str:
    experts = "" if r.decode_expert_share is None else f", {r.decode_expert_share:.1%} of routed experts' weights read"
    mixed = "" if r.mixed_floor_ms is None else (f"; mixed step {r.mixed_floor_ms:.2f} ms (FLOPs "
                                                 f"{r.mixed_flop_floor_ms:.2f}, the rest bytes)")
    return f"  {r.mode} {r.workload}: decode step {r.decode_floor_ms:.2f} ms at batch {r.mean_decode_batch:.1f}{experts}{mixed}"


def plot_step_times(results: list[ModeResult], path: Path) -> str:
    """Step time over the run, one line per engine mode and workload; returns a one-line message."""
    if not any(r.step_times for r in results):
        return "no engine steps to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in results:
        if r.step_times:
            ax.plot([s[0] for s in r.step_times], [s[1] for s in r.step_times], lw=0.8, label=f"{r.mode} {r.workload}")
    ax.set_xlabel("time since start of run (s)")
    ax.set_ylabel("engine step (ms, host wall)")
    ax.set_yscale("log")
    ax.set_title("step time over the run")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
