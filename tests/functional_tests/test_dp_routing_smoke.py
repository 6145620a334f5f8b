"""python -m benchmarks dp-routing --smoke: both tables print, affinity keeps one engine's hits
where spreading the turns loses them, and the router's round trip is shown beside the same hops
over bare ZMQ."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.coordinator_procs import ROOT, _env


@pytest.mark.slow
def test_dp_routing_smoke():
    # the three policies asserted on (each engine process costs seconds; routing itself: test_dp_routing.py)
    done = subprocess.run([sys.executable, "-m", "benchmarks", "dp-routing", "--smoke", "--engines", "2",
                           "--policies", "load_balanced,longest_prefix,scored:0.9"],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|") for line in done.stdout.splitlines() if line.startswith("| ")}
    share = {name: int(cells[3].strip().rstrip(" %")) for name, cells in rows.items() if cells[3].strip().endswith("%")}
    assert share["longest_prefix"] >= 90 and share["scored (alpha 0.9)"] >= 90 and share["load_balanced"] < 90
    assert "requests/s" in done.stdout
    us = {name: float(cells[2].strip().removesuffix(" us")) for name, cells in rows.items() if cells[2].strip().endswith(" us")}
    rtt = us["client -> coordinator -> engine -> client, one at a time, median"]
    tcp = us["the same hops over bare ZMQ on this host (relay + echo processes), TCP, median"]
    ipc = us["the same over ipc (as local peers reach the coordinator), median"]
    assert 0 < tcp < rtt and us["added above the TCP floor, median"] == pytest.approx(rtt - tcp, abs=1)
    assert 0 < ipc < rtt and us["added above the ipc floor, median"] == pytest.approx(rtt - ipc, abs=1)


@pytest.mark.slow
def test_router_stages_smoke():
    """python -m benchmarks.router_stages: every stage of the request's path is found in most
    requests, each a positive time, beside the bare relay's round trip. A same-host client gets its
    outputs from the engine directly: 3 hops, the last one engine -> client."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.router_stages", "--requests", "300"],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found, asked = (int(x) for x in done.stdout.split(" requests one at a time")[0].split(" of "))
    assert asked == 300 and found >= 250, done.stdout
    stages = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| ") and line.endswith(" us |")]
    assert len(stages) == 7 and all(float(cells[2].strip().removesuffix(" us")) > 0 for cells in stages)
    hops = [cells[1].strip() for cells in stages if cells[1].strip().startswith("hop:")]
    assert len(hops) == 3 and hops[-1].startswith("hop: engine -> client"), hops
    assert "bare ZMQ" in done.stdout
