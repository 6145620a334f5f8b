"""Where a running server's two busy threads spend their time: a sampling profiler inside the
process (no py-spy needed, so it runs on any machine). A daemon thread looks at the engine
thread's and the event loop thread's Python stacks every ``interval_s`` and files each sample
under one stage; the shares of those stages are the breakdown. A thread waiting for the GIL is
filed where it waits (its stack does not change), so a stage's share is its wall time, not
only its CPU time; ``cpu_busy`` (the thread's CPU clock over the wall time) says how much of it
was computing."""
from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

ENGINE_STAGES = ("engine step", "detokenize", "server hand-off", "idle")
"""Engine thread: the engine's own step (model, scheduling, bookkeeping); the incremental
detokenization it does for streamed text; the server's per-step work around it (events,
metrics, the call to the event loop); waiting for requests."""
LOOP_STAGES = ("deliver", "SSE chunks + JSON", "HTTP send (ASGI, uvicorn)", "request handling", "asyncio callbacks",
               "idle / loop I/O")
"""Event loop thread: handing a step's events to the streams; building each stream's chunks;
the ASGI / HTTP layers down to the socket write; parsing and admitting new requests; asyncio's
own Python callbacks (task wake-ups, transports); the event loop polling or in its own C code
(uvloop)."""

_HTTP_PACKAGES = ("/starlette/", "/uvicorn/", "/fastapi/", "/anyio/", "/h11/", "/httptools/")
_CHUNK_FILES = ("serve/responses.py", "serve/chat_output.py")
_CHUNK_FUNCTION_FILES = ("serve/completion_routes.py", "serve/chat_routes.py")
"""Where the endpoints' ``chunk`` builders and what they call live."""
_CHUNK_FUNCTIONS = ("chunk", "stream_logprobs", "completion_logprobs", "completion_chunk_choice", "vllm_prompt_logprobs",
                    "_entries", "_top", "chat_logprobs", "chat_chunk_choice", "chunk_choices")


def engine_stage(frames: list[tuple[str, str]]) -> str:
    """The stage of an engine-thread stack (``frames``: (file, function), innermost first)."""
    files = [f for f, _ in frames]
    if any(f.endswith("text_stream.py") for f in files) or any(fn == "take_update" for _, fn in frames):
        return "detokenize"
    if any("/megatron_async/inference/" in f or "/megatron_async/models/" in f or "/torch/" in f for f in files):
        return "engine step"
    if frames and (frames[0][1] == "_run" or frames[0][1] in ("get", "wait") and any(fn == "_run" for _, fn in frames)):
        return "idle"  # in the inbox's get (C code under _run): no request to step
    return "server hand-off"


_LOOP_ENTRIES = {("asyncio/base_events.py", "_run_once"), ("asyncio/base_events.py", "run_forever"),
                 ("asyncio/base_events.py", "run_until_complete"), ("asyncio/runners.py", "run")}
"""Where the event loop itself runs: frames inside it are callbacks (work); none: it polls, or
runs its own C code (uvloop's reads and writes)."""


def loop_stage(frames: list[tuple[str, str]]) -> str:
    """The stage of an event-loop-thread stack (innermost first)."""
    entry = next((k for k, (f, fn) in enumerate(frames) if any(f.endswith(e) and fn == n for e, n in _LOOP_ENTRIES)),
                 len(frames))
    inner = [(f, fn) for f, fn in frames[:entry] if not f.endswith("selectors.py")]
    if not inner:
        return "idle / loop I/O"
    if any(fn == "_deliver" or (f.endswith("serve/frontend.py") and fn == "_take_events") for f, fn in inner):
        return "deliver"  # a step's events into the streams' queues (in a front-end process: off its socket)
    for f, fn in inner:  # the innermost frame outside the standard library decides
        if any(p in f for p in _HTTP_PACKAGES):
            return "HTTP send (ASGI, uvicorn)"
        if any(f.endswith(c) for c in _CHUNK_FILES) or (f.endswith(_CHUNK_FUNCTION_FILES) and fn in _CHUNK_FUNCTIONS):
            return "SSE chunks + JSON"
        if "/megatron_async/" in f:
            return "request handling"
    return "asyncio callbacks"


