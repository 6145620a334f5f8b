"""A running server's own view through its Prometheus ``/metrics``: the samples by name, whether
it still holds requests or KV blocks after its clients left, and its engine-side summary."""
from __future__ import annotations

import time


def server_metrics(base_url: str) -> dict[str, float]:
    """The server's ``/metrics`` samples by name (those without labels other than the model's)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels.keys() - {"model_name"}}


def kv_leaked(base_url: str, settle_s: float = 30.0) -> bool:
    """Whether the server still holds requests or KV blocks ``settle_s`` after its clients are
    done (an abort frees its blocks at the next step, so it gets a moment)."""
    deadline = time.monotonic() + settle_s
    while True:
        v = server_metrics(base_url)
        held = [v.get(f"megatron_async_{n}", 0.0) for n in ("num_requests_running", "num_requests_waiting",
                                                             "kv_cache_usage_perc")]
        if not any(held):
            return False
        if time.monotonic() > deadline:
            print(f"server still holds: running {held[0]:.0f}, waiting {held[1]:.0f}, KV usage {held[2]:.3f}")
            return True
        time.sleep(0.2)


def server_side_summary(base_url: str) -> str:
    """The server's own view from ``/metrics`` (cumulative since it started, warm-up included):
    mean TTFT and inter-token latency as the engine thread saw them, and the launch-ahead share."""
    v = server_metrics(base_url)

    def mean_ms(name: str) -> str:
        n = v.get(f"megatron_async_{name}_count", 0.0)
        return f"{1e3 * v[f'megatron_async_{name}_sum'] / n:.1f} ms" if n else "n/a"

    return (f"server: {v.get('megatron_async_engine_steps_total', 0):.0f} engine steps, "
            f"{v.get('megatron_async_engine_decode_steps', 0):.0f} decode-only, overlap ratio "
            f"{v.get('megatron_async_overlap_ratio', 0):.3f}; mean TTFT {mean_ms('time_to_first_token_seconds')}, "
            f"mean inter-token {mean_ms('inter_token_latency_seconds')}")
