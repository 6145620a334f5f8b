"""What agreeing every K steps instead of every step would save and cost, replayed on a trace of
a real data-parallel run that agreed every step (python -m benchmarks consensus).

Agreeing once per window of K steps fixes, for the whole window, what the per-step agreement
decides: the padded token count of the MoE exchanges (the window's largest), graph or eager
(eager if any step of the window needs it, as NCCL needs the mode uniform across ranks), and
which requests are admitted (only at the window's exchange). So per window:
- saved: K - 1 exchanges;
- padding: every step of the window exchanges the window's largest count, not its own;
- graph steps lost: greedy-decode steps of a window that some other step makes eager;
- dummy forwards: steps inside an open window where no rank has anything left to launch (at K
  = 1 nobody forwards then), on every rank;
- admission delay: a request routed at step s waits until the window's next exchange.
A first-order replay: the trace's schedule is kept (the delays would shift it a little)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TraceStep:
    tokens: tuple[int, ...]
    """Tokens each rank launched at this step (0: nothing; a dummy forward if another launched)."""
    eager: bool
    """Some rank's launch could not replay a graph."""
    admitted: int = 0
    """Requests routed at this step's exchange (all ranks together)."""


@dataclass(frozen=True)
class WindowCosts:
    k: int
    exchanges_per_step: float
    padded_rows_pct: float
    """Extra MoE exchange rows against agreeing every step, % of the every-step rows."""
    graph_steps_lost_pct: float
    """Graph-replayable steps forced eager, % of the every-step graph steps."""
    extra_dummy_forwards: int
    """Forwards of ranks with nothing to launch that every-step agreement does not run."""
    mean_admission_delay_steps: float


def window_costs(trace: list[TraceStep], k: int) -> WindowCosts:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    steps = len(trace)
    ranks = len(trace[0].tokens) if trace else 0
    rows = extra_rows = graph = lost = dummies = 0
    delay = admitted = 0
    for w0 in range(0, steps, k):
        window = trace[w0:w0 + k]
        pad = max(max(s.tokens) for s in window)
        eager = any(s.eager and max(s.tokens) > 0 for s in window)
        for i, s in enumerate(window):
            admitted += s.admitted
            delay += s.admitted * ((k - i) % k)
            m = max(s.tokens)
            rows += m * ranks
            if pad == 0:
                continue
            extra_rows += (pad - m) * ranks
            if m > 0 and not s.eager:
                graph += 1
                lost += eager
            if m == 0:  # nobody has work, yet the window's agreement says forward
                dummies += ranks
    return WindowCosts(
        k=k,
        exchanges_per_step=-(-steps // k) / steps if steps else 0.0,
        padded_rows_pct=100.0 * extra_rows / rows if rows else 0.0,
        graph_steps_lost_pct=100.0 * lost / graph if graph else 0.0,
        extra_dummy_forwards=dummies,
        mean_admission_delay_steps=delay / admitted if admitted else 0.0,
    )
