"""Cost of one engine -> front-end step message (serve/ipc.py): encoding (the engine thread) and
decoding (the front-end) a decode step of N streamed updates, against pickling the same entries
as they are (NamedTuples), microseconds of this thread's CPU per message (best of --repeats
rounds of --iters messages each).

    python -m benchmarks ipc-encode                    # 64, 256 and 1024 updates per step
    python -m benchmarks ipc-encode --updates 256 --iters 200
"""
from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_async.inference.request import RequestUpdate  # noqa: E402
from megatron_async.serve import ipc  # noqa: E402
from megatron_async.serve.submission import ChoiceEvent  # noqa: E402


def step_entries(n: int) -> list:
    """A decode step's entries: one single-token update per stream."""
    return [(i, "event", ChoiceEvent(0, RequestUpdate(i, (1234,), " word", False, None))) for i in range(n)]


def best_us(fn, iters: int, repeats: int) -> float:
    """CPU time of this thread per call (a shared machine's waits for a core are not counted)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        for _ in range(iters):
            fn()
        best = min(best, (time.thread_time() - t) / iters)
    return best * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, nargs="+", default=[64, 256, 1024], help="updates per step message")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(f"{'updates':>8} {'encode us':>10} {'decode us':>10} {'bytes':>8} {'pickled as is us':>17} {'bytes':>8}")
    for n in args.updates:
        entries = step_entries(n)
        message = ipc.encode_entries(entries)
        assert ipc.decode_entries(message) == entries
        enc = best_us(lambda: ipc.encode_entries(entries), args.iters, args.repeats)
        dec = best_us(lambda: ipc.decode_entries(message), args.iters, args.repeats)
        plain = best_us(lambda: pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL), args.iters, args.repeats)
        print(f"{n:>8} {enc:>10.1f} {dec:>10.1f} {len(message):>8} {plain:>17.1f} {len(pickle.dumps(entries)):>8}")


if __name__ == "__main__":
    main()
