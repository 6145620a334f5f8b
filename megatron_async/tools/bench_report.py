"""Benchmark output: the per-mode result record, the printed table, the step-time plot."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

HF_PEERS = ("hf_generate", "hf_generate_batch")


@dataclass
class ModeResult:
    mode: str
    status: str = "ok"
    """ok | skipped | timed_out | error"""
    reason: str | None = None
    output_tokens: int = 0
    wall_time_s: float = 0.0
    output_tokens_per_s: float = 0.0
    ratio_to: dict[str, float] = field(default_factory=dict)
    """output tokens/s over each HF peer's."""
    mean_decode_step_ms: float | None = None
    mean_decode_batch: float | None = None
    gpu_idle_share: float | None = None
    """Decode-only window under torch.profiler; None on CPU or when not measured."""
    gpu_wait_share: float | None = None
    """Decode-only window timed with CUDA events, no profiler: share of wall time the device
    had no step to run (waited for the host); None on CPU or when not measured."""
    decode_floor_ms: float | None = None
    step_over_floor: float | None = None
    same_tokens_as_serial: float | None = None
    """Share of requests whose tokens equal the serial engine's (greedy)."""
    summary: dict | None = None
    idle_profile: dict | None = None
    step_times: list[tuple[float, float, bool]] = field(default_factory=list)
    """(seconds since start, step ms, decode-only) per engine step."""

    def as_dict(self) -> dict:
        return asdict(self)


def add_ratios(results: list[ModeResult]) -> None:
    peers = {r.mode: r.output_tokens_per_s for r in results if r.mode in HF_PEERS and r.status == "ok"}
    for r in results:
        if r.status in ("ok", "timed_out"):
            r.ratio_to = {p: r.output_tokens_per_s / v for p, v in peers.items() if v > 0}


def _fmt(v: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if v is None else format(v * scale, spec)


def format_table(results: list[ModeResult]) -> str:
    head = ["mode", "status", "out tok/s", "x hf_generate", "x hf_gen_batch", "decode ms", "batch", "GPU idle %",
            "GPU wait %", "floor ms", "step/floor", "=serial"]
    rows = [head]
    for r in results:
        if r.status in ("skipped", "error"):
            rows.append([r.mode, r.status, (r.reason or "")[:60]] + [""] * (len(head) - 3))
            continue
        rows.append([
            r.mode, r.status, f"{r.output_tokens_per_s:,.1f}",
            _fmt(r.ratio_to.get("hf_generate"), ".2f"), _fmt(r.ratio_to.get("hf_generate_batch"), ".2f"),
            _fmt(r.mean_decode_step_ms, ".2f"), _fmt(r.mean_decode_batch, ".1f"), _fmt(r.gpu_idle_share, ".1f", 100.0),
            _fmt(r.gpu_wait_share, ".1f", 100.0), _fmt(r.decode_floor_ms, ".2f"), _fmt(r.step_over_floor, ".2f"), _fmt(r.same_tokens_as_serial, ".0%"),
        ])
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(head))]
    lines = []
    for n, row in enumerate(rows):
        if row[1] in ("skipped", "error"):
            lines.append(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}")
        else:
            lines.append("  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def plot_step_times(results: list[ModeResult], path: Path) -> str:
    """Step time over the run, one line per engine mode; returns a one-line message."""
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
            ax.plot([s[0] for s in r.step_times], [s[1] for s in r.step_times], lw=0.8, label=r.mode)
    ax.set_xlabel("time since start of run (s)")
    ax.set_ylabel("engine step (ms, host wall)")
    ax.set_yscale("log")
    ax.set_title("step time over the run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
