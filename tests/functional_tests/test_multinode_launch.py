"""Multi-node launch on one host: two ``torchrun --nnodes 2`` node processes (one rank each, gloo,
CPU) run the main job with TP=2 across the "nodes". The ZMQ endpoint comes from the rendezvous
(rank 0 binds an ephemeral port and publishes it in the torch store), so no fixed port or
localhost is assumed: the rendezvous address is this host's non-loopback IP when it has one."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from megatron_async.cli.main_job import main
from tests.helpers.multiprocess import free_port

ROOT = Path(__file__).resolve().parents[2]
JOB_ARGS = ["--num-requests", "5", "--prompt-len-min", "4", "--prompt-len-max", "10", "--output-len-min", "3",
            "--output-len-max", "6", "--arrival-rate", "1.0", "--block-size", "4", "--num-kv-blocks", "64",
            "--max-requests", "3", "--max-tokens", "16", "--quiet", "--device", "cpu", "--top-k", "1"]


def host_address() -> str:
    """A non-loopback address of this host (the interface towards a public IP), else loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
@pytest.mark.parametrize("parallel", ["tp", "ep"])
def test_two_nodes_tp2_and_ep2_match_one_process(tmp_path, parallel):
    main([*JOB_ARGS, "--output-path", str(tmp_path / "one.json")])
    addr, port = host_address(), free_port()
    env = {**os.environ, "NNODES": "2", "NPROC": "1", "MASTER_ADDR": addr, "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if parallel == "ep":
        env["EP"] = "1"
    nodes = [subprocess.Popen(["bash", "examples/run_torchrun.sh", *JOB_ARGS, "--output-path", str(tmp_path / "two.json")],
                              cwd=ROOT, env={**env, "NODE_RANK": str(n)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for n in range(2)]
    try:
        results = [node.communicate(timeout=150) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, (_, err) in zip(nodes, results):
        assert node.returncode == 0, err[-3000:]
    label = "TP 2, EP 1" if parallel == "tp" else "TP 1, EP 2"
    assert sum(err.count(label) for _, err in results) == 1  # rank 0 (node 0) reports

    def tokens(name: str) -> list[list[int]]:
        return [r["generated_tokens"] for r in json.loads((tmp_path / name).read_text())["requests"]]

    assert tokens("two.json") == tokens("one.json") and all(tokens("one.json"))
