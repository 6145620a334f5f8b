"""Server processes each test starts for itself (not the shared one of test_server.py): the load-test
command's own built-in model server, and an idle server's shutdown on SIGTERM / Ctrl-C."""
import json
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from megatron_async.serve.process import ServerProcess  # noqa: E402


def test_load_test_script_starts_a_builtin_model_server(tmp_path):
    """python -m benchmarks load-test as the GPU wrapper runs it (built-in model, token-id prompts, warm-up,
    clients spread over processes), small: it starts its own server, reports, and exits 0 only
    when nothing was lost."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "load-test", "--clients", "8", "--client-processes", "2",
         "--requests", "24", "--max-tokens", "6",
         "--prompt-words", "10", "--token-prompts", "--warmup-requests", "8", "--output-path", str(out),
         "--", "--default-model", "tiny", "--device", "cpu", "--max-requests", "8"],
        capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warm-up: 8/8 requests completed" in proc.stdout and "overlap ratio" in proc.stdout
    report = json.loads(out.read_text())
    assert report["completed"] == 24 and report["lost"] == report["duplicated"] == 0
    assert report["output_tokens"] == 24 * 6 and report["itl_p99_ms"] is not None
    assert report["processes"] == 2 and 0 < report["client_cpu_busy"] < 1.5  # both processes' requests merged


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_idle_shutdown_is_prompt_and_clean(sig):
    """SIGTERM / Ctrl-C on an idle server that has served: it stops its engine, closes the model
    and exits 0 within a second (no signal re-raised before the engine is closed, no
    interpreter teardown of torch)."""
    import signal

    with ServerProcess(["--default-model", "tiny", "--device", "cpu", "--max-requests", "4"]) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert len(list(client.completions.create(model=srv.model_name, prompt=[1, 2, 3], max_tokens=3,
                                                  stream=True))) >= 2  # a keep-alive connection stays open
        t = time.perf_counter()
        srv.proc.send_signal(getattr(signal, sig))
        code = srv.proc.wait(30)
        took = time.perf_counter() - t
        client.close()
    assert code == 0 and took < 1.0, (code, took, srv.output())
