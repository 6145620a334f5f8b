"""python -m megatron_async.coordinator [--listen tcp://127.0.0.1:PORT] [--dp-routing POLICY]

Runs a data-parallel coordinator: engines register with it (``python -m megatron_async.serve
--join ADDR``, ``LLM(..., join=ADDR)``), clients send it requests (``megatron_async.client``,
``python -m megatron_async.serve --engine ADDR``). The line ``megatron_async.coordinator:
listening on ADDR`` on stdout says where, once it listens. It stops on SIGTERM / Ctrl-C or a
client's ``shutdown``. The control plane listens on loopback unless told otherwise; a
non-loopback address needs MEGATRON_ASYNC_CLIENT_SECRET (or _FILE) here, on every engine and on
every client."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from megatron_async.config.modes import DpRouting
from megatron_async.coordinator.core import ENGINE_TIMEOUT_S, UNROUTED_TIMEOUT_S

READY_LINE = "megatron_async.coordinator: listening on "


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_async.coordinator", description=__doc__.splitlines()[0])
    p.add_argument("--listen", default="tcp://127.0.0.1:0",
                   help="tcp://HOST:PORT (port 0: a free one, printed) or ipc://PATH (default tcp://127.0.0.1:0)")
    p.add_argument("--dp-routing", choices=[r.value for r in DpRouting], default=DpRouting.LOAD_BALANCED.value,
                   help="which engine a new request goes to (InferenceConfig.dp_routing)")
    p.add_argument("--dp-routing-alpha", type=float, default=0.5,
                   help="--dp-routing scored: weight of prefix affinity against free capacity, in [0, 1]")
    p.add_argument("--unrouted-timeout-s", type=float, default=UNROUTED_TIMEOUT_S,
                   help="a request that finds no engine taking requests for this long ends with an error")
    p.add_argument("--engine-timeout-s", type=float, default=ENGINE_TIMEOUT_S,
                   help="an engine that sent nothing for this long (hung, its connection open) is dead: its requests "
                        "are routed again or end with an error, and it must join again (engines send a heartbeat "
                        "every second, also during a step)")
    p.add_argument("--seed", type=int, default=0, help="seeds the seeds of requests that bring none")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from megatron_async.coordinator.server import CoordinatorServer
    from megatron_async.coordinator.trust import SecretError

    try:
        server = CoordinatorServer(args.listen, args.dp_routing, args.dp_routing_alpha,
                                   unrouted_timeout_s=args.unrouted_timeout_s, seed=args.seed,
                                   engine_timeout_s=args.engine_timeout_s)
    except (SecretError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(READY_LINE + server.address, flush=True)
    try:
        server.serve(stop)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
