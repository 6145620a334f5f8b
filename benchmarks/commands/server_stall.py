"""Does a huge prompt stall the server? Starts a server (or uses --url), keeps --streams greedy
streams running and polls /health, first alone, then while big prompts are sent one after
another: 5 MB completions text, a 5 MB chat message (both over any prompt the model can hold)
and a --tokenized-kb text prompt (tokenized, then refused as too long unless the model holds it).
Prints /health latency and the streams' inter-chunk gaps (p50 / p99 / max) per phase.

    python -m benchmarks server-stall --model CKPT [--streams 4] [-- server flags]
    python -m benchmarks server-stall --url http://127.0.0.1:8000
Without --model / --url it serves a tiny random checkpoint (with a tokenizer) built in a temp dir.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class Probe:
    def __init__(self, url: str, model: str):
        u = urlparse(url)
        self.host, self.port, self.model = u.hostname, u.port, model
        self.gaps: list[tuple[float, float]] = []  # (when, gap) of stream chunks
        self.health: list[tuple[float, float]] = []  # (when, latency) of /health
        self.stop = threading.Event()

    def conn(self, timeout: float = 300) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def post(self, path: str, body: dict) -> tuple[int, str, float]:
        raw, c, t = json.dumps(body).encode(), self.conn(), time.perf_counter()
        c.request("POST", path, raw, {"Content-Type": "application/json"})
        r = c.getresponse()
        text = r.read().decode(errors="replace")
        c.close()
        return r.status, text, time.perf_counter() - t

    def stream_forever(self) -> None:
        body = json.dumps({"model": self.model, "prompt": "The quick brown fox", "max_tokens": 256, "stream": True,
                           "temperature": 0, "ignore_eos": True}).encode()
        while not self.stop.is_set():
            c = self.conn()
            c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            last = None
            for line in c.getresponse():
                if line.startswith(b"data: "):
                    now = time.perf_counter()
                    if last is not None:
                        self.gaps.append((now, now - last))
                    last = now
                if self.stop.is_set():
                    break
            c.close()

    def poll_health(self) -> None:
        while not self.stop.is_set():
            c, t = self.conn(60), time.perf_counter()
            c.request("GET", "/health")
            c.getresponse().read()
            self.health.append((t, time.perf_counter() - t))
            c.close()
            time.sleep(0.01)


def pct(values: list[float]) -> str:
    if not values:
        return "      -        -        -"
    v = sorted(values)
    p99 = v[min(len(v) - 1, int(0.99 * len(v)))]
    return f"{1e3 * statistics.median(v):8.1f} {1e3 * p99:8.1f} {1e3 * v[-1]:8.1f}"


def run(url: str, model: str, streams: int, baseline_s: float, prompt_mb: float, tokenized_kb: float) -> None:
    probe = Probe(url, model)
    threads = [threading.Thread(target=probe.stream_forever, daemon=True) for _ in range(streams)]
    threads.append(threading.Thread(target=probe.poll_health, daemon=True))
    for t in threads:
        t.start()
    time.sleep(baseline_s)  # the streams warm up and run alone
    big_text = "word " * int(prompt_mb * 2**20 / 5)
    bigs = [(f"completions {prompt_mb:g} MB", "/v1/completions",
             {"model": model, "prompt": big_text, "max_tokens": 4}),
            (f"chat {prompt_mb:g} MB", "/v1/chat/completions",
             {"model": model, "messages": [{"role": "user", "content": big_text}], "max_tokens": 4}),
            (f"completions {tokenized_kb:g} KB", "/v1/completions",
             {"model": model, "prompt": "word " * int(tokenized_kb * 1024 / 5), "max_tokens": 4})]
    windows = [("alone", time.perf_counter() - baseline_s + 1.0, time.perf_counter(), "", "")]
    for name, path, body in bigs:
        t0 = time.perf_counter()
        status, text, took = probe.post(path, body)
        reason = json.loads(text)["error"]["message"][:60] if status != 200 else "ok"
        windows.append((name, t0, time.perf_counter(), f"{status} in {took:.2f} s", reason))
    time.sleep(1.0)
    probe.stop.set()
    print(f"\n{'phase':<22} {'big request':<14} {'/health ms p50 / p99 / max':>27}   "
          f"{'stream gaps ms p50 / p99 / max':>30}   reason")
    for name, t0, t1, result, reason in windows:
        health = [v for t, v in probe.health if t0 <= t <= t1]
        gaps = [v for t, v in probe.gaps if t0 <= t <= t1]
        print(f"{name:<22} {result:<14} {pct(health):>27}   {pct(gaps):>30}   {reason}")


def main() -> int:
    argv = sys.argv[1:]
    server_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="an already running server")
    p.add_argument("--model", default=None, help="checkpoint to serve (default: a tiny random one)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--baseline-s", type=float, default=5.0, help="seconds the streams run alone first")
    p.add_argument("--prompt-mb", type=float, default=5.0)
    p.add_argument("--tokenized-kb", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.url:
        import urllib.request

        with urllib.request.urlopen(f"{args.url}/v1/models", timeout=30) as r:
            name = json.loads(r.read())["data"][0]["id"]
        run(args.url, name, args.streams, args.baseline_s, args.prompt_mb, args.tokenized_kb)
        return 0
    from megatron_async.serve.process import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_checkpoint(Path(tmp) / "tiny-chat"))
        flags = server_flags or (["--max-sequence-length", "16384", "--num-kv-blocks", "1100"] if not args.model else [])
        with ServerProcess(["--model", model, *flags]) as srv:
            run(srv.url, srv.model_name, args.streams, args.baseline_s, args.prompt_mb, args.tokenized_kb)
    return 0


def tiny_checkpoint(path: Path) -> Path:
    from tests.helpers.chat_templates import save_chat_template
    from tests.helpers.hf_models import make_tiny_checkpoint

    make_tiny_checkpoint("LlamaForCausalLM", path, with_tokenizer=True, vocab_size=512, max_position_embeddings=16384)
    save_chat_template(path)
    return path


if __name__ == "__main__":
    sys.exit(main())
