"""Server throughput against the offline engine, and where the server's time goes. The engine
alone runs the workload (offline tok/s), then the same engine serves it over HTTP on a loopback
port exactly as ``python -m megatron_async.serve`` does (serve/launch.py: ``--api-server-count``
front-end processes, or 0: the event loop in this process) to streaming clients spread over
--client-processes processes (server tok/s), and again with twice the processes (when that
changes the server's tok/s, the clients were the bottleneck). During the first server run a
sampler files the engine thread's stacks and the event loop's (in this process with
--api-server-count 0, else in each front-end process) under stages
(benchmarks/stage_sampler.py) and prints their shares; each front-end process's CPU-busy
share comes from /proc.

    python -m benchmarks server-breakdown                          # CPU: tiny model, small shape
    python -m benchmarks server-breakdown --requests 500 --prompt-len 512 --max-tokens 128 \\
        --clients 256 --client-processes 8 -- --default-model qwen3-0.6b --device cuda --max-requests 256 \\
        --api-server-count 2
Flags after ``--`` are the server's (python -m megatron_async.serve); --model CKPT works too.
``--stub-step-ms MS`` serves an engine stand-in instead (each step sleeps MS and gives every
running request a token; benchmarks/commands/_server_stub.py): the HTTP path alone at GPU-like
step rates, on any machine.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.server_load import LoadShape, run_load_test_processes, token_prompt_for  # noqa: E402
from benchmarks.stage_sampler import FRONTEND_SAMPLES_ENV, StageSampler, breakdown_of  # noqa: E402
from megatron_async.inference.request import SamplingParams  # noqa: E402
from megatron_async.serve.frontend import PROFILER_ENV  # noqa: E402


def offline_run(engine, requests: int, prompt_len: int, max_tokens: int, offset: int = 0) -> tuple[float, int]:
    """The engine alone, every request added at once (the server's clients would all be waiting):
    (tok/s, steps)."""
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=max_tokens, ignore_eos=True)
    ids = {engine.add_request(token_prompt_for(offset + i, prompt_len), params) for i in range(requests)}
    tokens, steps, t0 = 0, 0, time.perf_counter()
    while ids:
        res = engine.step()
        steps += 1
        for out in res.finished:
            if out.request_id in ids:
                ids.discard(out.request_id)
                tokens += len(out.generated_tokens)
    return tokens / (time.perf_counter() - t0), steps


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    argv = sys.argv[1:]
    server_argv = argv[argv.index("--") + 1:] if "--" in argv else ["--default-model", "tiny", "--device", "cpu",
                                                                    "--max-requests", "16"]
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32, help="prompt token ids per request")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (EOS ignored)")
    p.add_argument("--clients", type=int, default=16, help="concurrent streams")
    p.add_argument("--client-processes", type=int, default=2)
    p.add_argument("--client", default="openai", choices=["openai", "raw"],
                   help="load generator: the openai client, or raw httpx2 + json.loads (less CPU per chunk)")
    p.add_argument("--warmup-requests", type=int, default=None, help="default: --clients")
    p.add_argument("--skip-client-check", action="store_true", help="no second server run with twice the processes")
    p.add_argument("--stub-step-ms", type=float, default=None,
                   help="serve an engine stand-in whose steps take this long (no model)")
    p.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"],
                   help="uvicorn's HTTP implementation (auto: httptools when installed)")
    p.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                   help="uvicorn's event loop (auto: uvloop when installed)")
    p.add_argument("--output-path", default=None, help="write the numbers as JSON")
    args = p.parse_args(argv)

    from megatron_async.cli import flags
    from megatron_async.cli.main_job import load_llm
    from megatron_async.serve.__main__ import build_parser, build_state
    from megatron_async.serve.launch import Serving

    sargs = build_parser().parse_args(server_argv)
    sys.setswitchinterval(sargs.gil_switch_interval_ms / 1000)  # as the server does
    if args.stub_step_ms is not None:
        from benchmarks.commands._server_stub import StubEngine

        from megatron_async.serve.app import ServerState
        from megatron_async.serve.engine_loop import EngineLoop
        from megatron_async.serve.metrics import ServerMetrics

        engine, llm = StubEngine(sargs.max_requests or 256, args.stub_step_ms / 1000), None
    else:
        flags.resolve_device_args(sargs)
        llm = load_llm(sargs, stream_text=True)
        engine = llm.engine
    warm = args.warmup_requests if args.warmup_requests is not None else args.clients
    offline_run(engine, warm, args.prompt_len, args.max_tokens, offset=10**6)  # compiles, graph captures
    offline, offline_steps = offline_run(engine, args.requests, args.prompt_len, args.max_tokens)
    tokens = args.requests * args.max_tokens
    print(f"offline engine: {offline:.0f} tok/s; steps: {offline_steps}, {1e3 * tokens / offline / offline_steps:.2f} ms "
          f"apart, {tokens / offline_steps:.1f} tokens each", flush=True)

    if llm is None:
        state = ServerState(EngineLoop(engine, ServerMetrics("stub"), share=False), "stub", None, None, max_model_len=1 << 20,
                            max_requests=engine.max_requests, max_request_bytes=1 << 25)
    else:
        state = build_state(llm, sargs)
    serving = Serving(state, "127.0.0.1", 0, sargs.api_server_count, "warning", http=args.http, loop=args.loop)
    samples_dir = tempfile.mkdtemp(prefix="frontend-stages-")
    # each front-end samples its event loop, written at its exit
    os.environ[FRONTEND_SAMPLES_ENV] = samples_dir
    os.environ[PROFILER_ENV] = "benchmarks.stage_sampler:frontend_sampler"
    results: dict = {}

    def drive() -> None:
        try:
            def load(processes: int, requests: int):
                return run_load_test_processes(serving.url, state.model_name, processes, args.clients, requests,
                                               LoadShape(args.max_tokens, args.prompt_len, token_prompts=True),
                                               client=args.client)

            load(args.client_processes, warm)
            steps0 = state.engine_loop.steps
            loop_thread = main_thread if sargs.api_server_count == 0 else None  # uvicorn runs on this one
            cpu0 = [process_cpu_s(p.pid) for p in serving.frontends]
            with StageSampler(state.engine_loop._thread, loop_thread) as sampler:
                report = load(args.client_processes, args.requests)
            results["frontend_cpu_s"] = [process_cpu_s(p.pid) - c for p, c in zip(serving.frontends, cpu0)]
            results["steps"] = state.engine_loop.steps - steps0
            results["server"] = report
            results["breakdown"] = sampler.between(report.started_at, report.ended_at)
            if not args.skip_client_check:
                results["server_more_clients"] = load(2 * args.client_processes, args.requests)
        except BaseException as e:  # noqa: BLE001 -- reported by the main thread
            results["error"] = e
        finally:
            serving.request_stop()

    main_thread = threading.current_thread()
    try:
        serving.start()
        threading.Thread(target=drive, daemon=True).start()
        serving.run()  # uvicorn's loop factory: uvloop when installed, unless --loop asyncio
    finally:
        serving.close()
        if llm is not None:
            llm.close()
    if "error" in results:
        raise results["error"]
    frontend_ticks = []
    for i in range(len(serving.frontends)):
        with open(Path(samples_dir) / f"frontend-{i}.pkl", "rb") as f:
            frontend_ticks.append(pickle.load(f))
    shutil.rmtree(samples_dir, ignore_errors=True)
    rep, more = results["server"], results.get("server_more_clients")
    bd, fe_cpu = results["breakdown"], results["frontend_cpu_s"]
    print(bd.format(rep.output_tokens))
    fe_bds = [breakdown_of(ticks, rep.started_at, rep.ended_at) for ticks in frontend_ticks]
    for i, fb in enumerate(fe_bds):
        print(f"front-end process {i} " + fb.format())
    if fe_cpu:
        print(f"{len(fe_cpu)} HTTP front-end processes: "
              + ", ".join(f"{c / rep.wall_s:.0%}" for c in fe_cpu) + " CPU-busy"
              + f", {1e6 * sum(fe_cpu) / max(1, rep.output_tokens):.1f} us CPU per token together")
    print(f"engine steps: {results['steps']}, {1e3 * rep.wall_s / max(1, results['steps']):.2f} ms apart, "
          f"{rep.output_tokens / max(1, results['steps']):.1f} tokens each")
    print(rep.format())
    rows = [("offline engine", offline, None)] + [
        (f"server, {r.processes} {r.client} client processes", r.output_tokens_per_s, r) for r in (rep, more) if r]
    print(f"\n{'run':<40} {'tok/s':>9} {'of offline':>10} {'busiest client':>15} {'client us/chunk':>16}")
    for name, tok_s, r in rows:
        busy = "" if r is None or r.client_cpu_busy is None else f"{r.client_cpu_busy:.0%} CPU"
        per_chunk = "" if r is None or r.client_cpu_us_per_chunk is None else f"{r.client_cpu_us_per_chunk:.0f}"
        print(f"{name:<40} {tok_s:>9.0f} {tok_s / offline:>10.0%} {busy:>15} {per_chunk:>16}")
    ok = rep.ok and (more is None or more.ok)
    if args.output_path:
        out = {"offline_tok_s": offline, "offline_steps": offline_steps, "server_steps": results["steps"],
               "server": rep.as_dict(), "server_more_clients": more and more.as_dict(),
               "breakdown": {t: results["breakdown"].shares(t) for t in ("engine", "loop")},
               "cpu_busy": results["breakdown"].cpu_busy, "cpu_s": results["breakdown"].cpu_s,
               "api_server_count": sargs.api_server_count, "frontend_cpu_s": fe_cpu,
               "frontend_cpu_busy": [c / rep.wall_s for c in fe_cpu],
               "frontend_breakdown": [fb.shares("loop") for fb in fe_bds]}
        Path(args.output_path).write_text(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
