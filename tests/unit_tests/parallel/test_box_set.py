"""BoxSet tells whether a new box overlaps any held one, looking only at neighbours along one dim:
it must agree with comparing the box against every held one, whatever the boxes' shapes (slabs
cut along the first box's dim or another, nested, equal, touching, scattered)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_async.parallel.sharding import Box, BoxSet

FULL = (12, 10)


@st.composite
def boxes(draw) -> list[Box]:
    out = []
    for _ in range(draw(st.integers(1, 12))):
        lo = tuple(draw(st.integers(0, n - 1)) for n in FULL)
        hi = tuple(draw(st.integers(a + 1, n)) for a, n in zip(lo, FULL))
        out.append(Box(lo, hi))
    return out


@settings(max_examples=400, deadline=None)
@given(boxes())
def test_add_agrees_with_comparing_every_box(seq):
    held = BoxSet(FULL)
    for i, box in enumerate(seq):
        expected = all(box.intersect(other) is None for other in seq[:i])
        assert held.add(box) is expected, (seq[:i + 1])
    assert held.boxes == seq


def test_row_slabs_touching_do_not_overlap_and_a_repeat_does():
    held = BoxSet((8, 4))
    assert all(held.add(Box((r, 0), (r + 2, 4))) for r in (4, 0, 6, 2))  # out of order, touching
    assert not held.add(Box((3, 0), (4, 4)))  # inside the slab at rows 2..4
    assert not held.add(Box((0, 0), (2, 4)))  # given twice
