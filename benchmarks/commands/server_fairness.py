"""Does one body hold up everyone else? A short request's latency (2 greedy tokens) alone, behind
one body of --big-prompts prompts (16 tokens each), and while a --long-prompt-token prompt is
prefilled (--concurrent short requests at once); a body of --lone-prompts prompts alone (the
throughput sharing must not cost a body alone); the server's memory before, at the peak and
after the queue drained; how long the big body's abort took to drain.

    python -m benchmarks server-fairness --model CKPT [-- server flags]
    python -m benchmarks server-fairness --model CKPT -- --max-prompts-per-body 3000
Without --model it serves a tiny random checkpoint (with a tokenizer) built in a temp dir.
"""
from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHORT = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0.0}


class Client:
    def __init__(self, url: str, model: str, pid: int | None):
        u = urlparse(url)
        self.host, self.port, self.model, self.pid = u.hostname, u.port, model, pid
        self.peak_mb = 0.0

    def post(self, body: dict, timeout: float) -> tuple[int | str, float]:
        """(status, or the error that ended it; seconds)."""
        t0 = time.perf_counter()
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            c.request("POST", "/v1/completions", json.dumps({"model": self.model, **body}).encode(),
                      {"Content-Type": "application/json"})
            r = c.getresponse()
            r.read()
            return r.status, time.perf_counter() - t0
        except (TimeoutError, OSError) as e:
            return type(e).__name__, time.perf_counter() - t0
        finally:
            c.close()

    def metrics(self) -> dict[str, float]:
        c = http.client.HTTPConnection(self.host, self.port, timeout=30)
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
        c.close()
        values = {}
        for line in text.splitlines():
            if line.startswith("megatron_async_num_requests_"):
                name, value = line.rsplit(" ", 1)
                values[name.split("{")[0].removeprefix("megatron_async_num_requests_")] = float(value)
        return values

    def rss_mb(self) -> float:
        if self.pid is None:
            return float("nan")
        with open(f"/proc/{self.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        self.peak_mb = max(self.peak_mb, kb / 1024)
        return kb / 1024

    def wait_until(self, test, timeout: float) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            self.rss_mb()
            if test(self.metrics()):
                return time.perf_counter() - t0
            time.sleep(0.2)
        return float("inf")


def in_background(client: Client, body: dict, timeout: float) -> tuple[threading.Thread, dict]:
    """Send ``body`` on a thread whose connection the caller may close (``result['conn']``)."""
    result: dict = {}

    def send():
        c = http.client.HTTPConnection(client.host, client.port, timeout=timeout)
        result["conn"] = c
        t0 = time.perf_counter()
        try:
            c.request("POST", "/v1/completions", json.dumps({"model": client.model, **body}).encode(),
                      {"Content-Type": "application/json"})
            r = c.getresponse()
            r.read()
            result["status"] = r.status
        except (TimeoutError, OSError) as e:
            result["status"] = type(e).__name__
        result["s"] = time.perf_counter() - t0

    t = threading.Thread(target=send, daemon=True)
    t.start()
    return t, result


def concurrent_shorts(client: Client, n: int, timeout: float) -> list[tuple[int | str, float]]:
    out: list = [None] * n

    def one(i):
        out[i] = client.post(SHORT, timeout)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def fmt(results: list[tuple[int | str, float]]) -> str:
    ok = [s for status, s in results if status == 200]
    bad = [str(status) for status, _ in results if status != 200]
    text = f"{statistics.median(ok):.2f} / {max(ok):.2f} s" if ok else "-"
    return text + (f" ({len(bad)} not answered: {', '.join(sorted(set(bad)))})" if bad else "")


def run(client: Client, args) -> list[tuple[str, str, str]]:
    rows = []
    client.post(SHORT, 120)  # warm-up
    idle_mb = client.rss_mb()
    rows.append(("alone", fmt([client.post(SHORT, 120) for _ in range(args.repeats)]), f"RSS {idle_mb:.0f} MB"))
    if args.lone_prompts:
        lone = {"prompt": ["Tell me a story."] * args.lone_prompts, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        status, s = client.post(lone, 3600)
        rows.append((f"{args.lone_prompts} prompts alone", f"{s:.2f} s", f"{16 * args.lone_prompts / s:.0f} tok/s ({status})"))

    big = {"prompt": ["Tell me a story."] * args.big_prompts, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    thread, result = in_background(client, big, 3600)
    started = client.wait_until(lambda m: m.get("running", 0) > 0, 120)
    shorts = [client.post(SHORT, args.timeout_s) for _ in range(args.repeats)]
    if "conn" in result and result["conn"].sock is not None:  # the big body's client leaves: the server aborts it
        result["conn"].sock.shutdown(socket.SHUT_RDWR)
    drain = client.wait_until(lambda m: not m.get("running") and not m.get("waiting"), 600)
    thread.join(5)
    status = result.get("status", "left")
    rows.append((f"behind {args.big_prompts} prompts", fmt(shorts),
                 f"big body running after {started:.1f} s ({status}); drained {drain:.1f} s after it left; "
                 f"RSS peak {client.peak_mb:.0f} MB, after {client.rss_mb():.0f} MB"))

    if not args.long_prompt_tokens:
        return rows
    long = {"prompt": [100 + (7 * i) % 400 for i in range(args.long_prompt_tokens)], "max_tokens": 1,
            "temperature": 0.0}
    thread, result = in_background(client, long, 3600)
    client.wait_until(lambda m: m.get("running", 0) > 0, 120)
    time.sleep(0.5)  # its prefill is under way
    shorts = concurrent_shorts(client, args.concurrent, args.timeout_s)
    thread.join()
    rows.append((f"during a {args.long_prompt_tokens}-token prefill", fmt(shorts),
                 f"{args.concurrent} at once; the long prompt {result.get('s', float('nan')):.1f} s ({result.get('status')})"))
    return rows


def main() -> int:
    argv = sys.argv[1:]
    server_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint to serve (default: a tiny random one)")
    p.add_argument("--big-prompts", type=int, default=3000)
    p.add_argument("--lone-prompts", type=int, default=640,
                   help="a body of this many prompts (16 tokens each) alone first: its tok/s (0: skip)")
    p.add_argument("--long-prompt-tokens", type=int, default=3000, help="0: skip the long prefill")
    p.add_argument("--concurrent", type=int, default=8, help="short requests sent at once during the long prefill")
    p.add_argument("--repeats", type=int, default=3, help="short requests alone and behind the big body, one by one")
    p.add_argument("--timeout-s", type=float, default=60.0, help="a short request not answered by then counts as lost")
    args = p.parse_args(argv)
    from megatron_async.serve.process import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_checkpoint(Path(tmp) / "tiny-chat"))
        flags = ["--max-sequence-length", "4096", *server_flags]
        with ServerProcess(["--model", model, *flags], start_timeout_s=300) as srv:
            rows = run(Client(srv.url, srv.model_name, srv.proc.pid), args)
    print(f"\n{'short request (2 tokens)':<32} {'latency median / max':<40} notes")
    for name, latency, notes in rows:
        print(f"{name:<32} {latency:<40} {notes}")
    return 0


def tiny_checkpoint(path: Path) -> Path:
    from tests.helpers.chat_templates import save_chat_template
    from tests.helpers.hf_models import make_tiny_checkpoint

    make_tiny_checkpoint("LlamaForCausalLM", path, with_tokenizer=True, vocab_size=512, max_position_embeddings=4096)
    save_chat_template(path)
    return path


if __name__ == "__main__":
    sys.exit(main())
