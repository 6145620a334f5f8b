"""What a decode step costs, measured: the wall time of the engine's steps per (batch bucket,
row width), for the speculative policy's per-step choice (policy.py).

Width 1 is a plain decode step; width W > 1 a verify step whose widest row holds W - 1 drafts
(rows are padded to the verify graph's width, so its cost depends on the batch and W, not on
how many rows draft). A step's cost is the host wall time of the ``engine.step()`` that landed
it: in steady launch-ahead the device runs steps back to back and that time is the device step
(when the host is the bottleneck it is the host's time, which is then what bounds throughput;
serial steps: host and device one after the other).
Each (bucket, width) keeps the median of its first 3 samples (of 2: their mean, or the lesser
where one is 1.5 times the other: a hiccup - a collection, another process - only ever adds
time), then a moving average that one sample moves by at most 5 %, and the scheduler step it was
last measured at. Not the least of the first samples: a verify step's wall varies with the
tokens it lands (the host's share), and the least of three priced a width low enough to draft
at batch 128 / 80 % where it did not pay (simulated: R 2.6 against 2.8 steady).

Buckets: 1, 2, 4 and 8 rows by the next power of two, then multiples of 16 (the decode graphs'
sizes). The cost ratio R(B, W) = cost(B, W) / cost(B, 1) of a bucket without both measured is
bounded by its neighbours: verify work grows with the batch while a plain step's barely does
(memory bound), so R does not fall as B grows; the smaller buckets' ratios bound it from below,
the larger ones' from above."""
from __future__ import annotations

from dataclasses import dataclass

_EMA = 0.2  # weight of the newest step in a cell's average
_FIRST = 3  # a cell's first samples: their median


def bucket(rows: int) -> int:
    if rows <= 8:
        return 1 << max(0, rows - 1).bit_length()
    return -(-rows // 16) * 16


@dataclass
class Cell:
    seconds: float
    step: int
    """The policy's step count when last measured."""
    samples: int = 1
    first: tuple[float, ...] = ()
    """The first samples (up to ``_FIRST``)."""


class StepCosts:
    def __init__(self):
        self.cells: dict[tuple[int, int], Cell] = {}

    def observe(self, rows: int, width: int, seconds: float, step: int) -> None:
        """A landed decode step of ``rows`` rows, widest row ``width`` tokens, took ``seconds``."""
        if rows <= 0 or seconds <= 0:
            return
        key = (bucket(rows), width)
        cell = self.cells.get(key)
        if cell is None:
            self.cells[key] = Cell(seconds, step, first=(seconds,))
            return
        if cell.samples < _FIRST:
            cell.first = first = tuple(sorted(cell.first + (seconds,)))
            if len(first) == 2:
                cell.seconds = first[0] if first[1] > 1.5 * first[0] else (first[0] + first[1]) / 2
            else:
                cell.seconds = first[len(first) // 2]
        else:  # and moves the average by at most 5 %
            cell.seconds += _EMA * (min(max(seconds, cell.seconds * 0.8), cell.seconds * 1.25) - cell.seconds)
        cell.samples += 1
        cell.step = step

    def cell(self, rows: int, width: int) -> Cell | None:
        return self.cells.get((bucket(rows), width))

    def ratio(self, rows: int, width: int) -> float | None:
        """cost(B, W) / cost(B, 1) where both are measured at ``rows``' bucket."""
        b = bucket(rows)
        wide, plain = self.cells.get((b, width)), self.cells.get((b, 1))
        return wide.seconds / plain.seconds if wide is not None and plain is not None else None

    def ratio_bounds(self, rows: int, width: int) -> tuple[float, float]:
        """(lowest, highest) R(B, W) that the other buckets' measured ratios allow (1 and
        infinity without any)."""
        b, lo, hi = bucket(rows), 1.0, float("inf")
        for (other, w) in self.cells:
            if w != width or other == b:
                continue
            r = self.ratio(other, width)
            if r is None:
                continue
            if other < b:
                lo = max(lo, r)
            else:
                hi = min(hi, r)
        return lo, max(lo, hi)

    def row_prior(self, rows: int, width: int) -> float:
        """R(B, W) an unmeasured width is assumed to cost at least, for deciding whether to try
        it: each of a verify step's B * (W - 1) extra tokens costs what a row adds to a plain
        step (the measured plain costs of this bucket and the smallest one: their slope). 1
        without both. Pessimistic where the device bounds the step (a draft token reads its
        row's KV with the row), about right where the host does (landing is per token)."""
        b = bucket(rows)
        plain = self.cells.get((b, 1))
        small = min((o for (o, w) in self.cells if w == 1 and o < b), default=None)
        if plain is None or small is None:
            return 1.0
        slope = max(plain.seconds - self.cells[(small, 1)].seconds, 0.0) / (b - small)
        return 1.0 + (width - 1) * b * slope / plain.seconds

