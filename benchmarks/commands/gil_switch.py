"""How long the server's engine thread waits for the GIL while the event loop is busy, per GIL
switch interval (the server's --gil-switch-interval-ms). Two threads as in the server: an
"engine" that waits for a step without the GIL (a GPU step: sleep), then runs Python (its
bookkeeping), and an "event loop" that runs Python without pause (a saturated loop writing
chunks). Prints the engine's step period against its ideal (wait + work) and the loop's Python
throughput, per interval.

    python -m benchmarks gil-switch [--step-ms 5] [--work-ms 1] [--intervals 5 1 0.5 0.2]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time


def busy(seconds: float) -> int:
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1
    return n


def run(step_s: float, work_s: float, interval_s: float, duration_s: float) -> tuple[float, float]:
    """(engine step period s, event-loop iterations per s) with ``interval_s`` as the switch interval."""
    sys.setswitchinterval(interval_s)
    stop = threading.Event()
    loop_iterations = [0]

    def event_loop():
        while not stop.is_set():
            loop_iterations[0] += busy(0.0005)

    t = threading.Thread(target=event_loop, daemon=True)
    t.start()
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < duration_s:
        time.sleep(step_s)  # the GPU step: the GIL is free
        busy(work_s)  # bookkeeping: needs the GIL back first
        steps += 1
    wall = time.perf_counter() - t0
    stop.set()
    t.join()
    return wall / steps, loop_iterations[0] / wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step-ms", type=float, default=5.0, help="the engine's wait per step (GIL released)")
    p.add_argument("--work-ms", type=float, default=1.0, help="the engine's Python work per step")
    p.add_argument("--intervals", type=float, nargs="+", default=[5.0, 2.0, 1.0, 0.5, 0.2])
    p.add_argument("--seconds", type=float, default=3.0, help="per interval")
    args = p.parse_args()
    ideal = args.step_ms + args.work_ms
    default = sys.getswitchinterval()
    base = None
    print(f"{'switch interval':>16} {'engine step':>12} {'of ideal':>9} {'loop work':>10}")
    for ms in args.intervals:
        period, rate = run(args.step_ms / 1e3, args.work_ms / 1e3, ms / 1e3, args.seconds)
        base = base or rate
        print(f"{ms:>13.2f} ms {1e3 * period:>9.2f} ms {1e3 * period / ideal:>8.2f}x {rate / base:>9.0%}")
    sys.setswitchinterval(default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
