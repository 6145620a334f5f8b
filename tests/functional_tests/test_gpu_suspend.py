"""CUDA: engine.suspend / resume with torch-memory-saver and CUDA graphs. In a process started
with its preload library (so graph pools are released too): suspend frees >= 90 % of the tagged
bytes as mem_get_info sees them, requests paused across a suspend (weights kept) and across one
with the weights dropped and refilled by update_weights end with the tokens of an uninterrupted
run, and the captured graphs replay after each resume without any recapture."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.requirements import need

pytestmark = pytest.mark.gpu


def test_suspend_cycle_frees_memory_and_graphs_replay(tmp_path):
    need("torch_memory_saver")
    from megatron_async.inference.memory_suspend import preload_env

    env = preload_env()
    path = tmp_path / "cycle.json"
    subprocess.run([sys.executable, "-m", "tests.helpers.suspend_cycle", "--default-model", "tiny",
                    "--dtype", "float32", "--num-requests", "8", "--buffer-size-gb", "1", "--json", str(path)],
                   env=env, cwd=Path(__file__).resolve().parents[2], check=True, timeout=600)
    rep = json.loads(path.read_text())
    assert rep["kept_requests"] > 0 and rep["graph_pool_bytes"] > 0, rep
    assert rep["freed_fraction"] >= 0.9, rep
    assert rep["tokens_equal"], rep
    first, second, end = rep["graph_replays"]
    assert first < second < end and rep["graph_captures_after_warmup"] == 0, rep


def test_suspend_without_preload_exits_cleanly(tmp_path):
    """Without the preload library (torch-memory-saver's allocator mode) the weights and the KV
    pool are freed and restored; graph pools stay resident; tokens are unchanged; and the process
    exits with status 0 (the package's free hook used to end it with status 1 when the pools were
    destroyed at exit, outside any region)."""
    need("torch_memory_saver")
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TMS_INIT_ENABLE")}
    path = tmp_path / "cycle.json"
    done = subprocess.run([sys.executable, "-m", "tests.helpers.suspend_cycle", "--default-model", "tiny",
                           "--dtype", "float32", "--num-requests", "8", "--buffer-size-gb", "1", "--json", str(path)],
                          env=env, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "interesting region" not in done.stderr + done.stdout, done.stderr[-3000:]
    rep = json.loads(path.read_text())
    assert rep["kept_requests"] > 0 and rep["tokens_equal"], rep
    assert rep["freed_bytes"] >= 0.9 * (rep["weight_bytes"] + rep["kv_bytes"]), rep
    assert rep["graph_captures_after_warmup"] == 0, rep