@dataclass
class StageBreakdown:
    samples: dict[str, Counter] = field(default_factory=lambda: {"engine": Counter(), "loop": Counter()})
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds each thread used while sampled (load on other processes does not change it)."""
    wall_s: float = 0.0

    @property
    def cpu_busy(self) -> dict[str, float]:
        return {n: c / self.wall_s for n, c in self.cpu_s.items()} if self.wall_s else {}

    def shares(self, thread: str) -> dict[str, float]:
        c = self.samples[thread]
        total = sum(c.values()) or 1
        stages = ENGINE_STAGES if thread == "engine" else LOOP_STAGES
        return {s: c[s] / total for s in stages}

    def format(self, tokens: int = 0) -> str:
        """``tokens``: streamed in the sampled time, to print each thread's CPU time per token."""
        lines = []
        for thread, title in (("engine", "engine thread"), ("loop", "event loop thread")):
            if not self.samples[thread]:
                continue
            busy = self.cpu_busy.get(thread)
            per_token = f", {1e6 * self.cpu_s[thread] / tokens:.1f} us CPU per token" if tokens and busy else ""
            lines.append(f"{title} ({sum(self.samples[thread].values())} samples"
                         + ("" if busy is None else f", {busy:.0%} CPU-busy") + per_token + "):")
            lines += [f"  {s:<28} {v:6.1%}" for s, v in self.shares(thread).items()]
        return "\n".join(lines)


class StageSampler:
    """``with StageSampler(engine_thread, loop_thread) as s: ...; s.result`` (a StageBreakdown of
    the whole time; ``s.between(t0, t1)``: of a window of ``time.perf_counter()`` readings, e.g.
    the load test's own start and end, so that its set-up is not filed as idle)."""

    def __init__(self, engine_thread: threading.Thread | None, loop_thread: threading.Thread | None,
                 interval_s: float = 0.002):
        """A thread given as None is not sampled (the server's event loops may run in front-end
        processes, each sampling only its own loop)."""
        self._threads = {name: t for name, t in (("engine", engine_thread), ("loop", loop_thread)) if t is not None}
        self._interval = interval_s
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._run, name="stage-sampler", daemon=True)
        self._ticks: list[tuple[float, dict[str, float], dict[str, str]]] = []
        """(time, each thread's CPU clock, each thread's stage) per sample."""
        self.result = StageBreakdown()

    def _cpu(self) -> dict[str, float]:
        out = {}
        for name, t in self._threads.items():
            try:
                out[name] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (AttributeError, OSError, TypeError):  # not on this platform, or the thread ended
                pass
        return out

    def _run(self) -> None:
        ids = {t.ident: name for name, t in self._threads.items()}
        classify = {"engine": engine_stage, "loop": loop_stage}
        while not self._stop.wait(self._interval):
            stages = {}
            for ident, frame in sys._current_frames().items():
                name = ids.get(ident)
                if name is None:
                    continue
                frames = []
                while frame is not None:
                    frames.append((frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_name))
                    frame = frame.f_back
                stages[name] = classify[name](frames)
            self._ticks.append((time.perf_counter(), self._cpu(), stages))

    @property
    def ticks(self) -> list[tuple[float, dict[str, float], dict[str, str]]]:
        """The raw samples (picklable: another process can take ``breakdown_of`` them)."""
        return self._ticks

    def between(self, t0: float | None = None, t1: float | None = None) -> StageBreakdown:
        """The samples taken in [t0, t1] (None: from the first / to the last)."""
        return breakdown_of(self._ticks, t0, t1)

    def __enter__(self) -> StageSampler:
        self._sampler.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._sampler.join()
        self.result = self.between()


def breakdown_of(ticks: list[tuple[float, dict[str, float], dict[str, str]]], t0: float | None = None,
                 t1: float | None = None) -> StageBreakdown:
    """The StageBreakdown of a sampler's ``ticks`` taken in [t0, t1] (None: from the first / to the last)."""
    ticks = [k for k in ticks if (t0 is None or k[0] >= t0) and (t1 is None or k[0] <= t1)]
    out = StageBreakdown()
    if len(ticks) < 2:
        return out
    for _, _, stages in ticks:
        for name, stage in stages.items():
            out.samples[name][stage] += 1
    first, last = ticks[0], ticks[-1]
    out.wall_s = last[0] - first[0]
    out.cpu_s = {n: last[1][n] - first[1][n] for n in last[1] if n in first[1]}
    return out


FRONTEND_SAMPLES_ENV = "MEGATRON_ASYNC_FRONTEND_STAGE_SAMPLES"
"""A directory: ``frontend_sampler`` writes each front-end process's ticks there, as ``frontend-INDEX.pkl``."""


@contextlib.contextmanager
def frontend_sampler(index: int):
    """A front-end process's profiler (``MEGATRON_ASYNC_FRONTEND_PROFILER=benchmarks.stage_sampler:frontend_sampler``):
    samples its event loop thread's stages and writes the ticks at exit."""
    with StageSampler(None, threading.current_thread()) as sampler:
        yield
    with open(os.path.join(os.environ[FRONTEND_SAMPLES_ENV], f"frontend-{index}.pkl"), "wb") as f:
        pickle.dump(sampler.ticks, f)
