"""The every-K-steps replay on hand-made traces: exchanges, padding, lost graph steps, dummy
forwards and admission delay counted as the module says."""
from __future__ import annotations

import pytest

from benchmarks.consensus_windows import TraceStep, window_costs

TRACE = [TraceStep((4, 0), True, admitted=2), TraceStep((1, 2), False), TraceStep((1, 1), False, admitted=1),
         TraceStep((0, 0), False), TraceStep((3, 1), False), TraceStep((1, 0), False, admitted=1)]


def test_every_step_is_the_baseline():
    c = window_costs(TRACE, 1)
    assert (c.exchanges_per_step, c.padded_rows_pct, c.graph_steps_lost_pct) == (1.0, 0.0, 0.0)
    assert c.extra_dummy_forwards == 0 and c.mean_admission_delay_steps == 0.0


def test_windows_of_two_and_three():
    two = window_costs(TRACE, 2)  # windows [4,2 eager] [1,0] [3,1]: pads 4, 1, 3
    rows = 2 * (4 + 2 + 1 + 0 + 3 + 1)
    assert two.exchanges_per_step == 0.5
    assert two.padded_rows_pct == pytest.approx(100 * 2 * ((4 - 2) + (1 - 0) + (3 - 1)) / rows)
    assert two.graph_steps_lost_pct == pytest.approx(100 * 1 / 4)  # step 1 sits in the eager window
    assert two.extra_dummy_forwards == 2  # step 3: the window [1, 0] is open, nobody has work
    assert two.mean_admission_delay_steps == pytest.approx((0 + 0 + 1) / 4)  # step 5 waits one step
    three = window_costs(TRACE, 3)  # windows [4,2,1 eager] [0,3,1]
    assert three.exchanges_per_step == pytest.approx(2 / 6)
    assert three.graph_steps_lost_pct == pytest.approx(100 * 2 / 4)
    assert three.mean_admission_delay_steps == pytest.approx((2 * 0 + 1 * 1 + 1 * 1) / 4)
    with pytest.raises(ValueError):
        window_costs(TRACE, 0)
