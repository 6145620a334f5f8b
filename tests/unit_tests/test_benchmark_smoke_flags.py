"""``--smoke`` gives a benchmark small defaults, and flags given beside it still win."""
from benchmarks.commands import dp_routing, tp_scaling


def test_dp_routing_smoke_defaults_yield_to_flags():
    smoke = dp_routing.parse_args(["--smoke"])
    assert (smoke.conversations, smoke.turns, smoke.requests, smoke.window) == (8, 2, 2000, 64)
    given = dp_routing.parse_args(["--smoke", "--conversations", "16", "--requests", "500"])
    assert (given.conversations, given.requests, given.turns) == (16, 500, 2)
    assert dp_routing.parse_args([]).conversations == 64


def test_tp_scaling_smoke_defaults_yield_to_flags():
    smoke = tp_scaling.parse_args(["--smoke"])
    assert (smoke.device, smoke.model, smoke.batches, smoke.output_len) == ("cpu", "tiny", [1, 4], 6)
    given = tp_scaling.parse_args(["--smoke", "--batches", "2", "--output-len", "3"])
    assert (given.batches, given.output_len, given.model) == ([2], 3, "tiny")
