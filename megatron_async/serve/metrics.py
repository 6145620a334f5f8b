"""Prometheus metrics of the server, on a registry of its own (several servers may share a
process in tests). The engine thread writes them; ``/metrics`` renders them."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "megatron_async"


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, label = self.registry, {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, list(label), registry=r).labels(**label)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, list(label), registry=r).labels(**label)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, list(label), buckets=_LATENCY_BUCKETS, registry=r).labels(**label)

        self.running = gauge("num_requests_running", "Requests holding KV blocks (prefilling, decoding or paused).")
        self.waiting = gauge("num_requests_waiting", "Requests queued in the engine or in the server's inbox.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of KV blocks in use (1 = all).")
        self.overlap_ratio = gauge("overlap_ratio", "Share of decode steps launched ahead of the previous step's bookkeeping.")
        self.decode_steps = gauge("engine_decode_steps", "Decode-only engine steps so far.")
        self.overlapped_decode_steps = gauge("engine_overlapped_decode_steps",
                                             "Decode-only steps launched ahead (while the previous one was in flight).")
        self.prefill_tokens = gauge("engine_prefill_tokens", "Prompt tokens the engine computed so far.")
        self.held_steps = gauge("engine_held_steps", "Engine steps run while requests of a body above its share "
                                "of the places waited (their KV kept, no row).")
        self.shared_prompt_tokens = gauge("engine_shared_prompt_tokens",
                                          "Prompt tokens not prefilled because a request with the same prompt did.")
        self.ttft = histogram("time_to_first_token_seconds", "From HTTP arrival to the first generated token.")
        self.itl = histogram("inter_token_latency_seconds", "Between successive generated tokens of a request.")
        self.e2e = histogram("e2e_request_latency_seconds", "From HTTP arrival to the request's end.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.engine_steps = counter("engine_steps", "Engine steps run.")
        self._finished = Counter(f"{PREFIX}_request_success", "Requests ended, by finish reason.",
                                 ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name

    def finished(self, reason: str) -> None:
        self._finished.labels(model_name=self._model_name, finished_reason=reason).inc()

    def count_dropped_frames(self, name: str, stats) -> None:
        """``megatron_async_{name}_dropped_frames_total{reason}``: what a socket's ``WireStats``
        (communication/wire.py) dropped, read from ``stats`` whenever /metrics is rendered;
        reason "auth failed": handshakes that did not prove the key."""
        self.registry.register(_DroppedFrames(f"{PREFIX}_{name}_dropped_frames", self._model_name, stats))

    def count_frontend_requests(self, sinks) -> None:
        """Per HTTP front-end process (bridge.py's ``FrontendSink``: label ``frontend``, its index):
        ``megatron_async_frontend_requests_total`` handed to the engine and
        ``megatron_async_frontend_requests_running``, read whenever /metrics is rendered."""
        self.registry.register(_FrontendRequests(self._model_name, sinks))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _DroppedFrames:
    """A collector of one ``WireStats``' dropped frames, by reason."""

    def __init__(self, name: str, model_name: str, stats):
        self.name, self.model_name, self.stats = name, model_name, stats

    def collect(self):
        family = CounterMetricFamily(self.name, "Frames dropped (never read), by reason.",
                                     labels=["model_name", "reason"])
        counts = {**self.stats.dropped, "auth failed": self.stats.auth_failed}
        for reason, n in sorted(counts.items()):
            family.add_metric([self.model_name, reason], n)
        yield family


class _FrontendRequests:
    """A collector of each front-end's requests: how evenly the front-ends share the load."""

    def __init__(self, model_name: str, sinks):
        self.model_name, self.sinks = model_name, sinks

    def collect(self):
        total = CounterMetricFamily(f"{PREFIX}_frontend_requests", "Requests this HTTP front-end process handed "
                                    "to the engine.", labels=["model_name", "frontend"])
        running = GaugeMetricFamily(f"{PREFIX}_frontend_requests_running", "Requests of this HTTP front-end "
                                    "process not yet ended.", labels=["model_name", "frontend"])
        for sink in self.sinks:
            total.add_metric([self.model_name, str(sink.index)], sink.requests)
            running.add_metric([self.model_name, str(sink.index)], len(sink.live))
        yield total
        yield running
