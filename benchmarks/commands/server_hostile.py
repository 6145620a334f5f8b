"""The server as a hostile client meets it: random bodies on every route (admin ones included),
raw HTTP cases no client library sends, uploads that stop or stall, a 100,000-prompt body, a
3,000-prompt body beside short requests, while /health is polled. Fails (exit 1) on any 5xx,
any traceback or ERROR line in the server's log, a /health that did not answer, a seeded answer
that changed, or a short request behind the big body slower than --max-ratio x its latency alone.

    python -m benchmarks server-hostile --model CKPT [--bodies 2000] [-- server flags]
Without --model it serves a tiny random checkpoint (with a tokenizer) built in a temp dir.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.commands.server_fairness import SHORT, Client, in_background, tiny_checkpoint  # noqa: E402
from benchmarks.hostile_cases import ROUTES, random_body, raw_cases  # noqa: E402

JSON = {"Content-Type": "application/json"}


class Hostile:
    def __init__(self, url: str, model: str, pid: int, body_timeout_s: float):
        u = urlparse(url)
        self.host, self.port, self.model, self.pid, self.body_timeout_s = u.hostname, u.port, model, pid, body_timeout_s
        self.statuses: Counter = Counter()
        self.bad: list[str] = []
        self.health_misses = 0
        self.stop = threading.Event()

    def request(self, method: str, path: str, body: bytes | None = None, timeout: float = 30) -> int | str:
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            c.request(method, path, body=body, headers=JSON)
            r = c.getresponse()
            r.read()
            return r.status
        except (OSError, http.client.HTTPException) as e:
            return type(e).__name__
        finally:
            c.close()

    def note(self, what: str, status: int | str) -> None:
        self.statuses[status if isinstance(status, str) else f"{status // 100}xx"] += 1
        if isinstance(status, int) and status >= 500:
            self.bad.append(f"{what}: {status}")

    def poll_health(self) -> None:
        while not self.stop.is_set():
            if self.request("GET", "/health", timeout=5) != 200:
                self.health_misses += 1
            time.sleep(0.05)

    def fuzz(self, n: int, seed: int) -> None:
        rng, routes = random.Random(seed), sorted(ROUTES)
        jobs = [(routes[i % len(routes)], random_body(rng, ROUTES[routes[i % len(routes)]])) for i in range(n)]

        def one(job):
            path, body = job
            status = self.request("POST", path, body, timeout=60)
            self.note(f"POST {path} {body[:60]!r}", status)
            if status == 200 and not path.startswith("/v1/"):
                self.request("POST", "/resume_generation", b"{}")  # a fuzzed pause must not stall the rest

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, jobs))

    def raw(self) -> int:
        cases = raw_cases(self.host, self.port)
        for name, data in cases:
            for line in self._exchange(data):
                status = int(line.split()[1]) if len(line.split()) > 1 and line.split()[1].isdigit() else 0
                self.note(f"raw {name}", status)
        return len(cases)

    def _exchange(self, data: bytes) -> list[str]:
        """The status lines the server wrote back (it may close without one)."""
        s = socket.create_connection((self.host, self.port), timeout=5)
        got = b""
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(65536):
                got += chunk
        except OSError:
            pass
        finally:
            s.close()
        return re.findall(r"HTTP/1\.[01] \d{3}[^\r\n]*", got.decode("latin-1"))

    def uploads(self, aborted: int, stalled: int) -> Counter:
        """Clients that leave mid-body, and ones that stall until the server's body timeout."""
        out: Counter = Counter()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n")

        def leave(i):
            s = socket.create_connection((self.host, self.port), timeout=5)
            chunked = head.replace(b"Content-Length: 100", b"Transfer-Encoding: chunked") + b'40\r\n{"pro'
            s.sendall(head + b'{"pro' if i % 2 else chunked)
            s.close()
            out["left"] += 1

        def stall(_):
            s = socket.create_connection((self.host, self.port), timeout=self.body_timeout_s + 20)
            s.sendall(head + b'{"pro')
            try:
                line = s.recv(4096).decode("latin-1").split("\r\n")[0]
            except OSError as e:
                line = type(e).__name__
            s.close()
            out[line[9:12] if line.startswith("HTTP/") else line or "closed"] += 1

        with ThreadPoolExecutor(32) as pool:
            list(pool.map(leave, range(aborted)))
            list(pool.map(stall, range(stalled)))
        return out

    def seeded(self) -> list[str]:
        answers = []
        for i in range(8):
            c = http.client.HTTPConnection(self.host, self.port, timeout=120)
            c.request("POST", "/v1/completions", json.dumps({"model": self.model, "prompt": f"Story {i}:",
                                                             "max_tokens": 8, "temperature": 0.8, "seed": i}), JSON)
            answers.append(json.loads(c.getresponse().read())["choices"][0]["text"])
            c.close()
        return answers


