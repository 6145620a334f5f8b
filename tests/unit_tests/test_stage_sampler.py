"""The server breakdown's stage sampler: stacks filed under the right stage, and a live sampler
sees a busy thread as busy and a blocked one as idle."""
import threading
import time

from benchmarks.stage_sampler import StageSampler, engine_stage, loop_stage

SITE = "/usr/lib/python3/site-packages"
ASYNCIO = "/usr/lib/python3.11/asyncio"


def test_engine_stages():
    run = ("/x/megatron_async/serve/engine_loop.py", "_run")
    assert engine_stage([run]) == "idle"
    assert engine_stage([("/x/megatron_async/inference/text_stream.py", "take_delta"),
                         ("/x/megatron_async/inference/engines/dynamic_engine.py", "step"), run]) == "detokenize"
    assert engine_stage([(f"{SITE}/torch/nn/modules/module.py", "forward"),
                         ("/x/megatron_async/inference/engines/dynamic_engine.py", "step"), run]) == "engine step"
    assert engine_stage([(f"{SITE}/prometheus_client/metrics.py", "observe"),
                         ("/x/megatron_async/serve/engine_loop.py", "_step"), run]) == "server hand-off"


def test_loop_stages():
    runner = (f"{ASYNCIO}/runners.py", "run")
    assert loop_stage([runner]) == "idle / loop I/O"
    assert loop_stage([("/usr/lib/python3.11/selectors.py", "select"), (f"{ASYNCIO}/base_events.py", "_run_once"),
                       runner]) == "idle / loop I/O"
    assert loop_stage([("/x/megatron_async/serve/engine_loop.py", "_deliver"), runner]) == "deliver"
    assert loop_stage([("/x/megatron_async/serve/ipc.py", "decode_entries"),
                       ("/x/megatron_async/serve/frontend.py", "_take_events"), runner]) == "deliver"  # a front-end
    assert loop_stage([("/usr/lib/python3.11/json/encoder.py", "encode"), ("/x/megatron_async/serve/responses.py", "sse"),
                       ("/x/megatron_async/serve/responses.py", "_stream"), (f"{SITE}/starlette/responses.py", "stream_response"),
                       runner]) == "SSE chunks + JSON"
    assert loop_stage([(f"{SITE}/uvicorn/protocols/http/httptools_impl.py", "send"),
                       (f"{SITE}/starlette/responses.py", "stream_response"), runner]) == "HTTP send (ASGI, uvicorn)"
    assert loop_stage([(f"{ASYNCIO}/events.py", "_run"), (f"{ASYNCIO}/base_events.py", "_run_once"),
                       runner]) == "asyncio callbacks"


def test_sampler_sees_busy_and_idle_threads():
    stop = threading.Event()

    def _run():  # the engine loop's name: blocked here is idle
        stop.wait()

    def spin():
        while not stop.is_set():
            pass

    idle, busy = threading.Thread(target=_run), threading.Thread(target=spin)
    idle.start(), busy.start()
    with StageSampler(idle, busy, interval_s=0.005) as s:
        time.sleep(0.4)
    stop.set()
    idle.join(), busy.join()
    assert s.result.samples["engine"]["idle"] > 0 and set(s.result.samples["engine"]) == {"idle"}
    assert sum(s.result.samples["loop"].values()) > 0
    assert s.result.cpu_s["loop"] > 5 * s.result.cpu_s["engine"]
