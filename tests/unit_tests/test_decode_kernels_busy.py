"""``decode-kernels``' device busy time is the union of the kernels' intervals: overlapping kernels
(another stream's, a dependent launch's) count once, gaps not at all, host events never."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from benchmarks.commands.decode_kernels import busy_us


def _ev(start: float, end: float, cuda: bool = True) -> SimpleNamespace:
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return SimpleNamespace(device_type=kind, time_range=SimpleNamespace(start=start, end=end))


def test_overlaps_count_once_and_gaps_not_at_all():
    events = [_ev(0, 10), _ev(5, 12), _ev(20, 25), _ev(21, 22), _ev(0, 100, cuda=False), _ev(30, 30)]
    assert busy_us(SimpleNamespace(events=lambda: events)) == 12 + 5
    assert busy_us(SimpleNamespace(events=lambda: [])) == 0