def fairness(client: Client, big_prompts: int, repeats: int) -> tuple[float, float, str]:
    alone = statistics.median(client.post(SHORT, 120)[1] for _ in range(repeats))
    huge = {"prompt": [[1]] * 100_000, "max_tokens": 1}
    status, _ = client.post(huge, 120)
    thread, result = in_background(client, {"prompt": ["Tell me a story."] * big_prompts, "max_tokens": 16,
                                            "temperature": 0.0, "ignore_eos": True}, 3600)
    client.wait_until(lambda m: m.get("running", 0) > 0, 120)
    behind = [client.post(SHORT, 300) for _ in range(repeats)]
    if "conn" in result and result["conn"].sock is not None:
        result["conn"].sock.shutdown(socket.SHUT_RDWR)  # the big body's client leaves
    drain = client.wait_until(lambda m: not m.get("running") and not m.get("waiting"), 600)
    thread.join(5)
    ok = [s for st, s in behind if st == 200]
    return alone, statistics.median(ok) if len(ok) == len(behind) else float("inf"), \
        f"100,000-prompt body: {status}; big body drained {drain:.1f} s after its client left"


def run(h: Hostile, client: Client, args, log_path: Path) -> bool:
    poller = threading.Thread(target=h.poll_health, daemon=True)
    poller.start()
    before, idle_mb = h.seeded(), client.rss_mb()
    t = time.perf_counter()
    h.fuzz(args.bodies, args.seed)
    fuzz_s, raw_n = time.perf_counter() - t, h.raw()
    h.request("POST", "/resume_generation", b"{}")
    uploads = h.uploads(args.aborted, args.stalled)
    alone, behind, big = fairness(client, args.big_prompts, args.repeats)
    after, after_mb = h.seeded(), client.rss_mb()
    h.stop.set()
    poller.join()
    log = log_path.read_text(errors="replace")
    tracebacks, errors = log.count("Traceback"), len(re.findall(r" ERROR ", log))
    ratio = behind / alone
    checks = {"no 5xx": not h.bad, "no traceback / ERROR in the log": not tracebacks and not errors,
              "/health always answered": h.health_misses == 0, "seeded answers unchanged": before == after,
              f"short request behind the big body within {args.max_ratio:g}x alone": ratio <= args.max_ratio,
              "stalled uploads got 408": uploads.get("408", 0) == args.stalled}
    print(f"\nfuzzed bodies: {args.bodies} on {len(ROUTES)} routes in {fuzz_s:.0f} s; raw HTTP cases: {raw_n}; "
          f"answers by class: {dict(sorted(h.statuses.items()))}")
    print(f"uploads: {args.aborted} left mid-body, {args.stalled} stalled: {dict(uploads)}")
    print(f"short request: alone {alone:.2f} s, behind {args.big_prompts} prompts {behind:.2f} s ({ratio:.1f}x); {big}")
    print(f"server RSS: idle {idle_mb:.0f} MB, peak {client.peak_mb:.0f} MB, after {after_mb:.0f} MB; "
          f"log: {log.count(chr(10))} lines, {tracebacks} tracebacks, {errors} ERROR lines; "
          f"/health misses {h.health_misses}")
    for line in h.bad[:10]:
        print("  5xx:", line)
    lines = log.splitlines()
    warnings = Counter(re.sub(r"^\S+ \S+ ", "", line)[:120] for line in lines if "WARNING" in line)
    for line, n in warnings.most_common(8):
        print(f"  warning x{n}: {line}")
    for i in [k for k, line in enumerate(lines) if "Traceback" in line or " ERROR " in line][:3]:
        print("  log:", "\n  log: ".join(lines[max(0, i - 2):i + 25]))
    print(f"\n{'check':<56} result")
    for name, passed in checks.items():
        print(f"{name:<56} {'ok' if passed else 'FAILED'}")
    return all(checks.values())


def main() -> int:
    argv = sys.argv[1:]
    server_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--bodies", type=int, default=2000)
    p.add_argument("--aborted", type=int, default=200, help="clients that leave mid-body")
    p.add_argument("--stalled", type=int, default=100, help="clients whose body stalls past the body timeout")
    p.add_argument("--big-prompts", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-ratio", type=float, default=5.0)
    p.add_argument("--body-timeout-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from megatron_async.serve.process import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_checkpoint(Path(tmp) / "tiny-chat"))
        weights = Path(tmp) / "weights"
        weights.mkdir()
        flags = ["--model", model, "--max-sequence-length", "4096", "--enable-admin-endpoints", "--log-level", "info",
                 "--allowed-weights-dir", str(weights), "--body-timeout-s", str(args.body_timeout_s),
                 "--max-prompts-per-body", str(args.big_prompts), *server_flags]
        log_path = Path(tmp) / "server.log"
        with ServerProcess(flags, start_timeout_s=300, log_path=str(log_path)) as srv:
            h = Hostile(srv.url, srv.model_name, srv.proc.pid, args.body_timeout_s)
            ok = run(h, Client(srv.url, srv.model_name, srv.proc.pid), args, log_path)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
